//! `dray sim --chaos`: seeded fault sweeps over whole storms of simulated
//! nodes that run the agent's pull machine and the tracker's scheduler.
//!
//! Each seed makes one case: a cluster (16-64 nodes, 1-3 layers, 64-320 MiB,
//! a registry of 1-4 Gbit/s) and one or two fault classes with their times,
//! and on half the seeds with one fault an adversary more (liars, frozen
//! peers, registry errors, withholders, accusers, tricklers, claimers),
//! on a third of those left with one class a fault of the registry's
//! answers or the node's disk more (cut bodies, an expired token, `Range`
//! ignored, a full disk), all drawn
//! from the seed. The case runs twice, with its faults and without
//! (the same seed otherwise), and these invariants are checked:
//! - every node that stays completes (the simulated registry never fails
//!   for longer than a request's retries, so a direct pull would have);
//! - registry egress within the bound of its fault classes
//!   ([`Class::egress_bound`], copies of the image);
//! - the last node done within `k` times the fault-free run's last node
//!   plus the time the faults themselves last ([`Class::time_bound`]).
//!
//! - no node that does not lie holds a chunk whose bytes fail its hash;
//!   every liar that sent a chunk was banned, and no other peer was, by a
//!   node or by the tracker;
//! - no pull failed on registry errors (they last less than the retries).
//!
//! The adversaries run the agent's rules through shared code: a chunk's
//! bytes are checked with `dray_protocol::chunkmap::hash_matches` (a
//! simulated chunk's content is its hash) and a peer that fails it is
//! banned from the pull, as the agent's lane does; a request to a frozen
//! peer or a withholder waits out its deadline, or the request timeout
//! without a byte (`dray_protocol::pull::deadline::silent_deadline`), one
//! to a trickler its deadline (`ChunkRates::deadline`, the agent's rule),
//! and the asker reports the peer to the tracker, whose scheduler
//! sends out what only reported peers hold as registry runs; a
//! registry request refused with a server error is sent again after
//! `dray_protocol::defaults::registry_retry_after`, and one whose last
//! attempt fails fails the pull.
//!
//! The same seed gives the same events in the same order on any machine
//! (the simulator's clock is simulated and its randomness seeded), so a
//! failing seed's line `dray sim --chaos --seed-from S --seeds 1` reproduces
//! it exactly. Not modelled here: liars in DHT mode (claims of chunk hashes,
//! the `Arbiter`), forged maps (`tests/hostile_swarm.rs` runs those
//! against real agents), deadlines of honest peers (a
//! simulated flow between them always ends in time), the endgame's second
//! requests (a chunk asked of a frozen peer or a trickler waits its
//! deadline). A full disk is modelled as the agent meets it (the blob's
//! space is reserved before its pull starts): the node pulls alone.

use crate::net::Rng;
use crate::report::SimReport;
use crate::scenario::{Churn, Freeze, LateJoiners, Outage, Partition, Scenario};
use crate::{SimError, Strategy};
use serde::Serialize;

