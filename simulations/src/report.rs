//! What a run reports, and the SVG chart of one or more reports.

use crate::Strategy;
use crate::scenario::Scenario;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// Samples kept before the sampling interval doubles.
const MAX_SAMPLES: usize = 256;
/// Points kept in the completion CDF.
const CDF_POINTS: usize = 200;

/// Cumulative registry bytes sampled at a regular interval that doubles (and
/// drops every other sample) whenever the series gets long, so a run of any
/// length keeps a bounded series.
#[derive(Debug)]
pub(crate) struct Samples {
    dt: f64,
    points: Vec<(f64, f64)>,
}

impl Samples {
    pub fn new(dt: f64) -> Self {
        Self {
            dt: if dt.is_finite() && dt > 0.0 { dt } else { 1.0 },
            points: Vec::new(),
        }
    }

    /// Records a sample; returns how long until the next one.
    pub fn push(&mut self, t: f64, bytes: f64) -> f64 {
        self.points.push((t, bytes));
        if self.points.len() > MAX_SAMPLES {
            let mut k = 0;
            self.points.retain(|_| {
                k += 1;
                k % 2 == 1
            });
            self.dt *= 2.0;
        }
        self.dt
    }

    pub fn finish(&mut self, t: f64, bytes: f64) {
        if self.points.last().is_none_or(|&(last, _)| last < t) {
            self.points.push((t, bytes));
        }
    }
}

/// Registry egress over one interval of simulated time.
#[derive(Clone, Debug, Serialize)]
pub struct EgressBucket {
    pub start_s: f64,
    pub end_s: f64,
    pub bytes_per_s: f64,
}

/// The outcome of one strategy on one scenario.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub scenario: String,
    pub strategy: String,
    pub seed: u64,
    /// Nodes that pull (including those that left).
    pub nodes: u32,
    /// Nodes that stayed and completed (claimers, which pull nothing, are
    /// counted nowhere but in `adversity.claimers`).
    pub completed: u32,
    /// Nodes that left before or after completing; not in the percentiles.
    pub left: u32,
    /// Nodes that stayed but had not completed when the run stopped.
    pub incomplete: u32,
    pub image_bytes: u64,
    pub layers: u32,
    /// The unit moved by the simulator (4 MiB, or a coarser batch of chunks).
    pub sim_chunk_bytes: u64,
    /// Completion times are from each node's own start.
    pub p50_s: f64,
    pub p99_s: f64,
    pub max_s: f64,
    pub lower_bound_s: f64,
    /// p99_s / lower_bound_s.
    pub bound_ratio: f64,
    pub registry_egress_bytes: f64,
    /// registry_egress_bytes / image_bytes: 1.0 means each byte left the registry once.
    pub registry_egress_ratio: f64,
    /// Simulated time when the run stopped.
    pub sim_end_s: f64,
    pub events: u64,
    /// Pulls (a node's blob) whose machine fell back to the registry, counted
    /// per escalation (a pull going silent-tracker then stalled counts twice).
    pub fallbacks: u64,
    /// The same escalations by the rule that fired, and when.
    pub fallback_rules: Fallbacks,
    /// Wall-clock time of the run (the only field that differs between identical runs).
    pub wall_s: f64,
    /// Simulated events a wall-clock second (`events / wall_s`; varies with
    /// the host like `wall_s`).
    pub events_per_s: f64,
    /// (seconds, fraction of completed nodes done by then).
    pub completion_cdf: Vec<(f64, f64)>,
    pub registry_egress: Vec<EgressBucket>,
    /// What the DHT cost (`dray-dht` only).
    pub dht: Option<DhtReport>,
    pub adversity: Adversity,
}

/// Pull machines' escalations to the registry, by the rule that fired
/// (`dray_protocol::pull::Fallback`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fallbacks {
    /// The tracker answered but nothing came for its grace while a
    /// published chunk no live peer could give was missing.
    pub starved: u64,
    /// The tracker went unheard for its grace.
    pub tracker_silent: u64,
    /// Nothing arrived for `stall` (or the pull had no swarm at all).
    pub stalled: u64,
    /// Simulated seconds of the first and the last escalation.
    pub first_s: Option<f64>,
    pub last_s: Option<f64>,
}

