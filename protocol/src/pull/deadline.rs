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
/// median peer rate needs for it: `max_uploads`. An honest peer serving its
/// `max_uploads` chunks at once gives each that share of its link, and the
/// median may have been set while it served one (the first chunks of a
/// storm), so such a request ends near its deadline, before or after with
/// the link's jitter: past it, [`extension`] decides.
pub const SLOW_FACTOR: f64 = crate::defaults::DEFAULTS.max_uploads as f64;

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

/// A chunk request's deadline ([`ChunkRates::deadline`]): how long it is
/// waited for, and whether a request half there by then gets
/// [`extension`]. One from the swarm's median rate does; the first, from
/// the slowest rate waited for plus the request timeout, does not: a peer
/// slower than that floor is too slow, whatever it sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub wait: Duration,
    pub extendable: bool,
}

/// A request past its `deadline` with `received` of its `len` bytes: how
/// much longer it is waited for, if at all. One with an extendable
/// deadline and half its bytes or more moves at no less than half the
/// share its deadline allows and gets as long again; any other is
/// dropped. An honest peer serving its `max_uploads` has most of the chunk
/// by then; a trickler (a byte now and then) and a silent peer have next
/// to nothing, and are dropped at the deadline as before. Without it the
/// emulated storm dropped busy honest peers as too slow and, reported,
/// their chunks left the registry again;
/// a deadline twice as long for every request instead made withholders
/// and tricklers hold requests twice as long (`docs/results.md`,
/// "Deadlines and busy peers").
pub fn extension(deadline: Deadline, received: usize, len: usize) -> Option<Duration> {
    (deadline.extendable && received.saturating_mul(2) >= len).then_some(deadline.wait)
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
    pub fn deadline(&self, len: usize, first: impl FnOnce() -> Duration) -> Deadline {
        let (wait, extendable) = match self.median() {
            _ if planted::is(Bug::NoDeadline) => (Duration::MAX, false),
            Some(rate) => (
                Duration::from_secs_f64(SLOW_FACTOR * len as f64 / rate).max(MIN_CHUNK_DEADLINE),
                true,
            ),
            None => (first(), false),
        };
        Deadline { wait, extendable }
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
        let wait = |r: &ChunkRates| r.deadline(4 * MIB, first).wait;
        assert_eq!(
            r.deadline(4 * MIB, first),
            Deadline {
                wait: Duration::from_secs(36),
                extendable: false
            }
        );
        // 4 MiB at 16 MiB/s is 0.25 s: 2 s, not 8 x 0.25.
        r.record(16.0 * MIB as f64);
        assert_eq!(wait(&r), MIN_CHUNK_DEADLINE);
        // The median of the last 16: one slow chunk moves nothing.
        for _ in 0..20 {
            r.record(MIB as f64);
        }
        r.record(1.0);
        assert_eq!(wait(&r), Duration::from_secs(32));
        assert_eq!(r.rates.len(), RATE_SAMPLES);
    }

    /// The storm's first chunks come from peers serving one request each;
    /// later a peer serves `max_uploads` at once and each gets that share
    /// of its link, give or take the link's jitter (here a third less).
    /// Such a peer is honest, and dropping it (and reporting it) sent its
    /// chunks to the registry again; a trickler is not.
    #[test]
    fn an_honest_peer_serving_its_most_uploads_is_waited_for_and_a_trickler_is_not() {
        let mut r = ChunkRates::default();
        let idle = 11.0 * MIB as f64;
        for _ in 0..RATE_SAMPLES {
            r.record(idle);
        }
        let len = 4 * MIB;
        let first = || first_deadline(len, MIN_CHUNK_BYTES_PER_S, REQUEST_TIMEOUT);
        let deadline = r.deadline(len, first);
        let uploads = crate::defaults::DEFAULTS.max_uploads as f64;
        let shared = 2.0 / 3.0 * idle / uploads;
        let took = Duration::from_secs_f64(len as f64 / shared);
        assert!(took > deadline.wait, "the case the extension is for");
        let received = (shared * deadline.wait.as_secs_f64()) as usize;
        let more = extension(deadline, received, len).expect("an honest peer is waited for");
        assert!(deadline.wait + more > took);
        let trickled = (1024.0 * deadline.wait.as_secs_f64()) as usize;
        assert_eq!(extension(deadline, trickled, len), None);
        // Before any rate, the floor rate decides alone.
        let first = ChunkRates::default().deadline(len, first);
        assert_eq!(extension(first, len - 1, len), None);
    }
}