/// A fault class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// The tracker stops answering (its process stopped), then carries on.
    TrackerHang,
    /// The tracker dies and comes back with empty state.
    TrackerCrash,
    /// A share of the nodes cannot reach the tracker for a while.
    TrackerPartition,
    /// The registry sends at a tenth of its rate.
    RegistrySlow,
    /// A share of the nodes crash mid-pull (no `Leave`).
    PeerCrash,
    /// A share of the nodes start late, into a swarm under way.
    LateJoin,
    /// A share of the nodes (at most a quarter) lie: every chunk asked of
    /// them comes with bytes that fail its hash.
    Liars,
    /// A share of the nodes freeze mid-pull (SIGSTOP: connections open, no
    /// answers), for good.
    PeerFreeze,
    /// The registry answers every request with a server error for up to
    /// 2.5 s (shorter than the agent's retries: a direct pull rides it out).
    RegistryErrors,
    /// A share of the nodes (at most a quarter) withhold: they pull and
    /// announce as honest nodes do, and answer no chunk request; they also
    /// say in every announce that the registry ignores `Range` (which would
    /// hand them runs to the blob's end if the tracker took their word).
    Withholders,
    /// A share of the nodes (at most a quarter) pull and serve honestly and
    /// report every peer named to them silent, and as having sent a chunk
    /// whose bytes fail its hash.
    Accusers,
    /// A share of the nodes (at most a quarter) pull and announce as honest
    /// nodes do, and answer every chunk request at 1 KiB/s: never silent,
    /// always past the deadline.
    Tricklers,
    /// A share of the nodes (at most a quarter) announce every chunk from
    /// their start, and answer no chunk request.
    Claimers,
    /// The registry cuts every body it sends half-way for up to 2.5 s (a
    /// proxy dropping connections; shorter than the agent's retries).
    RegistryCuts,
    /// Every registry token expires at once: each node's next request is
    /// refused and sent again with a fresh token.
    TokenExpiry,
    /// The registry ignores `Range`: every request is answered with the
    /// whole blob, from its first byte.
    RangesIgnored,
    /// A share of the nodes have a full disk: each pulls alone from the
    /// registry, as containerd does past the agent's refusal.
    DiskFull,
}

impl Class {
    /// Where the adversaries start in [`Class::ALL`].
    pub const ADVERSARIES: usize = 6;
    /// Where the faults of the registry's answers (and of a node's disk)
    /// start in [`Class::ALL`].
    pub const ANSWERS: usize = 13;