impl Fallbacks {
    /// A pull escalated to `mode` at simulated second `at`.
    pub(crate) fn record(&mut self, mode: dray_protocol::pull::Fallback, at: f64) {
        use dray_protocol::pull::Fallback;
        match mode {
            Fallback::Off => return,
            Fallback::Starved => self.starved += 1,
            Fallback::Unavailable => self.tracker_silent += 1,
            Fallback::All => self.stalled += 1,
        }
        self.first_s.get_or_insert(at);
        self.last_s = Some(at);
    }

    pub fn total(&self) -> u64 {
        self.starved + self.tracker_silent + self.stalled
    }
}

/// What liars, frozen peers and registry errors did to a run, and how the
/// pull rules answered: what `dray sim --chaos` checks beyond completion.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Adversity {
    /// Chunks held at the end by nodes that do not lie whose bytes fail
    /// their hash: bytes handed to a mirror's client (0 unless a rule is broken).
    pub bad_chunks: u64,
    /// Liars; those that sent some node a chunk (all bytes that fail its
    /// hash); those some node banned for it.
    pub liars: u32,
    pub liars_served: u32,
    pub liars_banned: u32,
    /// Times a node banned or dropped a peer that neither lies nor froze.
    pub honest_dropped: u64,
    /// Nodes the tracker banned on bad-chunk reports that do not lie.
    pub honest_banned: u32,
    /// Times a node dropped a frozen peer, a withholder or a trickler past
    /// a request's deadline.
    pub frozen_dropped: u64,
    /// Nodes that pull and announce but answer no chunk request.
    pub withholders: u32,
    /// Nodes that report every peer named to them silent.
    pub accusers: u32,
    /// Nodes that answer every chunk request too slowly for its deadline.
    pub tricklers: u32,
    /// Nodes that claim every chunk and answer no chunk request.
    pub claimers: u32,
    /// Nodes whose disk is full: they pull directly from the registry.
    pub disk_full: u32,
    /// Registry requests a server error failed, and pulls that failed as
    /// the last attempt did.
    pub registry_errors: u64,
    pub failed_pulls: u32,
}

