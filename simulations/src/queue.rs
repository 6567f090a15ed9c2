//! The event queue: a monotone radix heap keyed by simulated nanoseconds.
//!
//! A discrete-event simulation never queues an event before the present, so
//! a radix heap fits: an event lands in the bucket of the highest bit in
//! which its time differs from the present, and when the present runs out of
//! events the lowest non-empty bucket is split by the new present. Every
//! event moves a few times at most, each move a sequential append, where a
//! binary heap of a storm's few hundred thousand pending events walks
//! log2(n) cache lines per pop. Events due at the same time come out in the
//! order they were queued.

use std::collections::VecDeque;

/// Pending events of type `E`, by due time.
pub(crate) struct Queue<E> {
    /// The present: no event is due before it.
    now: u64,
    /// Events due exactly now, in queueing order.
    due: VecDeque<E>,
    /// `later[b]`: events whose time's highest bit differing from `now` is bit `b`.
    later: [Vec<(u64, E)>; 64],
    /// Bit `b` set: `later[b]` is not empty.
    filled: u64,
    /// The bucket being split, kept between splits so that no split
    /// allocates once the buckets have grown.
    spare: Vec<(u64, E)>,
}

impl<E> Queue<E> {
    pub fn new() -> Self {
        Self {
            now: 0,
            due: VecDeque::new(),
            later: std::array::from_fn(|_| Vec::new()),
            filled: 0,
            spare: Vec::new(),
        }
    }

    /// The present.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Queues `ev` at `at`, or now if `at` is already past.
    pub fn push(&mut self, at: u64, ev: E) {
        if at <= self.now {
            self.due.push_back(ev);
        } else {
            self.put(at, ev);
        }
    }

    fn put(&mut self, at: u64, ev: E) {
        let b = Self::bucket(self.now, at);
        self.later[b].push((at, ev));
        self.filled |= 1 << b;
    }

    fn bucket(now: u64, at: u64) -> usize {
        63 - (now ^ at).leading_zeros() as usize
    }

    /// The next event due now, without moving the present.
    pub fn pop_due(&mut self) -> Option<E> {
        self.due.pop_front()
    }

    /// Moves the present to the earliest pending time once nothing is due
    /// now; returns it, or `None` if nothing is pending.
    pub fn advance(&mut self) -> Option<u64> {
        if !self.due.is_empty() {
            return Some(self.now);
        }
        if self.filled == 0 {
            return None;
        }
        let b = self.filled.trailing_zeros() as usize;
        self.filled &= !(1 << b);
        let mut bucket = std::mem::replace(&mut self.later[b], std::mem::take(&mut self.spare));
        self.now = bucket.iter().map(|&(t, _)| t).min()?;
        // Every time in the bucket shares the bits above `b` with the new
        // present, so each lands in a lower bucket (or is due now).
        for (t, ev) in bucket.drain(..) {
            if t == self.now {
                self.due.push_back(ev);
            } else {
                self.put(t, ev);
            }
        }
        self.spare = bucket;
        Some(self.now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the order of pushes (never into the past), events come out
    /// by time, ties in queueing order, as a sort would give them.
    #[test]
    fn pops_by_time_then_queueing_order() {
        let mut q = Queue::new();
        let mut expected = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut id = 0;
        let mut out = Vec::new();
        for round in 0..200 {
            for _ in 0..next(20) {
                // Clustered times, so ties are common.
                let at = q.now() + next(4) * next(1 << (round % 40));
                q.push(at, id);
                expected.push((at, id));
                id += 1;
            }
            for _ in 0..next(15) {
                match q.pop_due() {
                    Some(ev) => out.push((q.now(), ev)),
                    None => {
                        if q.advance().is_none() {
                            break;
                        }
                    }
                }
            }
        }
        while q.advance().is_some() {
            while let Some(ev) = q.pop_due() {
                out.push((q.now(), ev));
            }
        }
        expected.sort_by_key(|&(at, id)| (at, id));
        assert_eq!(out, expected);
    }
}