    pub const ALL: [Class; 17] = [
        Class::TrackerHang,
        Class::TrackerCrash,
        Class::TrackerPartition,
        Class::RegistrySlow,
        Class::PeerCrash,
        Class::LateJoin,
        Class::Liars,
        Class::PeerFreeze,
        Class::RegistryErrors,
        Class::Withholders,
        Class::Accusers,
        Class::Tricklers,
        Class::Claimers,
        Class::RegistryCuts,
        Class::TokenExpiry,
        Class::RangesIgnored,
        Class::DiskFull,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::TrackerHang => "tracker-hang",
            Class::TrackerCrash => "tracker-crash",
            Class::TrackerPartition => "tracker-partition",
            Class::RegistrySlow => "registry-slow",
            Class::PeerCrash => "peer-crash",
            Class::LateJoin => "late-join",
            Class::Liars => "liars",
            Class::PeerFreeze => "peer-freeze",
            Class::RegistryErrors => "registry-errors",
            Class::Withholders => "withholders",
            Class::Accusers => "accusers",
            Class::Tricklers => "tricklers",
            Class::Claimers => "claimers",
            Class::RegistryCuts => "registry-cuts",
            Class::TokenExpiry => "token-expiry",
            Class::RangesIgnored => "ranges-ignored",
            Class::DiskFull => "disk-full",
        }
    }

    /// Registry egress allowed with this fault, in copies of the image, for
    /// `hit` nodes hit by it: a base, plus [`Class::per_node_hit`] for each.
    pub fn egress_bound(self, hit: u32) -> f64 {
        self.egress_base() + self.per_node_hit() * f64::from(hit)
    }

    /// Whether the registry's time to send what this fault makes it send
    /// past one copy is part of its time bound (see `check`).
    fn sends_more(self) -> bool {
        matches!(self, Class::RangesIgnored | Class::DiskFull)
    }

    /// Copies of the image a fault of this class may cost for each node it
    /// hits: one where the hit nodes pull alone, never worse than a direct
    /// pull (a node that cannot hear the tracker fetches what no peer it
    /// knows holds; a crashed or frozen node's askers report it silent, and
    /// a pull that starved for what only it held before the tracker heard
    /// fetches that alone), none for the rest. Loose for crashes and
    /// freezes since the reports (figures: `docs/results.md`).
    pub fn per_node_hit(self) -> f64 {
        match self {
            Class::TrackerHang
            | Class::TrackerCrash
            | Class::TrackerPartition
            | Class::PeerCrash
            | Class::PeerFreeze
            | Class::RangesIgnored
            | Class::DiskFull => 1.0,
            _ => 0.0,
        }
    }

    /// Seconds the last node may take longer for each node a fault of this
    /// class hits, in each layer of the image. A claimer offers every chunk
    /// from its start, and the tracker names it first (it holds the most):
    /// each pull asks every claimer it is named, each for a request
    /// timeout, and a node's pulls ask two at once between them
    /// (`max_downloads` over `depth_per_peer`). A pull drops a silent peer
    /// for good, but the node's other pulls find it silent on their own
    /// (dropping it from all of them at once was tried: `docs/results.md`,
    /// "Lanes per peer, silence reports per blob and repeated").
    pub fn time_per_node_hit_and_layer(self) -> f64 {
        match self {
            Class::Claimers => {
                let d = dray_protocol::defaults::DEFAULTS;
                let at_once = d.max_downloads / d.depth_per_peer;
                request_timeout_s() / at_once as f64
            }
            _ => 0.0,
        }
    }

    /// The bound with no node hit: the swarm's one copy with a margin for
    /// the chunks in flight when a fetcher went; for liars, issue 36's 1.5
    /// copies with at most a quarter of the nodes hostile and the tracker
    /// up (a liar is banned by the first node it lies to and reported to
    /// the tracker at once, so what it held is fetched again once); for
    /// withholders and accusers a quarter of a copy more.
    fn egress_base(self) -> f64 {
        match self {
            Class::RegistrySlow | Class::LateJoin | Class::RegistryErrors | Class::TokenExpiry => {
                1.1
            }
            // Each registry request of the window sends half a chunk for
            // nothing, up to five times.
            Class::RegistryCuts => 1.5,
            // What the swarm needs, with its nodes alone beside it.
            Class::DiskFull => 1.1,
            // Never worse than direct pulls: one copy per node hit, all of
            // them (each run reads the blob from its first byte).
            Class::RangesIgnored => 0.0,
            // The chunks only members reported silent hold go out again as
            // runs, and up to a quarter of a swarm's members may be so
            // reported at once (withholders and claimers rightly, or honest
            // nodes by accusers): a quarter of a copy more.
            Class::Withholders | Class::Accusers | Class::Claimers => 1.75,
            _ => 1.5,
        }
    }

    /// `(k, c, r)`: the last node is done within `k` times the fault-free
    /// run's last node, plus `c` times the time the fault lasts, plus `r`
    /// seconds to recover: the tracker's grace and an announce for the
    /// tracker's faults; the grace for late joiners (one that starts while
    /// the tracker is silent knows no peer and waits it out); for crashes, the tracker's expiry of a silent peer
    /// (three announce intervals, 30 s), until which a crashed node's
    /// unpublished chunks count as held and nobody is sent for them.
    pub fn time_bound(self) -> (f64, f64, f64) {
        match self {
            // A slow registry stretches what it sends by up to 10x.
            Class::RegistrySlow => (10.0, 0.0, 0.0),
            // Not the fault's duration: the fallback keeps pulls moving.
            Class::TrackerHang | Class::TrackerCrash | Class::TrackerPartition => (2.0, 0.0, 5.0),
            Class::PeerCrash => (2.0, 0.0, expiry_s()),
            // A node that starts while the tracker cannot be heard knows no
            // peer until it can (no DHT in this mode): such a fault may
            // delay it by its whole length.
            Class::LateJoin => (2.0, 1.0, grace_s()),
            // The chunks only banned liars hold are starved for, and
            // fetched from the registry a tracker grace later.
            Class::Liars => (2.0, 0.0, grace_s()),
            // A request to a frozen peer waits out its deadline (the first
            // chunk's, at most) before the peer is dropped; its runs and
            // unpublished chunks are the tracker's until it expires.
            Class::PeerFreeze => (2.0, 0.0, expiry_s() + first_deadline_s()),
            // Each request is sent again until the burst ends, plus the
            // last backoff.
            Class::RegistryErrors | Class::RegistryCuts => (2.0, 1.0, retries_s()),
            // Two round trips for each node's next request: within k.
            Class::TokenExpiry => (2.0, 0.0, 0.0),
            // Plus the time the registry takes to send what it sent past
            // one copy (see `check`).
            Class::RangesIgnored => (2.0, 0.0, 0.0),
            // The nodes pulling alone share the registry with the swarm.
            Class::DiskFull => (2.0, 0.0, 0.0),
            // A request to a withholder is given up after the request
            // timeout at most, and the asker reports it: the tracker then
            // sends others for what only withholders hold. A withholder
            // stays named and takes runs (the tracker cannot tell it from
            // an honest node a liar accuses), so a chunk may be asked of
            // two withholders in turn, and a run one took is sent out again
            // only once a request to it timed out (the sweep found seeds
            // past one and two timeouts with a slow registry).
            Class::Withholders => (2.0, 0.0, 3.0 * request_timeout_s() + grace_s()),
            // A claimer costs each node that asks it a request timeout (see
            // `time_per_node_hit_and_layer`); the last round, and a grace
            // for what only claimers were reported holding.
            Class::Claimers => (2.0, 0.0, request_timeout_s() + grace_s()),
            // Accused peers stay named and keep their holdings; what only
            // accused peers hold goes out as runs, at most a quarter of a
            // swarm's members accused at once.
            Class::Accusers => (2.0, 0.0, grace_s()),
            // A request to a trickler is given up at its deadline and the
            // asker reports it, as it does a silent peer. The simulator
            // sends no endgame second request, so a chunk asked of a
            // trickler waits out the deadline, and a node with no chunk
            // rate yet (its first deadline) may ask up to three tricklers
            // in turn (the sweep found seeds past one and two).
            Class::Tricklers => (2.0, 0.0, 3.0 * first_deadline_s() + grace_s()),
        }
    }
}

