//! Discrete-event simulations of scale-out storms (thousands to 100,000 nodes
//! pulling one image at once) that drive the tracker's real scheduling core
//! ([`dray_protocol::scheduler::Scheduler`]) and the agent's real chunk picker
//! ([`dray_protocol::picker::ChunkPicker`]), and compare dray with simplified
//! models of the alternatives under the same bandwidth model. The
//! `dray-dht` strategy runs dray without a tracker: the agent's rules for
//! that case ([`dray_protocol::dht`]) over a model of the DHT's lookups
//! (`kademlia`), whose join time and traffic it reports.
//!
//! # What it is
//!
//! A fluid-flow, chunk-granular model: every transfer
//! is a flow over the links it crosses (sender uplink, rack uplinks when it
//! leaves a rack, receiver downlink; the registry's egress is one more link).
//! Each link splits its capacity among its flows in proportion to their
//! weights (equally in the named storms; `Scenario::emulated` draws them, see
//! below); a flow moves at the smallest share on its path. The clock is simulated: the scheduler is handed
//! `Instant`s that are a fixed base plus simulated time, so a seed gives the
//! same numbers on every run.
//!
//! Nodes behave like the agent (see `sim` for the details): announce every
//! 0.5 s (±10%) while pulling and after each registry run, fetch assigned runs from the
//! registry, take everything else from peers (8 chunk downloads and 8
//! uploads at a time per node, the agent's defaults; a request to a peer with
//! no free upload slot is refused and tried again after 200 ms), pick chunks
//! with a `ChunkPicker` per blob fed the bitfields of the 16 most recently
//! named peers (the agent's `peer.max_peers_per_blob`; the oldest is retired
//! when the tracker names another) and kept current as those peers gain
//! chunks (the agent's long-polled bitfields: a watcher hears of a new chunk
//! half a round trip later; a node serves at most 256 watchers per blob, the
//! agent's `peer.max_watchers_per_blob`, and one named past that is dropped), and fall back to the registry as the agent does: after 3 s of tracker
//! silence for the chunks no known peer holds, until the tracker answers;
//! after a stall (`stall_s`) for every unclaimed chunk. Churn (nodes leave,
//! `Scheduler::leave`, their transfers abort), late joiners and a tracker outage (modelled as a restart: the
//! tracker comes back empty and rebuilds from full announces) can be injected.
//!
//! A chunk read from the registry reaches peers only once they can verify it,
//! as in the agent: its fetcher publishes the hash to the tracker, each peer
//! learns it with its next announce's answer (every 0.5 s), and from then on
//! can fetch it from any peer that holds it. A node that completes a blob
//! publishes the whole map.
//!
//! # Findings
//!
//! What the storms found and how the agent and the tracker changed for it
//! (news bounds a storm's first seconds; lockstep announces; late answers;
//! the registry's fetch budget; stampedes on a slow registry; the stall
//! rule's collapse), with the figures, are in `docs/results.md`.
//!
//! # What it is not
//!
//! No packet-level effects (TCP slow start, QUIC, loss), no disk, no hashing
//! cost, no CPU. Latency is one round trip per scenario (`rtt_s`: 2 ms for
//! the named storms, 36 ms measured under load in `dray bench storm`): a
//! request's first byte comes a round trip after it, a peer's news half a
//! round trip after the chunk lands, a registry fetcher's next run a round
//! trip after its last chunk (the agent publishes the hash and announces at
//! once), an announce's answer a round trip after the announce. Congestion control is
//! one number: how unevenly flows share a link (`flow_weight_sigma`: lognormal
//! weights, 0 in the named storms, 0.5 fitted to the spread of chunk
//! transfer times in `dray bench storm`, where equal shares predicted 11-25%
//! too fast: every round's chunks landed together, so no node ever waited on
//! one slow transfer). No max-min fair
//! sharing (equal split per link, then the minimum along the path, which
//! leaves capacity idle where a real network would redistribute it). Big
//! scenarios move chunks in batches (`Scenario::sim_chunk_bytes`: 16 MiB for
//! 10,000 nodes, 64 MiB for 100,000) so they run in budget; a batch crosses
//! a hop in 4 or 16 times a chunk's time, so these storms come out slower
//! than the agent's 4 MiB chunks would make them. The baselines (`direct`, `kraken-like`,
//! `spegel-like`) are simplified models of those systems, not their code.
//!
//! The agent's timings and limits (announce period and its spread, stall and
//! tracker-grace rules, peers and watchers per blob, registry fetches in
//! fallback, BUSY back-off, the tracker's tick) come from
//! `dray_protocol::defaults`, which the agent's configuration reads too; a
//! test in `dray`'s `storm` module fails if the two part. What a pull does
//! with the registry (which runs it starts and stops, when and how it falls
//! back) is the agent's own `dray_protocol::pull::PullMachine`, one per
//! simulated pull, and peer rotation and the watcher cap are
//! `dray_protocol::peers`, which the agent's transfers and swarm engine run
//! too. Still modelled here, not shared: an idle node checks its rules
//! every `poll_s` (0.5 s; the agent every 50 ms) besides on every chunk,
//! a run claims its chunks when it starts (the agent's as it reaches each,
//! waiting at the end on those a peer had in flight), a retired peer leaves
//! at once (the agent's lanes
//! finish the chunk in flight first), and a node with no lanes retries its
//! fills the BUSY back-off after a refusal (the agent's refused lane sleeps
//! it, the peer's other lanes carry on).

