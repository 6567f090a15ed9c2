//! Named storm scenarios: cluster size, image, bandwidths and the disturbances
//! (churn or crashes, late joiners, a tracker outage, hang or partition;
//! liars, frozen peers, registry errors) a run injects.

use crate::SimError;
use dray_protocol::defaults::{DEFAULTS, secs};
use serde::Serialize;

/// 4 MiB, the agent's chunk size.
pub const CHUNK_BYTES: u64 = dray_protocol::DEFAULT_CHUNK_SIZE as u64;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// 10 Gbit/s in bytes per second.
const TEN_GBIT: f64 = 1.25e9;
/// Payload bytes per byte on the wire for a bulk transfer over TCP or QUIC
/// on Ethernet frames of `mtu` bytes: each frame carries 52 bytes of IP and
/// TCP headers (with timestamps; QUIC's IP, UDP, short header and AEAD tag
/// come to about the same) and a 14-byte Ethernet header, which tbf counts.
/// It matches what `dray bench storm` measured (`docs/results.md`, "The wire").
pub fn wire_efficiency(mtu: u16) -> f64 {
    (f64::from(mtu) - 52.0) / (f64::from(mtu) + 14.0)
}
/// Round trip between two nodes of `dray bench storm` while the swarm runs:
/// the tbf queues (up to 50 ms each) fill under load. Measured with a UDP
/// echo every 100 ms from node 0 to node 1 during a 4-node, 64 MiB run:
/// median 36 ms, mean 40 ms, p10 20 ms, p90 71 ms (0-1 ms when idle).
pub const EMULATED_RTT_S: f64 = 0.036;
/// How unevenly flows share a link of `dray bench storm` (tbf drop-tail
/// queues, QUIC and TCP congestion control, 2 busy cores): the sigma of the
/// flows' lognormal weights that best fits the spread of chunk transfer times
/// there. Measured over five 4-node, 64 MiB runs (240 peer chunks, 80
/// registry chunks): transfer time over its mean varies by 0.62 (median
/// coefficient of variation; 0.34-0.72) for peer chunks, 0.40 (0.35-0.46) for
/// registry ranges. Simulated over seeds 1-5: sigma 0.4 gives 0.36 and 0.46,
/// 0.5 gives 0.45 and 0.48, 0.6 gives 0.47 and 0.59, 0.75 gives 0.56 and
/// 0.64; 0.5 has the least squared error. Equal shares (sigma 0) had every
/// chunk of a round finish together and predicted 11-25% too fast. (Four
/// TCP flows into one capped link of this testbed, measured with iperf3,
/// filled it (96.8 Mbit/s of goodput) but split it 83/5/4/4.)
pub const EMULATED_FLOW_WEIGHT_SIGMA: f64 = 0.5;

/// Every name [`scenario`] accepts.
pub const SCENARIOS: &[&str] = &[
    "small",
    "kraken-2600",
    "storm-10k",
    "storm-100k",
    "churn-10k",
    "rack-oversub",
    "outage-1k",
];

/// Nodes grouped into racks whose uplink is oversubscribed.
#[derive(Clone, Debug, Serialize)]
pub struct Racks {
    pub nodes_per_rack: u32,
    /// Sum of the rack's node links divided by its uplink capacity (4.0 = 4:1).
    /// The uplink has this capacity in each direction.
    pub oversubscription: f64,
}

/// A fraction of nodes (chosen at random) leave at a given time.
#[derive(Clone, Debug, Serialize)]
pub struct Churn {
    pub fraction: f64,
    pub at_s: f64,
    /// They crash: the tracker is not told (no `Leave`), and learns it only
    /// as their announces stop and their runs fall behind.
    pub crash: bool,
}

/// A fraction of nodes start pulling at `at_s` instead of at 0.
#[derive(Clone, Debug, Serialize)]
pub struct LateJoiners {
    pub fraction: f64,
    pub at_s: f64,
}

/// A fraction of nodes (chosen at random) freeze at `at_s`, for good: their
/// process stops (SIGSTOP), their connections stay open and answer nothing.
#[derive(Clone, Debug, Serialize)]
pub struct Freeze {
    pub fraction: f64,
    pub at_s: f64,
}