/// The longest a chunk request waits before the pull has seen a rate.
fn first_deadline_s() -> f64 {
    use dray_protocol::pull::deadline::{MIN_CHUNK_BYTES_PER_S, REQUEST_TIMEOUT, first_deadline};
    first_deadline(
        crate::scenario::CHUNK_BYTES as usize,
        MIN_CHUNK_BYTES_PER_S,
        REQUEST_TIMEOUT,
    )
    .as_secs_f64()
}

/// How long a peer may answer nothing before its request is given up.
fn request_timeout_s() -> f64 {
    dray_protocol::pull::deadline::REQUEST_TIMEOUT.as_secs_f64()
}

/// How long a registry request is retried on server errors, in all.
fn retries_s() -> f64 {
    (1..)
        .map_while(dray_protocol::defaults::registry_retry_after)
        .map(|d| d.as_secs_f64())
        .sum()
}

/// How much slower than every node pulling directly from the registry a
/// faulted storm may finish (beyond its recovery time).
const DIRECT_FACTOR: f64 = 1.25;

/// The tracker silence after which a pull fetches what no peer gives.
fn grace_s() -> f64 {
    dray_protocol::defaults::secs(dray_protocol::defaults::DEFAULTS.tracker_grace_ms)
}

/// How long the tracker takes to forget a peer whose announces stopped.
fn expiry_s() -> f64 {
    let c = dray_protocol::scheduler::SchedulerConfig::default();
    c.announce_interval.as_secs_f64() * f64::from(c.expiry_intervals)
}

/// One fault of a case, with how long it lasts (0 for a crash).
#[derive(Clone, Debug, Serialize)]
pub struct Fault {
    pub class: &'static str,
    pub at_s: f64,
    pub for_s: f64,
    /// The share of nodes it hits, where it hits some.
    pub fraction: f64,
}

/// One seed's case: its cluster and faults.
#[derive(Clone, Debug)]
pub struct Case {
    pub seed: u64,
    pub scenario: Scenario,
    /// The same cluster without the faults.
    pub calm: Scenario,
    pub classes: Vec<Class>,
    pub faults: Vec<Fault>,
}