/// The DHT's own cost in a `dray-dht` run (see `kademlia`): counted, not
/// sent through the links.
#[derive(Clone, Debug, Serialize)]
pub struct DhtReport {
    /// Rounds of a new node's lookup of its own id, median and most of 64.
    pub join_rounds_p50: u32,
    pub join_rounds_max: u32,
    /// The median join's time: three round trips a round (TCP, TLS, the request).
    pub join_s_p50: f64,
    /// What the median join (its whole bootstrap) sends and receives.
    pub join_bytes_p50: u64,
    /// Provider lookups of the storm (one per blob per node per `dht.lookup`).
    pub lookups: u64,
    /// The storm's DHT traffic, every node's, inside TLS.
    pub bytes: f64,
    pub bytes_per_node: f64,
    /// The busiest key's stores: lookups each answers per second, and the
    /// bytes of those answers.
    pub hottest_store_requests_per_s: f64,
    pub hottest_store_bytes_per_s: f64,
    /// The most members any node saw of a blob (the stores' cap).
    pub max_members: usize,
    /// The most nodes the DHT's rule handed registry runs of one blob
    /// (`dray_protocol::dht::fetcher_candidates`: at most `FETCHERS`, or
    /// one more for a node whose every candidate failed).
    pub max_fetchers: usize,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The raw numbers a run hands to [`SimReport::new`].
pub(crate) struct Outcome {
    pub strategy: Strategy,
    pub seed: u64,
    /// Completion time of each node that stayed and completed, from its start.
    pub times: Vec<f64>,
    pub left: u32,
    pub registry_bytes: f64,
    pub end: f64,
    pub events: u64,
    pub fallbacks: Fallbacks,
    pub samples: Samples,
    pub wall_s: f64,
    pub dht: Option<DhtReport>,
    pub adversity: Adversity,
}

impl SimReport {
    pub(crate) fn new(sc: &Scenario, o: Outcome) -> Self {
        let Outcome {
            strategy,
            seed,
            mut times,
            left,
            registry_bytes,
            end,
            events,
            fallbacks,
            samples,
            wall_s,
            dht,
            adversity,
        } = o;
        times.sort_by(f64::total_cmp);
        let completed = times.len() as u32;
        let lower = sc.lower_bound_s();
        let p99 = percentile(&times, 0.99);
        let image_bytes = sc.layer_bytes() * u64::from(sc.layers);
        let step = times.len().div_ceil(CDF_POINTS).max(1);
        let mut cdf: Vec<(f64, f64)> = times
            .iter()
            .enumerate()
            .filter(|(k, _)| (k + 1) % step == 0)
            .map(|(k, &t)| (t, (k + 1) as f64 / times.len() as f64))
            .collect();
        if let Some(&last) = times.last()
            && cdf.last().is_none_or(|&(_, f)| f < 1.0)
        {
            cdf.push((last, 1.0));
        }
        let registry_egress = samples
            .points
            .windows(2)
            .filter(|w| w[1].0 > w[0].0)
            .map(|w| EgressBucket {
                start_s: w[0].0,
                end_s: w[1].0,
                bytes_per_s: (w[1].1 - w[0].1) / (w[1].0 - w[0].0),
            })
            .collect();
        Self {
            scenario: sc.name.clone(),
            strategy: strategy.name().to_owned(),
            seed,
            nodes: sc.nodes,
            completed,
            left,
            incomplete: sc.nodes - completed - left - adversity.claimers,
            image_bytes,
            layers: sc.layers,
            sim_chunk_bytes: sc.sim_chunk_bytes,
            p50_s: percentile(&times, 0.5),
            p99_s: p99,
            max_s: times.last().copied().unwrap_or(0.0),
            lower_bound_s: lower,
            bound_ratio: p99 / lower,
            registry_egress_bytes: registry_bytes,
            registry_egress_ratio: registry_bytes / image_bytes as f64,
            sim_end_s: end,
            events,
            fallbacks: fallbacks.total(),
            fallback_rules: fallbacks,
            wall_s,
            events_per_s: events as f64 / wall_s.max(1e-9),
            completion_cdf: cdf,
            registry_egress,
            dht,
            adversity,
        }
    }
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];
const W: f64 = 520.0;
const H: f64 = 340.0;
const PAD: f64 = 56.0;

/// A panel's x axis: linear, or log10 when the series span more than 20x.
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    fn new(lo: f64, hi: f64) -> Self {
        let lo = lo.max(1e-3);
        let hi = hi.max(lo * 1.01);
        let log = hi / lo > 20.0;
        Self {
            lo: if log { lo } else { 0.0 },
            hi,
            log,
        }
    }

    fn frac(&self, v: f64) -> f64 {
        if self.log {
            (v.max(self.lo).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            v / self.hi
        }
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut t = Vec::new();
            let mut v = 10f64.powf(self.lo.log10().floor());
            while v <= self.hi * 1.0001 {
                if v >= self.lo {
                    t.push(v);
                }
                v *= 10.0;
            }
            t
        } else {
            (0..=4).map(|k| self.hi * f64::from(k) / 4.0).collect()
        }
    }
}

fn label(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// One chart panel: where it goes, its labels and scales.
struct Panel<'a> {
    x0: f64,
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    axis: &'a Axis,
    y_max: f64,
}