/// The tracker answers nothing in `[at_s, at_s + for_s)`, then comes back
/// restarted (empty state).
#[derive(Clone, Debug, Serialize)]
pub struct Outage {
    pub at_s: f64,
    pub for_s: f64,
}

/// A fraction of nodes (chosen at random) cannot reach the tracker in
/// `[at_s, at_s + for_s)`: their announces are lost; peers and the registry
/// they still reach.
#[derive(Clone, Debug, Serialize)]
pub struct Partition {
    pub fraction: f64,
    pub at_s: f64,
    pub for_s: f64,
}

/// One storm: who pulls what over which links. Bandwidths are bytes per second.
#[derive(Clone, Debug, Serialize)]
pub struct Scenario {
    pub name: String,
    pub nodes: u32,
    pub layers: u32,
    /// Total image size F, split evenly over the layers.
    pub image_bytes: u64,
    /// The unit the simulator moves: a multiple of the agent's 4 MiB chunk.
    /// Larger units coarsen big storms so they finish in budget.
    pub sim_chunk_bytes: u64,
    pub node_up_bps: f64,
    pub node_down_bps: f64,
    /// Registry (or Kraken origin) egress cap u_s.
    pub registry_bps: f64,
    pub racks: Option<Racks>,
    pub churn: Option<Churn>,
    pub late_joiners: Option<LateJoiners>,
    pub outage: Option<Outage>,
    /// The tracker hangs (stopped, its connections open) in
    /// `[at_s, at_s + for_s)`: it answers nothing, then carries on with its state.
    pub hang: Option<Outage>,
    pub partition: Option<Partition>,
    /// A fraction of nodes (chosen at random) that lie: every chunk asked
    /// of them comes with bytes that fail its hash. They pull honestly.
    pub liars: Option<f64>,
    /// A fraction of nodes (chosen at random, none of them liars) that
    /// withhold: they pull and announce what they hold, as honest nodes do,
    /// and answer no chunk request (each waits out its deadline). A node
    /// with a valid certificate can do this; its announces never lapse.
    pub withholders: Option<f64>,
    /// A fraction of nodes (chosen at random, none of them liars or
    /// withholders) that pull and serve honestly, and report every peer
    /// the tracker names to them silent, and as having sent chunk 0 with
    /// bytes that fail its hash, at each of its answers: the attack on the
    /// tracker's silent-peer and bad-chunk rules (false corruption reports).
    pub accusers: Option<f64>,
    /// A fraction of nodes (chosen at random, none of them another
    /// adversary) that trickle: they pull and announce as honest nodes do,
    /// and answer every chunk request at 1 KiB/s, a byte now and then, so
    /// that no request of theirs is ever silent; each misses its deadline.
    pub tricklers: Option<f64>,
    /// A fraction of nodes (chosen at random, none of them another
    /// adversary) that claim every chunk of every blob, in their announces
    /// and to their askers, from the start, and answer no chunk request;
    /// they pull nothing.
    pub claimers: Option<f64>,
    /// A fraction of nodes (chosen at random, none of them an adversary)
    /// whose disk is full: the agent cannot reserve a blob (ENOSPC), its
    /// mirror answers 502, and containerd pulls from the registry itself.
    pub disk_full: Option<f64>,
    pub freeze: Option<Freeze>,
    /// The registry answers every request sent in `[at_s, at_s + for_s)`
    /// with a server error (a 5xx burst).
    pub registry_errors: Option<Outage>,
    /// The registry cuts every body it sends in `[at_s, at_s + for_s)`
    /// half-way (a proxy dropping connections): the half sent is egress.
    pub registry_cuts: Option<Outage>,
    /// Every registry token expires at this time: each node's next registry
    /// request is refused (401) and sent again with a fresh token.
    pub token_expiry: Option<f64>,
    /// The registry ignores `Range` and answers each request with the whole
    /// blob (200), sent from its first byte.
    pub ranges_ignored: bool,
    /// Concurrent peer chunk downloads per node.
    pub max_downloads: u32,
    /// Concurrent chunk uploads per node.
    pub max_uploads: u32,
    /// Peers a node keeps per blob; the oldest goes when the tracker names another.
    pub max_peers_per_blob: usize,
    /// Watchers a node serves per blob; a node named as a peer past that is refused.
    pub max_watchers_per_blob: usize,
    /// Registry fetches a node in fallback keeps going at once.
    pub registry_parallel: usize,
    /// How often a pulling node announces.
    pub announce_interval_s: f64,
    /// How often an idle node checks its fallback rules (stall, tracker silence).
    pub poll_s: f64,
    /// How long a lane waits after a peer refused its request BUSY (the agent: 200 ms).
    pub busy_backoff_s: f64,
    /// Round trip between two hosts under load (queueing included). A
    /// request's first byte arrives this long after it is sent, whether it
    /// asks a peer for a chunk or the registry for a range; a peer's news (a
    /// chunk it gained) reaches its watchers after half of it; a registry
    /// fetcher's next run starts a round trip after its last chunk (the
    /// agent publishes the chunk's hash and announces at once).
    pub rtt_s: f64,
    /// How unevenly flows crossing one link share it: each flow's weight is
    /// lognormal with mean 1 and this sigma (0: equal shares, a fluid ideal).
    pub flow_weight_sigma: f64,
    /// Nothing arriving and nothing in flight this long: fetch unheld chunks from the registry.
    pub stall_s: f64,
    /// Tracker silent this long: fetch what known peers lack from the registry.
    pub tracker_grace_s: f64,
    /// Neighbours per node in the kraken-like baseline's random graph.
    pub kraken_degree: u32,
}

