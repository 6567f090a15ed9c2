//! How long a chunk request to a peer is waited for: the deadline rule the
//! agent's lanes (`agent/src/pull/fetch.rs`) and the simulated nodes share.
//!
//! A request's deadline is its length at the median rate of the transfer's
//! last chunks from peers ([`ChunkRates`]), times [`SLOW_FACTOR`], at least
//! [`MIN_CHUNK_DEADLINE`]; before the transfer has seen a rate, its length
//! at the slowest rate waited for plus the request timeout
//! ([`first_deadline`]). The deadline follows the swarm rather than a fixed
//! rate: on a node starved of CPU every chunk is slow, and a fixed
//! 256 KiB/s dropped honest peers by the dozen. A swarm transfer drops a
//! peer that misses a deadline for good: a frozen peer (its process
//! stopped, its connections open) answers nothing, and without the
//! deadline the chunks asked of it stay in flight, which also holds the
//! pull's stall rule, forever.

use crate::planted::{self, Bug};
use std::collections::VecDeque;
use std::time::Duration;

/// A chunk request's deadline, in multiples of the time the transfer's
/// median peer rate needs for it. Generous: peers on a busy node, or on a
/// link shared by many uploads, vary several-fold from chunk to chunk.
pub const SLOW_FACTOR: f64 = 8.0;

/// The shortest deadline a chunk request gets, whatever its size and rate:
/// a round trip and the scheduling jitter of a busy node fit in it.
pub const MIN_CHUNK_DEADLINE: Duration = Duration::from_secs(2);

/// Chunk rates the median is taken over: the last ones, so that it follows
/// a swarm whose load changes.
pub const RATE_SAMPLES: usize = 16;

/// The slowest rate a chunk is waited for before a transfer has seen one
/// (`peer.min_chunk_bytes_per_s`): 16 s for a 4 MiB chunk.
pub const MIN_CHUNK_BYTES_PER_S: u64 = 256 << 10;

/// How long a request may move no byte (`peer.request_timeout`).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// The deadline of a request for `len` bytes before any rate was seen: its
/// length at `slowest` bytes per second (at least [`MIN_CHUNK_DEADLINE`]),
/// plus `request_timeout`.
pub fn first_deadline(len: usize, slowest: u64, request_timeout: Duration) -> Duration {
    let d = Duration::from_secs_f64(len as f64 / slowest.max(1) as f64).max(MIN_CHUNK_DEADLINE)
        + request_timeout;
    if planted::is(Bug::NoDeadline) {
        return Duration::MAX;
    }
    d
}

/// How long a request is waited for once its peer stops answering: its
/// deadline, or `request_timeout` without a byte, whichever is shorter (the
/// agent's lane gives up on the first; its peer client fails the request
/// silent after the second). A withholder or a frozen peer is dropped
/// after at most the request timeout, whatever the first deadline.
pub fn silent_deadline(deadline: Duration, request_timeout: Duration) -> Duration {
    if planted::is(Bug::NoDeadline) {
        return Duration::MAX;
    }
    deadline.min(request_timeout)
}

/// The rates of a transfer's last chunks from peers, bytes per second.
#[derive(Clone, Debug, Default)]
pub struct ChunkRates {
    rates: VecDeque<f64>,
}

impl ChunkRates {
    /// A chunk came from a peer at `rate` bytes per second.
    pub fn record(&mut self, rate: f64) {
        if self.rates.len() == RATE_SAMPLES {
            self.rates.pop_front();
        }
        self.rates.push_back(rate);
    }

    /// The median of the recent rates.
    pub fn median(&self) -> Option<f64> {
        let mut r: Vec<f64> = self.rates.iter().copied().collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied()
    }

    /// How long a request for `len` bytes may take; `first` is the
    /// deadline before any rate was seen ([`first_deadline`]).
    pub fn deadline(&self, len: usize, first: impl FnOnce() -> Duration) -> Duration {
        match self.median() {
            _ if planted::is(Bug::NoDeadline) => Duration::MAX,
            Some(rate) => {
                Duration::from_secs_f64(SLOW_FACTOR * len as f64 / rate).max(MIN_CHUNK_DEADLINE)
            }
            None => first(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn the_deadline_is_eight_times_the_median_rate_at_least_two_seconds() {
        let mut r = ChunkRates::default();
        let first = || first_deadline(4 * MIB, MIN_CHUNK_BYTES_PER_S, REQUEST_TIMEOUT);
        assert_eq!(r.deadline(4 * MIB, first), Duration::from_secs(36));
        // 4 MiB at 16 MiB/s is 0.25 s: 2 s, not 8 x 0.25.
        r.record(16.0 * MIB as f64);
        assert_eq!(r.deadline(4 * MIB, first), MIN_CHUNK_DEADLINE);
        // The median of the last 16: one slow chunk moves nothing.
        for _ in 0..20 {
            r.record(MIB as f64);
        }
        r.record(1.0);
        assert_eq!(r.deadline(4 * MIB, first), Duration::from_secs(32));
        assert_eq!(r.rates.len(), RATE_SAMPLES);
    }
}