/// Draws seed `seed`'s case.
pub fn case(seed: u64) -> Case {
    // Mixed so that neighbouring seeds draw unrelated cases.
    let mut rng = Rng::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xc4a0_5eed);
    let nodes = 16 + rng.below(49) as u32;
    let layers = 1 + rng.below(3) as u32;
    let mib = 64 + 32 * rng.below(9) as u64;
    let mut sc = Scenario::chaos(nodes, layers, mib << 20);
    sc.registry_bps *= (1 + rng.below(4)) as f64;
    let bound = sc.lower_bound_s();
    let calm = sc.clone();
    let mut classes: Vec<Class> = Vec::new();
    let count = 1 + rng.below(2);
    let (faults, rest) = Class::ALL.split_at(Class::ADVERSARIES);
    let (adversaries, answers) = rest.split_at(Class::ANSWERS - Class::ADVERSARIES);
    while classes.len() < count {
        let c = faults[rng.below(faults.len())];
        // Two tracker faults at once are one longer fault.
        let tracker = |c: Class| c <= Class::TrackerPartition;
        if !classes
            .iter()
            .any(|&k| k == c || (tracker(k) && tracker(c)))
        {
            classes.push(c);
        }
    }
    // The adversaries come from a stream of their own, so that every seed
    // keeps the faults, with their times, it drew before they came (and a
    // planted bug stays caught on the seeds that caught it); half the seeds
    // with one fault add one (a third class widens the bounds enough to
    // hide the planted `late-runs-kept`).
    let mut adversary = Rng::new(seed.wrapping_mul(0xd1b5_4a32_d192_ed03) ^ 0xad5e_5a21);
    if count == 1 && adversary.below(2) == 1 {
        classes.push(adversaries[adversary.below(adversaries.len())]);
    }
    // The registry's answer faults and full disks too, on a third of the seeds left with
    // one class (they sort last: the other classes keep their draws).
    let mut answer = Rng::new(seed.wrapping_mul(0xa076_1d64_78bd_642f) ^ 0x00b0_d1e5);
    if classes.len() == 1 && answer.below(3) == 0 {
        classes.push(answers[answer.below(answers.len())]);
    }
    classes.sort();
    let mut faults = Vec::new();
    for &class in &classes {
        let at_s = bound * (0.1 + 0.6 * rng.unit());
        let for_s = 2.0 + 13.0 * rng.unit();
        let fraction = 0.05 + 0.2 * rng.unit();
        let window = Outage { at_s, for_s };
        // A registry burst lasts 0.5-2.5 s (shorter than the retries), from
        // the same draw.
        let burst = Outage {
            at_s,
            for_s: 0.5 + 2.0 * (for_s - 2.0) / 13.0,
        };
        let (for_s, fraction) = match class {
            Class::TrackerHang => {
                sc.hang = Some(window);
                (for_s, 1.0)
            }
            Class::TrackerCrash => {
                sc.outage = Some(window);
                (for_s, 1.0)
            }
            Class::TrackerPartition => {
                sc.partition = Some(Partition {
                    fraction,
                    at_s,
                    for_s,
                });
                (for_s, fraction)
            }
            Class::RegistrySlow => {
                sc.registry_bps /= 10.0;
                (0.0, 1.0)
            }
            Class::PeerCrash => {
                sc.churn = Some(Churn {
                    fraction,
                    at_s,
                    crash: true,
                });
                (0.0, fraction)
            }
            Class::LateJoin => {
                sc.late_joiners = Some(LateJoiners { fraction, at_s });
                (0.0, fraction)
            }
            Class::Liars => {
                sc.liars = Some(fraction);
                (0.0, fraction)
            }
            Class::PeerFreeze => {
                sc.freeze = Some(Freeze { fraction, at_s });
                (0.0, fraction)
            }
            Class::RegistryErrors => {
                let lasting = burst.for_s;
                sc.registry_errors = Some(burst);
                (lasting, 1.0)
            }
            Class::Withholders => {
                sc.withholders = Some(fraction);
                (0.0, fraction)
            }
            Class::Accusers => {
                sc.accusers = Some(fraction);
                (0.0, fraction)
            }
            Class::Tricklers => {
                sc.tricklers = Some(fraction);
                (0.0, fraction)
            }
            Class::Claimers => {
                sc.claimers = Some(fraction);
                (0.0, fraction)
            }
            Class::RegistryCuts => {
                let lasting = burst.for_s;
                sc.registry_cuts = Some(burst);
                (lasting, 1.0)
            }
            Class::TokenExpiry => {
                sc.token_expiry = Some(at_s);
                (0.0, 1.0)
            }
            Class::RangesIgnored => {
                sc.ranges_ignored = true;
                (0.0, 1.0)
            }
            Class::DiskFull => {
                sc.disk_full = Some(fraction);
                (0.0, fraction)
            }
        };
        faults.push(Fault {
            class: class.name(),
            at_s,
            for_s,
            fraction,
        });
    }
    Case {
        seed,
        scenario: sc,
        calm,
        classes,
        faults,
    }
}