impl Scenario {
    /// Whether a peer may leave a chunk request unanswered or all but
    /// (frozen peers, withholders, tricklers, claimers): only then do
    /// requests carry the agent's deadlines.
    pub fn peers_may_hang(&self) -> bool {
        self.freeze.is_some()
            || self.withholders.is_some()
            || self.tricklers.is_some()
            || self.claimers.is_some()
    }

    fn base(name: &str, nodes: u32, layers: u32, image_bytes: u64) -> Self {
        Self {
            name: name.to_owned(),
            nodes,
            layers,
            image_bytes,
            sim_chunk_bytes: CHUNK_BYTES,
            node_up_bps: TEN_GBIT,
            node_down_bps: TEN_GBIT,
            registry_bps: TEN_GBIT,
            racks: None,
            churn: None,
            late_joiners: None,
            outage: None,
            hang: None,
            partition: None,
            liars: None,
            withholders: None,
            accusers: None,
            tricklers: None,
            claimers: None,
            disk_full: None,
            freeze: None,
            registry_errors: None,
            registry_cuts: None,
            token_expiry: None,
            ranges_ignored: false,
            max_downloads: DEFAULTS.max_downloads as u32,
            max_uploads: DEFAULTS.max_uploads as u32,
            max_peers_per_blob: DEFAULTS.max_peers_per_blob,
            max_watchers_per_blob: DEFAULTS.max_watchers_per_blob,
            registry_parallel: DEFAULTS.registry_parallel,
            announce_interval_s: secs(DEFAULTS.pull_announce_ms),
            poll_s: 0.5,
            busy_backoff_s: secs(DEFAULTS.busy_backoff_ms),
            // A data-centre fabric under load: a millisecond each way.
            rtt_s: 0.002,
            flow_weight_sigma: 0.0,
            stall_s: secs(DEFAULTS.stall_ms),
            tracker_grace_s: secs(DEFAULTS.tracker_grace_ms),
            kraken_degree: 10,
        }
    }

    /// A chaos case's cluster (`crate::chaos`): 1 Gbit/s links, the
    /// registry as fast as one node, the agent's defaults otherwise.
    pub fn chaos(nodes: u32, layers: u32, image_bytes: u64) -> Self {
        let mut s = Self::base("chaos", nodes, layers, image_bytes);
        s.node_up_bps = 125e6;
        s.node_down_bps = 125e6;
        s.registry_bps = 125e6;
        s
    }

