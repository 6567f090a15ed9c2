//! Discrete-event simulations of scale-out storms (thousands to 100,000 nodes
//! pulling one image at once) that drive the tracker's real scheduling core
//! ([`dray_protocol::scheduler::Scheduler`]) and the agent's real chunk picker
//! ([`dray_protocol::picker::ChunkPicker`]), and compare dray with simplified
//! models of the alternatives under the same bandwidth model.
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
//! # A finding: news, not bandwidth, bounds a storm's first seconds
//!
//! When the registry and every node move data at the same rate (as in
//! `kraken-2600`), each second a node waits at the start is a second added at
//! the end. Tracing the first chunk's spread showed it reaching all 2,600
//! nodes only after 2.6 s, while a transfer hop takes 30 ms: nodes learned of
//! new holders at announces (0.5 s) and of their peers' new chunks at 100 ms
//! bitfield polls. Three changes, made in the agent and the tracker and
//! modelled here, took `kraken-2600` from 1.38x (the agent's 8/8 slots, 4 MiB
//! chunks) to 1.25-1.26x the bound (1.20x with the jitter below): the tracker also names members that hold
//! nothing yet (they are the mesh the first chunks travel along), peers
//! answer a long-polled bitfield request as soon as they gain a chunk, and
//! each transfer keeps its 16 newest peers. With 4 downloads and 4 uploads
//! per node the simulator gets 1.21x (1.33x before; a chunk crosses a hop at
//! a quarter of a link instead of an eighth), but the emulated cluster was
//! slower with 4/4 (1.53-1.62x against 1.46-1.49x at 4 nodes), so the agent
//! keeps 8/8.
//!
//! # A finding: nodes started together announce in lockstep
//!
//! Every node starts at 0 and announced every 0.5 s, so all 2,600 learned
//! the tracker's news (a new chunk's hash, its holders) at the same few
//! instants: tracing one chunk showed its fetcher holding it alone for over
//! a second while 105 nodes watching it waited for their next announce or a
//! free upload slot. The agent now spreads each announce period by ±10%
//! (as BitTorrent clients do, which also smooths the tracker's load), and so
//! does the simulator: `kraken-2600` went from 1.25x to 1.20x the bound (the
//! same for seeds 1-4), `storm-10k` from 1.30x to 1.25x, `churn-10k` from
//! 1.33x to 1.28x, `rack-oversub` from 4.07x to 3.86x.
//!
//! # A finding: an announce's answer is news a round trip late
//!
//! The simulator answered announces at once. It now hands each call to the
//! real scheduler running on a thread of its own (`tracker`) and applies the
//! answer a round trip (`rtt_s`) after the announce, as the agent receives
//! it; that lets the scheduler's work overlap the rest of the simulation on
//! the second core (`storm-10k` 78-93 s -> 62-65 s of wall time, `storm-100k`
//! 599 -> 509 s, each run alone; with mimalloc as `dray`'s allocator since,
//! 52-57 s and 362 s; with the run budget and watcher cap below, 46-47 s and
//! 277 s). The late news costs what news
//! costs at a storm's start: `kraken-2600` p99 went from 1.20x to 1.22x the
//! bound, `small` from 1.26x to 1.29x; `storm-10k` stays at 1.25x, and the
//! emulated 4-node cluster's prediction moved from 7.25 s p50 / 7.55 s last
//! to 7.31 s / 7.57 s (the emulation measured 7.18-7.85 s). The old numbers
//! came from a model kinder than the agent's network.
//!
//! # A finding: the registry's fetch budget is the registry's, not a blob's
//!
//! The tracker let 16 registry runs live per blob. In `kraken-2600` (one
//! blob, the registry as fast as a node) the registry then sent at 96-100%
//! of its rate and finished the image's first copy at 10.25 s, and every
//! node finished between 12.0 and 12.25 s, waiting on the last chunks; 24
//! runs kept it busier (1.22x -> 1.18x) while 32 did not (1.21x). In
//! `storm-10k` (four blobs, so 64 runs) fewer were better: 6 per blob (24 in
//! all) or 10 gave 1.23x, 16 gave 1.25x, 24 gave 1.29x. What fits both is a
//! budget of about 24 runs for the registry, whatever the number of blobs,
//! and a real image has many layers pulled at once. Agents now name each
//! wanted blob's origin (its registry's base URL) and the tracker budgets
//! runs per origin (`max_runs_per_origin`, 24): `kraken-2600` p99 1.18x
//! (seeds 2-4: 1.19x, 1.18x, 1.17x; at `flow_weight_sigma` 0.5 1.25x, was
//! 1.28x), `storm-10k` 1.24x, `churn-10k` 1.26x (1.27x), `rack-oversub`
//! 3.80x (3.87x), `outage-1k` 1.76x (1.77x), `small` unchanged at 1.29x.
//!
//! # A finding: taking back late runs stampedes a slow registry
//!
//! The tracker took a registry run back once past its deadline (the chunk's
//! size at 1 MiB/s, at least 5 s) and handed the chunk to another node; the
//! first kept fetching. With 16 runs sharing a 50 Mbit/s registry every run
//! took 11 s, all were taken back, twice as many fetches shared the
//! registry, and so on: 16 nodes pulling 256 MiB took 808 s and 17.7x the
//! image from the registry (64 nodes: 3,026 s, 66.6x, worse than direct
//! pulls); at 100 Mbit/s 64 nodes took 4.9x. Found once links shared
//! unevenly (`flow_weight_sigma`), which made the default 16-node cluster
//! fetch 1.08x. A late run is now taken back only once it is also 3x slower
//! than the blob's finished runs (before any finishes, 3x its deadline per
//! live run): the same storms take 52 s, 56 s and 40 s at 1.00x. The
//! emulation agreed (16 nodes, 64 MiB, 50 Mbit/s registry: 2.22 copies of the
//! blob, 25.4 s; now 0.99, 20.0 s). At 10 Mbit/s and 64 nodes a first chunk
//! took 54 s, past the agents' 30 s stall rule, and the stalled nodes' own
//! registry fetches sent 25x the image (5,708 s for 256 MiB). The tracker now
//! tells pullers when registry runs of their blob are live, and the agent
//! does not count that wait as a stall: 231 s, 1.03x the bound, 1.00x.
//!
//! # A finding: a 5 s stall rule collapses registry-bound storms
//!
//! In a storm the registry needs F/u_s (10 s for `kraken-2600`) to emit the
//! image once, and the first chunks take seconds to appear anywhere. With a
//! 5 s stall rule (the agent's default before this finding; it is now 30 s),
//! about 10% of the nodes in `kraken-2600` have
//! received nothing after 5 s and start registry fallbacks; their fetches
//! share the registry with the assigned runs, slow them, make more nodes
//! stall, and the storm degrades towards every node pulling from the
//! registry (measured: nobody done after 1,600 simulated s, registry egress
//! 159x the image). The named storms therefore use `stall_s` = 30 s (with it
//! egress is 1.0x), as does the agent now. The tracker-silence
//! fallback (3 s) is modelled as the agent has it.
//!
//! The same collapse followed a tracker outage in a storm (`outage-1k`:
//! 1,000 nodes, tracker down from 4 s to 14 s): 3 s into the silence every
//! node fell back, 1,000 registry fetches shared the registry (a 4 MiB chunk
//! then took 34 s), and the restarted tracker learned holders from the full
//! announces but hashes only from complete nodes, so chunks that partial
//! holders had could be verified by nobody else; nothing arrived for 30 s,
//! the stall rule fired everywhere, and the run ended at the simulator's
//! limit with nobody done and 135x the image sent. Modelled on the agent as
//! it now is (a full announce republishes the hashes of the chunks a node
//! holds; the tracker-silence fallback fetches only what no known peer holds
//! and ends, dropping its fetches, when the tracker answers; fetched chunks
//! are published), `outage-1k` finishes at p99 30.5 s (1.78x the bound, 10 s
//! of it the outage) with 1.46x the image from the registry. A fallback
//! budget across the cluster (as `max_runs_per_origin` is for runs) would cut
//! the duplicate fetches of the outage itself; not built.
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
//! The agent's timings and limits (announce period, stall and tracker-grace
//! rules, peers and watchers per blob, registry fetches in fallback, BUSY
//! back-off, the tracker's tick) come from `dray_protocol::defaults`, which
//! the agent's configuration reads too; a test in `dray`'s `storm` module
//! fails if the two part. The fallback rules (stall, tracker silence, the
//! tracker's "registry fetch under way" exception) are
//! `dray_protocol::pull::FallbackRule`, which the agent's swarm engine runs
//! too. Still modelled here: a node keeps one fallback state for all its
//! layers (the agent one per blob), a fallback fetches single chunks rather
//! than runs of `run_chunks`, and an idle node checks its rules every
//! `poll_s` (0.5 s; the agent every 50 ms).

mod net;
mod queue;
mod report;
mod scenario;
mod sim;
mod tracker;

pub use report::{EgressBucket, SimReport, write_svg};
pub use scenario::{
    CHUNK_BYTES, Churn, Emulated, LateJoiners, Outage, Racks, SCENARIOS, Scenario, scenario,
};

use serde::Serialize;

/// How the nodes get the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Strategy {
    /// The real scheduler and picker: registry runs striped once over the swarm.
    Dray,
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
    pub const ALL: [Strategy; 4] = [
        Strategy::Dray,
        Strategy::Direct,
        Strategy::KrakenLike,
        Strategy::SpegelLike,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Dray => "dray",
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
    #[error("unknown strategy {0:?}; valid strategies: dray, direct, kraken-like, spegel-like")]
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