/// What one seed gave.
#[derive(Clone, Debug, Serialize)]
pub struct SeedOutcome {
    pub seed: u64,
    pub nodes: u32,
    pub layers: u32,
    pub image_bytes: u64,
    pub faults: Vec<Fault>,
    pub egress_copies: f64,
    /// The egress bound the seed was checked against.
    pub egress_bound: f64,
    /// The last node's time over the fault-free run's.
    pub time_ratio: f64,
    pub max_s: f64,
    pub fault_free_max_s: f64,
    pub fallbacks: u64,
    /// The rule behind each fallback.
    pub fallback_rules: crate::report::Fallbacks,
    pub events: u64,
    /// What liars, frozen peers and registry errors did.
    pub adversity: crate::Adversity,
    /// Broken invariants, each in a sentence; empty if the seed passed.
    pub violations: Vec<String>,
}

/// Runs seed `seed`'s case with and without its faults and checks it.
pub fn check(seed: u64) -> Result<SeedOutcome, SimError> {
    let case = case(seed);
    let sc = &case.scenario;
    let faulted = crate::run(sc, Strategy::Dray, seed)?;
    let calm = crate::run(&case.calm, Strategy::Dray, seed)?;
    let mut violations = Vec::new();
    // Claimers pull nothing: not a completion the invariant waits for.
    let staying = sc.nodes - faulted.left - faulted.adversity.claimers;
    if faulted.completed != staying {
        violations.push(format!(
            "{} of {staying} staying nodes completed (the registry never failed for longer than its retries: a direct pull would have)",
            faulted.completed
        ));
    }
    violations.extend(adversity_violations(&faulted.adversity));
    let hit = |f: &Fault| (f.fraction * f64::from(sc.nodes)).round() as u32;
    // The largest base, and each class's nodes hit (they pull alone: their
    // copies add up, where one class's hit nodes may be another's).
    let egress_bound = case
        .classes
        .iter()
        .map(|c| c.egress_bound(0))
        .fold(0.0, f64::max)
        + case
            .classes
            .iter()
            .zip(&case.faults)
            .map(|(c, f)| c.per_node_hit() * f64::from(hit(f)))
            .sum::<f64>();
    if faulted.registry_egress_ratio > egress_bound {
        violations.push(format!(
            "registry egress {:.3} copies, over the bound of {egress_bound:.2} for {}",
            faulted.registry_egress_ratio,
            names(&case.classes)
        ));
    }
    let lasting: f64 = case.faults.iter().map(|f| f.for_s).sum();
    let (k, c, r) = case
        .classes
        .iter()
        .zip(&case.faults)
        .map(|(c, f)| {
            let (k, c2, r) = c.time_bound();
            let per_hit = c.time_per_node_hit_and_layer() * f64::from(sc.layers);
            (k, c2, r + per_hit * f64::from(hit(f)))
        })
        .fold((0.0, 0.0, 0.0), |(k, c, r), (k2, c2, r2)| {
            (f64::max(k, k2), f64::max(c, c2), r + r2)
        });
    // Never worse than a direct pull: whatever the swarm's bound, every
    // node pulling straight from the same registry (sharing it) is allowed.
    let direct = crate::run(&case.calm, Strategy::Direct, seed)?;
    // Where a fault makes the registry send more than a copy (each run of
    // the first wave, before the tracker hears, reading the blob from its
    // first byte where `Range` is ignored; nodes with a full disk pulling
    // alone): the time the registry takes to send the excess.
    let r = r + match case.classes.iter().any(|c| c.sends_more()) {
        true => {
            (faulted.registry_egress_ratio - 1.0).max(0.0) * sc.image_bytes as f64 / sc.registry_bps
        }
        false => 0.0,
    };
    let allowed = (k * calm.max_s + c * lasting + r).max(DIRECT_FACTOR * direct.max_s + r);
    if faulted.max_s > allowed {
        violations.push(format!(
            "last node done at {:.1} s, past the larger of {k} x {:.1} s (fault-free) + {c} x {lasting:.1} s (the faults) + {r} s and {DIRECT_FACTOR} x {:.1} s (direct pulls) + {r} s = {allowed:.1} s",
            faulted.max_s, calm.max_s, direct.max_s
        ));
    }
    Ok(outcome(&case, &faulted, &calm, egress_bound, violations))
}