    /// The cluster `dray bench storm` emulates, with the agent's default
    /// limits otherwise (a 30 s stall rule).
    pub fn emulated(c: &Emulated) -> Self {
        let efficiency = wire_efficiency(c.mtu);
        let payload_bps = |mbit: u64| mbit as f64 * 1e6 / 8.0 * efficiency;
        let mut s = Scenario::base("emulated", c.nodes, 1, c.image_bytes);
        s.node_down_bps = payload_bps(c.node_mbit);
        s.node_up_bps = match c.upload_percent {
            0 => s.node_down_bps,
            p => s
                .node_down_bps
                .min(c.node_mbit as f64 * 1e6 / 8.0 * p as f64 / 100.0),
        };
        s.registry_bps = payload_bps(c.registry_mbit);
        s.max_downloads = c.max_downloads;
        s.max_uploads = c.max_uploads;
        s.rtt_s = EMULATED_RTT_S;
        s.flow_weight_sigma = EMULATED_FLOW_WEIGHT_SIGMA;
        s
    }

    /// Refuses scenarios the model cannot run (zero sizes, zero bandwidth, bad fractions).
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |why: &str| Err(SimError::InvalidScenario(format!("{}: {why}", self.name)));
        let positive = [
            self.node_up_bps,
            self.node_down_bps,
            self.registry_bps,
            self.announce_interval_s,
            self.poll_s,
            self.rtt_s,
            self.busy_backoff_s,
            self.stall_s,
            self.tracker_grace_s,
        ];
        if positive.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            return bad("bandwidths and intervals must be finite and positive");
        }
        if !(self.flow_weight_sigma.is_finite() && self.flow_weight_sigma >= 0.0) {
            return bad("flow_weight_sigma must be finite and not negative");
        }
        if self.nodes == 0 || self.layers == 0 || self.image_bytes < u64::from(self.layers) {
            return bad("needs at least one node, one layer and one byte per layer");
        }
        if self.sim_chunk_bytes == 0 {
            return bad("sim_chunk_bytes must be positive");
        }
        let chunks = self.layer_bytes().div_ceil(self.sim_chunk_bytes);
        if chunks > 1 << 20 {
            return bad("more than 2^20 chunks per layer");
        }
        if [self.max_downloads, self.max_uploads].contains(&0)
            || [
                self.max_peers_per_blob,
                self.max_watchers_per_blob,
                self.registry_parallel,
            ]
            .contains(&0)
        {
            return bad("peer and registry limits must be positive");
        }
        if let Some(r) = &self.racks
            && (r.nodes_per_rack == 0
                || !(r.oversubscription.is_finite() && r.oversubscription > 0.0))
        {
            return bad("racks need nodes and a positive oversubscription");
        }
        let fraction_ok = |f: f64, at: f64| (0.0..=1.0).contains(&f) && at.is_finite() && at >= 0.0;
        if self
            .churn
            .as_ref()
            .is_some_and(|c| !fraction_ok(c.fraction, c.at_s))
            || self
                .late_joiners
                .as_ref()
                .is_some_and(|l| !fraction_ok(l.fraction, l.at_s))
            || self
                .freeze
                .as_ref()
                .is_some_and(|f| !fraction_ok(f.fraction, f.at_s))
            || self.liars.is_some_and(|f| !fraction_ok(f, 0.0))
            || self.withholders.is_some_and(|f| !fraction_ok(f, 0.0))
            || self.accusers.is_some_and(|f| !fraction_ok(f, 0.0))
            || self.tricklers.is_some_and(|f| !fraction_ok(f, 0.0))
            || self.claimers.is_some_and(|f| !fraction_ok(f, 0.0))
            || self.disk_full.is_some_and(|f| !fraction_ok(f, 0.0))
        {
            return bad(
                "churn, late-joiner, freeze, liar, withholder, accuser, trickler, claimer and disk-full fractions must be in 0..=1 at a time >= 0",
            );
        }
        let window_ok =
            |at: f64, for_s: f64| at.is_finite() && at >= 0.0 && for_s.is_finite() && for_s >= 0.0;
        if [
            &self.outage,
            &self.hang,
            &self.registry_errors,
            &self.registry_cuts,
        ]
        .into_iter()
        .flatten()
        .any(|o| !window_ok(o.at_s, o.for_s))
            || self.token_expiry.is_some_and(|at| !window_ok(at, 0.0))
            || self
                .partition
                .as_ref()
                .is_some_and(|p| !(window_ok(p.at_s, p.for_s) && (0.0..=1.0).contains(&p.fraction)))
        {
            return bad(
                "an outage, hang, registry error or cut burst, token expiry or partition needs a start and a duration >= 0",
            );
        }
        Ok(())
    }

    pub fn layer_bytes(&self) -> u64 {
        self.image_bytes / u64::from(self.layers.max(1))
    }

    /// T* = max(F/u_s, F/d_min, N*F/(u_s + sum u_i)): no distribution of F bytes
    /// to N nodes can finish sooner.
    pub fn lower_bound_s(&self) -> f64 {
        let f = (self.layer_bytes() * u64::from(self.layers)) as f64;
        let n = f64::from(self.nodes);
        let by_registry = f / self.registry_bps;
        let by_download = f / self.node_down_bps;
        let by_upload = n * f / (self.registry_bps + n * self.node_up_bps);
        by_registry.max(by_download).max(by_upload)
    }
}