/// Draws a panel's axes, ticks and one polyline per series.
fn panel(svg: &mut String, p: &Panel, series: &[Vec<(f64, f64)>]) {
    let Panel {
        x0,
        title,
        x_label,
        y_label,
        axis,
        y_max,
    } = *p;
    let (pw, ph) = (W - 2.0 * PAD, H - 2.0 * PAD);
    let px = |x: f64| x0 + PAD + axis.frac(x) * pw;
    let py = |y: f64| H - PAD - (y / y_max) * ph;
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" font-size="14" text-anchor="middle">{title}</text>"#,
        x0 + W / 2.0
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{}" y="{PAD}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>"##,
        x0 + PAD
    );
    for t in axis.ticks() {
        let x = px(t);
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{}" font-size="10" text-anchor="middle">{}</text>"#,
            H - PAD + 14.0,
            label(t)
        );
    }
    for k in 0..=4 {
        let y = y_max * f64::from(k) / 4.0;
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{:.1}" font-size="10" text-anchor="end">{}</text>"#,
            x0 + PAD - 4.0,
            py(y) + 3.0,
            label(y)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">{x_label}</text>"#,
        x0 + W / 2.0,
        H - 14.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle" transform="rotate(-90 {} {})">{y_label}</text>"#,
        x0 + 14.0,
        H / 2.0,
        x0 + 14.0,
        H / 2.0
    );
    for (k, points) in series.iter().enumerate() {
        let pts: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
            COLORS[k % COLORS.len()],
            pts.join(" ")
        );
    }
}

/// Renders the completion CDFs and registry egress over time of `reports`
/// (one line each, typically one scenario under several strategies) as an SVG.
pub fn write_svg(reports: &[SimReport], path: &Path) -> std::io::Result<()> {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif">"#,
        2.0 * W,
        H + 20.0 + 16.0 * reports.len() as f64
    );
    let scenario = reports.first().map_or("", |r| r.scenario.as_str());
    let (t_min, t_max) = reports
        .iter()
        .flat_map(|r| r.completion_cdf.iter().map(|p| p.0))
        .fold((f64::INFINITY, 0f64), |(lo, hi), t| (lo.min(t), hi.max(t)));
    let cdf_axis = Axis::new(if t_min.is_finite() { t_min } else { 1.0 }, t_max);
    let cdfs: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|r| {
            let mut pts = vec![(cdf_axis.lo, 0.0)];
            pts.extend(r.completion_cdf.iter().copied());
            pts
        })
        .collect();
    panel(
        &mut svg,
        &Panel {
            x0: 0.0,
            title: &format!("{scenario}: nodes done (CDF)"),
            x_label: "seconds from node start",
            y_label: "fraction done",
            axis: &cdf_axis,
            y_max: 1.0,
        },
        &cdfs,
    );
    let e_end = reports.iter().map(|r| r.sim_end_s).fold(0f64, f64::max);
    let e_start = reports
        .iter()
        .flat_map(|r| r.registry_egress.first().map(|b| b.end_s))
        .fold(f64::INFINITY, f64::min);
    let egress_axis = Axis::new(if e_start.is_finite() { e_start } else { 1.0 }, e_end);
    let mb = |b: &EgressBucket| b.bytes_per_s / 1e6;
    let e_max = reports
        .iter()
        .flat_map(|r| r.registry_egress.iter().map(mb))
        .fold(1e-9f64, f64::max);
    let egress: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|r| {
            r.registry_egress
                .iter()
                .flat_map(|b| [(b.start_s.max(egress_axis.lo), mb(b)), (b.end_s, mb(b))])
                .collect()
        })
        .collect();
    panel(
        &mut svg,
        &Panel {
            x0: W,
            title: &format!("{scenario}: registry egress"),
            x_label: "simulated seconds",
            y_label: "MB/s",
            axis: &egress_axis,
            y_max: e_max * 1.05,
        },
        &egress,
    );
    for (k, r) in reports.iter().enumerate() {
        let _ = writeln!(
            svg,
            r#"<text x="{PAD}" y="{:.0}" font-size="12" fill="{}">{}: p50 {:.1}s p99 {:.1}s (bound {:.1}s, x{:.2}), registry egress x{:.2} of the image</text>"#,
            H + 12.0 + 16.0 * k as f64,
            COLORS[k % COLORS.len()],
            r.strategy,
            r.p50_s,
            r.p99_s,
            r.lower_bound_s,
            r.bound_ratio,
            r.registry_egress_ratio
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, svg)
}