/// The invariants against liars, frozen peers and registry errors.
fn adversity_violations(a: &crate::Adversity) -> Vec<String> {
    let mut v = Vec::new();
    if a.bad_chunks > 0 {
        v.push(format!(
            "{} chunks that fail their hash held by nodes that do not lie",
            a.bad_chunks
        ));
    }
    if a.liars_banned != a.liars_served {
        v.push(format!(
            "{} of the {} liars that sent a chunk banned",
            a.liars_banned, a.liars_served
        ));
    }
    if a.honest_dropped > 0 {
        v.push(format!(
            "{} bans of peers that neither lie nor froze",
            a.honest_dropped
        ));
    }
    if a.honest_banned > 0 {
        v.push(format!(
            "{} nodes that do not lie banned by the tracker on bad-chunk reports",
            a.honest_banned
        ));
    }
    if a.failed_pulls > 0 {
        v.push(format!(
            "{} pulls failed on registry errors shorter than the retries",
            a.failed_pulls
        ));
    }
    v
}

fn outcome(
    case: &Case,
    faulted: &SimReport,
    calm: &SimReport,
    egress_bound: f64,
    violations: Vec<String>,
) -> SeedOutcome {
    SeedOutcome {
        seed: case.seed,
        nodes: case.scenario.nodes,
        layers: case.scenario.layers,
        image_bytes: faulted.image_bytes,
        faults: case.faults.clone(),
        egress_copies: faulted.registry_egress_ratio,
        egress_bound,
        time_ratio: faulted.max_s / calm.max_s.max(f64::MIN_POSITIVE),
        max_s: faulted.max_s,
        fault_free_max_s: calm.max_s,
        fallbacks: faulted.fallbacks,
        fallback_rules: faulted.fallback_rules.clone(),
        events: faulted.events + calm.events,
        adversity: faulted.adversity.clone(),
        violations,
    }
}

fn names(classes: &[Class]) -> String {
    classes
        .iter()
        .map(|c| c.name())
        .collect::<Vec<_>>()
        .join(" + ")
}

/// The worst a class saw over a sweep, against its bounds.
#[derive(Clone, Debug, Serialize)]
pub struct ClassSummary {
    pub class: &'static str,
    pub seeds: u32,
    /// The most over the seeds with this class, whatever else they had.
    pub max_egress_copies: f64,
    /// The most over the seeds whose only fault was this class (0 if none).
    pub max_egress_copies_alone: f64,
    /// The bound with no node hit, and what each node hit adds to it (the
    /// bound a seed is checked against is the largest of its classes').
    pub egress_bound: f64,
    pub egress_bound_per_node_hit: f64,
    /// The worst egress over the bound it was checked against: at most 1 on
    /// a sweep that passed.
    pub max_egress_of_bound: f64,
    pub max_time_ratio: f64,
    /// `(k, c, r)`: within k x fault-free + c x the fault's duration + r s,
    /// plus `time_bound_per_node_hit_and_layer` s for each node the fault
    /// hit in each layer.
    pub time_bound: (f64, f64, f64),
    pub time_bound_per_node_hit_and_layer: f64,
}