/// A `dray bench storm` cluster: one blob of `image_bytes` pulled by `nodes`
/// agents serving `max_uploads` chunks and fetching `max_downloads` at once,
/// links capped at `node_mbit` and `registry_mbit` each way (wire bits:
/// frames of `mtu` bytes with their headers), agent uploads capped at
/// `upload_percent` of the link rate (0: uncapped). The default is the
/// bench's.
#[derive(Clone, Debug)]
pub struct Emulated {
    pub nodes: u32,
    pub image_bytes: u64,
    pub node_mbit: u64,
    pub registry_mbit: u64,
    pub upload_percent: u64,
    pub max_uploads: u32,
    pub max_downloads: u32,
    pub mtu: u16,
}

impl Default for Emulated {
    fn default() -> Self {
        Self {
            nodes: 16,
            image_bytes: 256 * MIB,
            node_mbit: 100,
            registry_mbit: 200,
            upload_percent: 90,
            max_uploads: DEFAULTS.max_uploads as u32,
            max_downloads: DEFAULTS.max_downloads as u32,
            mtu: 1500,
        }
    }
}

/// The scenario called `name`, or an error listing the valid names.
pub fn scenario(name: &str) -> Result<Scenario, SimError> {
    let s = match name {
        "small" => {
            // `dray bench storm` with its defaults.
            let mut s = Scenario::emulated(&Emulated::default());
            s.name = name.to_owned();
            s
        }
        "kraken-2600" => {
            // Kraken's published benchmark: 3 GB in one layer to 2,600 hosts,
            // each capped at 300 MB/s; the registry (origin source) also 300 MB/s.
            let mut s = Scenario::base(name, 2_600, 1, 3_000_000_000);
            s.node_up_bps = 300e6;
            s.node_down_bps = 300e6;
            s.registry_bps = 300e6;
            s
        }
        "storm-10k" => {
            let mut s = Scenario::base(name, 10_000, 4, 10 * GIB);
            s.sim_chunk_bytes = 4 * CHUNK_BYTES;
            s
        }
        "storm-100k" => {
            let mut s = Scenario::base(name, 100_000, 4, 10 * GIB);
            s.sim_chunk_bytes = 16 * CHUNK_BYTES;
            s
        }
        "churn-10k" => {
            let mut s = scenario("storm-10k")?;
            s.name = name.to_owned();
            s.churn = Some(Churn {
                fraction: 0.25,
                at_s: 5.0,
                crash: false,
            });
            s.late_joiners = Some(LateJoiners {
                fraction: 0.05,
                at_s: 6.0,
            });
            s
        }
        "rack-oversub" => {
            let mut s = Scenario::base(name, 4_000, 4, 10 * GIB);
            s.sim_chunk_bytes = 4 * CHUNK_BYTES;
            s.racks = Some(Racks {
                nodes_per_rack: 40,
                oversubscription: 4.0,
            });
            s
        }
        "outage-1k" => {
            let mut s = Scenario::base(name, 1_000, 2, 2 * GIB);
            s.node_up_bps = 125e6;
            s.node_down_bps = 125e6;
            s.registry_bps = 125e6;
            s.outage = Some(Outage {
                at_s: 4.0,
                for_s: 10.0,
            });
            s
        }
        _ => {
            return Err(SimError::UnknownScenario {
                name: name.to_owned(),
                valid: SCENARIOS.join(", "),
            });
        }
    };
    Ok(s)
}
