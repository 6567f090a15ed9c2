//! The swarm's default timings and limits, in one place: the agent's
//! configuration defaults, the tracker's ticker and the simulator's model
//! all read them, so a simulated storm describes the agent as shipped and a
//! tuning change is made once (a test in the `dray` crate fails if the
//! simulator's scenario and the agent's defaults part). What decided each
//! value, with its figures, is in `docs/results.md`.

use std::time::Duration;

/// Every default of how a node pulls and serves that the simulator models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwarmDefaults {
    /// Announce period while a pull runs (the agent's `swarm.pull_announce`).
    pub pull_announce_ms: u64,
    /// Announce period otherwise (`swarm.idle_announce`).
    pub idle_announce_ms: u64,
    /// Tracker silent this long during a pull: chunks no known peer holds
    /// come from the registry until it answers (`swarm.tracker_grace`).
    pub tracker_grace_ms: u64,
    /// Nothing arrived and nothing in flight this long: every unclaimed chunk
    /// comes from the registry (`swarm.stall`). 30 s: at 5 s registry-bound
    /// storms fell back en masse (`docs/results.md`).
    pub stall_ms: u64,
    /// How many `swarm.stall` periods without a chunk a pull waits on registry fetches
    /// the tracker reports under way before the stall rule applies anyway:
    /// in the soak of `tests/soak.rs` a node evicted a blob's last copy under
    /// critical disk pressure, and the tracker reported a fetch of it under
    /// way for over 60 s that no node made.
    pub fetching_patience: u32,
    /// Registry fetches a pull keeps going at once in fallback
    /// (`swarm.registry_parallel`).
    pub registry_parallel: usize,
    /// Chunks per registry run in fallback (`swarm.run_chunks`).
    pub run_chunks: u32,
    /// Chunks a node serves at once (`peer.max_uploads`).
    pub max_uploads: usize,
    /// Peer chunk requests a node keeps in flight (`peer.max_downloads`).
    pub max_downloads: usize,
    /// Chunk requests of one pull in flight to one peer at once: the
    /// agent's lanes per peer. A peer that answers nothing (frozen,
    /// withholding, trickling) holds at most this many of a node's
    /// `max_downloads` until their deadlines.
    pub depth_per_peer: usize,
    /// Peers a pull keeps per blob; the oldest goes when the tracker names
    /// another (`peer.max_peers_per_blob`).
    pub max_peers_per_blob: usize,
    /// Long-polled bitfield watchers a node serves per blob; past it a peer
    /// is refused (`peer.max_watchers_per_blob`).
    pub max_watchers_per_blob: usize,
    /// How long a lane waits after a peer refused a request (BUSY, or not held).
    pub busy_backoff_ms: u64,
    /// The tracker's ticker period: stalled assignments are taken back on it.
    pub tracker_tick_ms: u64,
    /// Without a tracker: how long a pull gathers the blob's other pullers
    /// from the DHT before it fetches its share from the registry
    /// (`swarm.dht.settle`).
    pub dht_settle_ms: u64,
    /// Without a tracker: how often a pull asks the DHT who holds or pulls
    /// its blob (`swarm.dht.lookup`).
    pub dht_lookup_ms: u64,
    /// Providers a DHT store keeps per blob, the first to come: the most
    /// members of a blob any node sees.
    pub dht_max_providers: usize,
}

/// The defaults dray ships.
pub const DEFAULTS: SwarmDefaults = SwarmDefaults {
    pull_announce_ms: 500,
    idle_announce_ms: 10_000,
    tracker_grace_ms: 3_000,
    stall_ms: 30_000,
    fetching_patience: 4,
    registry_parallel: 4,
    run_chunks: 4,
    max_uploads: 8,
    max_downloads: 8,
    depth_per_peer: 4,
    max_peers_per_blob: 16,
    max_watchers_per_blob: 256,
    busy_backoff_ms: 200,
    tracker_tick_ms: 500,
    dht_settle_ms: 200,
    dht_lookup_ms: 200,
    dht_max_providers: 256,
};

/// The wait before a node's next announce: `period` spread ±10% by `unit`
/// (uniform in [0, 1)). Agents started together (a rollout, a scale-out)
/// would otherwise announce in lockstep, reaching the tracker in bursts and
/// learning its news (hashes, holders) all at the same instants.
pub fn announce_spread(period: Duration, unit: f64) -> Duration {
    period.mul_f64(0.9 + 0.2 * unit)
}

/// Attempts a registry request gets on server errors (5xx, 429) and broken
/// connections, the first included.
pub const REGISTRY_ATTEMPTS: u32 = 5;

/// Attempt `attempt` (from 1) of a registry request failed with a server
/// error or a broken connection: how long to wait before the next, or
/// `None` if it was the last (the error is then the caller's). The agent's
/// registry client and the simulated registry runs both follow it: 200 ms,
/// doubling, 3 s in all over the five attempts.
pub fn registry_retry_after(attempt: u32) -> Option<Duration> {
    if attempt >= REGISTRY_ATTEMPTS || crate::planted::is(crate::planted::Bug::NoRetry) {
        return None;
    }
    Some(Duration::from_millis(100 << attempt.min(6)))
}

/// Milliseconds as seconds, the simulator's unit.
pub fn secs(ms: u64) -> f64 {
    ms as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_request_gets_five_attempts_three_seconds_apart_in_all() {
        let waits: Vec<Duration> = (1..).map_while(registry_retry_after).collect();
        assert_eq!(waits.len() as u32, REGISTRY_ATTEMPTS - 1);
        assert_eq!(waits[0], Duration::from_millis(200));
        assert_eq!(waits.iter().sum::<Duration>(), Duration::from_secs(3));
    }
}