/// A sweep's report: `dray sim --chaos --json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct ChaosReport {
    pub first_seed: u64,
    pub seeds: u64,
    pub failed: u64,
    pub fault_classes: Vec<&'static str>,
    pub classes: Vec<ClassSummary>,
    /// Failing seeds, each with the command that reproduces it.
    pub failures: Vec<Failure>,
    pub planted: Option<&'static str>,
    pub events: u64,
    pub wall_s: f64,
    pub seeds_per_minute: f64,
    pub events_per_s: f64,
}

/// A failing seed: what it gave, and the command that reproduces it.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    #[serde(flatten)]
    pub outcome: SeedOutcome,
    pub reproduce: String,
}

/// Sweeps seeds `first..first + seeds`; `planted` names the planted bug
/// turned on (for the reproduce line). `each` sees every seed's outcome as
/// it comes.
pub fn sweep(
    first: u64,
    seeds: u64,
    planted: Option<&'static str>,
    mut each: impl FnMut(&SeedOutcome),
) -> Result<ChaosReport, SimError> {
    let wall = std::time::Instant::now();
    let mut classes: Vec<ClassSummary> = Class::ALL
        .iter()
        .map(|&c| ClassSummary {
            class: c.name(),
            seeds: 0,
            max_egress_copies: 0.0,
            max_egress_copies_alone: 0.0,
            egress_bound: c.egress_bound(0),
            egress_bound_per_node_hit: c.per_node_hit(),
            max_egress_of_bound: 0.0,
            max_time_ratio: 0.0,
            time_bound: c.time_bound(),
            time_bound_per_node_hit_and_layer: c.time_per_node_hit_and_layer(),
        })
        .collect();
    let mut failures = Vec::new();
    let mut events = 0;
    for seed in first..first.saturating_add(seeds) {
        let o = check(seed)?;
        events += o.events;
        for f in &o.faults {
            let s = classes
                .iter_mut()
                .find(|s| s.class == f.class)
                .expect("every fault is of a class");
            s.seeds += 1;
            s.max_egress_copies = s.max_egress_copies.max(o.egress_copies);
            if o.faults.len() == 1 {
                s.max_egress_copies_alone = s.max_egress_copies_alone.max(o.egress_copies);
            }
            s.max_egress_of_bound = s.max_egress_of_bound.max(o.egress_copies / o.egress_bound);
            s.max_time_ratio = s.max_time_ratio.max(o.time_ratio);
        }
        if !o.violations.is_empty() {
            let plant = planted.map(|p| format!(" --plant {p}")).unwrap_or_default();
            failures.push(Failure {
                outcome: o.clone(),
                reproduce: format!("dray sim --chaos --seed-from {seed} --seeds 1{plant}"),
            });
        }
        each(&o);
    }
    let wall_s = wall.elapsed().as_secs_f64();
    Ok(ChaosReport {
        first_seed: first,
        seeds,
        failed: failures.len() as u64,
        fault_classes: Class::ALL.iter().map(|c| c.name()).collect(),
        classes,
        failures,
        planted,
        events,
        wall_s,
        seeds_per_minute: seeds as f64 * 60.0 / wall_s.max(1e-9),
        events_per_s: events as f64 / wall_s.max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_draws_the_same_case_and_the_same_outcome_every_time() {
        for seed in [1, 2, 3] {
            let (a, b) = (check(seed).unwrap(), check(seed).unwrap());
            assert_eq!(
                serde_json::to_string(&a).unwrap(),
                serde_json::to_string(&b).unwrap()
            );
        }
    }

    #[test]
    fn seeds_draw_every_class_and_at_most_one_tracker_fault() {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let c = case(seed);
            assert!(c.scenario.validate().is_ok(), "seed {seed}");
            let tracker = c
                .classes
                .iter()
                .filter(|&&k| k <= Class::TrackerPartition)
                .count();
            assert!(tracker <= 1, "seed {seed}: {:?}", c.classes);
            seen.extend(c.classes);
        }
        assert_eq!(seen.len(), Class::ALL.len());
    }
}