pub mod chaos;
mod kademlia;
mod net;
mod queue;
mod report;
mod scenario;
mod sim;
mod tracker;

pub use report::{Adversity, DhtReport, EgressBucket, Fallbacks, SimReport, write_svg};
pub use scenario::{
    CHUNK_BYTES, Churn, Emulated, Freeze, LateJoiners, Outage, Partition, Racks, SCENARIOS,
    Scenario, scenario,
};

use serde::Serialize;

/// How the nodes get the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Strategy {
    /// The real scheduler and picker: registry runs striped once over the swarm.
    Dray,
    /// dray with no tracker: members found through the DHT, registry runs
    /// split by the agent's rendezvous rule (`dray_protocol::dht`).
    DrayDht,
    /// Every node pulls every blob from the registry.
    Direct,
    /// One origin per blob downloads it whole from the registry, then seeds a
    /// random graph of degree ~10 in which nodes pick rarest-first among their
    /// neighbours only.
    KrakenLike,
    /// A node pulls each blob whole from a random peer that has all of it, or
    /// from the registry when nobody does yet.
    SpegelLike,
}

impl Strategy {
    /// Every strategy, dray first, as `--compare` runs them.
    pub const ALL: [Strategy; 5] = [
        Strategy::Dray,
        Strategy::DrayDht,
        Strategy::Direct,
        Strategy::KrakenLike,
        Strategy::SpegelLike,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Dray => "dray",
            Strategy::DrayDht => "dray-dht",
            Strategy::Direct => "direct",
            Strategy::KrakenLike => "kraken-like",
            Strategy::SpegelLike => "spegel-like",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| SimError::UnknownStrategy(s.to_owned()))
    }
}

/// Why a simulation cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimError {
    #[error("unknown scenario {name:?}; valid scenarios: {valid}")]
    UnknownScenario { name: String, valid: String },
    #[error(
        "unknown strategy {0:?}; valid strategies: dray, dray-dht, direct, kraken-like, spegel-like"
    )]
    UnknownStrategy(String),
    #[error("invalid scenario {0}")]
    InvalidScenario(String),
}

/// Runs `strategy` on `scenario`. The same seed gives the same report, except `wall_s`.
pub fn run(scenario: &Scenario, strategy: Strategy, seed: u64) -> Result<SimReport, SimError> {
    scenario.validate()?;
    Ok(sim::simulate(scenario, strategy, seed))
}

#[cfg(test)]
mod tests;
