//! The chunk picker: which chunk to ask a given peer for next.
//!
//! A pure state machine shared by the agent and the simulator. It favours a
//! window of chunks just past the reader's cursor (the first chunk not yet held)
//! so that a streaming consumer such as the unpacker is fed in order, and picks
//! rarest-first beyond that window so that scarce chunks spread early.

use crate::Bitfield;
use std::collections::{HashMap, HashSet};

/// Chunks past the cursor that are fetched in order before rarest-first applies.
pub const DEFAULT_WINDOW: u32 = 8;

/// Picks chunks of one blob for the peers that hold them.
#[derive(Debug, Clone)]
pub struct ChunkPicker<P> {
    held: Bitfield,
    in_flight: Bitfield,
    /// How many usable peers hold each chunk.
    availability: Vec<u32>,
    peers: HashMap<P, Bitfield>,
    banned: HashSet<P>,
    window: u32,
}

impl<P: Clone + Eq + std::hash::Hash> ChunkPicker<P> {
    /// A picker for a blob of which `held` is already here.
    pub fn new(held: Bitfield, window: u32) -> Self {
        let n = held.len();
        Self {
            in_flight: Bitfield::new(n),
            availability: vec![0; n as usize],
            held,
            peers: HashMap::new(),
            banned: HashSet::new(),
            window,
        }
    }

    /// A peer and what it holds (replaces what was known of it). Banned peers are ignored.
    pub fn set_peer(&mut self, peer: P, bits: Bitfield) {
        if self.banned.contains(&peer) || bits.len() != self.held.len() {
            return;
        }
        match self.peers.get_mut(&peer) {
            // Only the chunks whose bit changed move the counts: a peer's
            // bitfield mostly grows by a few chunks between looks.
            Some(old) => {
                for (byte, (&was, &now)) in old.as_bytes().iter().zip(bits.as_bytes()).enumerate() {
                    let mut changed = was ^ now;
                    while changed != 0 {
                        let bit = changed.leading_zeros() as usize;
                        changed &= !(0x80 >> bit);
                        let slot = &mut self.availability[byte * 8 + bit];
                        if now & (0x80 >> bit) != 0 {
                            *slot += 1;
                        } else {
                            *slot -= 1;
                        }
                    }
                }
                *old = bits;
            }
            None => {
                for i in bits.ones() {
                    self.availability[i as usize] += 1;
                }
                self.peers.insert(peer, bits);
            }
        }
    }

    /// A peer announced a chunk it verified.
    pub fn peer_has(&mut self, peer: &P, index: u32) {
        if let Some(bits) = self.peers.get_mut(peer)
            && bits.set(index)
        {
            self.availability[index as usize] += 1;
        }
    }

    pub fn remove_peer(&mut self, peer: &P) {
        if let Some(bits) = self.peers.remove(peer) {
            for i in bits.ones() {
                self.availability[i as usize] -= 1;
            }
        }
    }

    /// A peer sent a chunk that failed its hash: never ask it again.
    pub fn ban(&mut self, peer: &P) {
        self.remove_peer(peer);
        self.banned.insert(peer.clone());
    }

    pub fn is_banned(&self, peer: &P) -> bool {
        self.banned.contains(peer)
    }

    /// The first chunk not yet held: where an in-order reader waits.
    pub fn cursor(&self) -> u32 {
        self.held.zeros().next().unwrap_or(self.held.len())
    }

    /// The next chunk to ask `peer` for, marked in flight; `None` if it holds
    /// nothing we still need.
    pub fn pick(&mut self, peer: &P) -> Option<u32> {
        let bits = self.peers.get(peer)?;
        let wanted = |i: u32| bits.get(i) && !self.held.get(i) && !self.in_flight.get(i);
        let cursor = self.cursor();
        let window_end = cursor.saturating_add(self.window).min(self.held.len());
        let pick = (cursor..window_end).find(|&i| wanted(i)).or_else(|| {
            (window_end..self.held.len())
                .filter(|&i| wanted(i))
                .min_by_key(|&i| (self.availability[i as usize], i))
        })?;
        self.in_flight.set(pick);
        Some(pick)
    }

    /// Marks a chunk in flight from a source outside the picker (the registry);
    /// false if it is held or already in flight.
    pub fn claim(&mut self, index: u32) -> bool {
        if index >= self.held.len() || self.held.get(index) || self.in_flight.get(index) {
            return false;
        }
        self.in_flight.set(index)
    }

    /// Neither held nor in flight.
    pub fn is_unclaimed(&self, index: u32) -> bool {
        index < self.held.len() && !self.held.get(index) && !self.in_flight.get(index)
    }

    /// The chunk arrived and verified.
    pub fn completed(&mut self, index: u32) {
        self.in_flight.clear(index);
        self.held.set(index);
    }

    /// The request for the chunk failed; it may be picked again.
    pub fn failed(&mut self, index: u32) {
        self.in_flight.clear(index);
    }

    /// Chunks requested and not yet completed or failed.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.count()
    }

    pub fn is_done(&self) -> bool {
        self.held.is_full()
    }

    /// Chunks not held that no usable peer holds either.
    pub fn unavailable(&self) -> impl Iterator<Item = u32> + '_ {
        self.held
            .zeros()
            .filter(|&i| self.availability[i as usize] == 0)
    }

    /// Whether any usable peer is known.
    pub fn has_peers(&self) -> bool {
        !self.peers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(n: u32, ones: &[u32]) -> Bitfield {
        let mut b = Bitfield::new(n);
        for &i in ones {
            b.set(i);
        }
        b
    }

    #[test]
    fn feeds_the_window_in_order_then_rarest_first() {
        let mut p = ChunkPicker::new(bits(20, &[0]), 3);
        p.set_peer("a", bits(20, &(0..20).collect::<Vec<_>>()));
        p.set_peer("b", bits(20, &(0..19).collect::<Vec<_>>()));
        assert_eq!(p.pick(&"a"), Some(1));
        assert_eq!(p.pick(&"a"), Some(2));
        assert_eq!(p.pick(&"b"), Some(3));
        // window [1,4) exhausted: chunk 19 is held only by a, the rarest.
        assert_eq!(p.pick(&"a"), Some(19));
        assert_eq!(p.pick(&"b"), Some(4));
    }

    #[test]
    fn failed_chunks_return_and_banned_peers_are_never_asked() {
        let mut p = ChunkPicker::new(bits(4, &[]), 8);
        p.set_peer("bad", bits(4, &[0, 1, 2, 3]));
        p.set_peer("good", bits(4, &[0, 1, 2, 3]));
        assert_eq!(p.pick(&"bad"), Some(0));
        p.ban(&"bad");
        p.failed(0);
        assert_eq!(p.pick(&"bad"), None);
        p.set_peer("bad", bits(4, &[0, 1, 2, 3]));
        assert_eq!(p.pick(&"bad"), None);
        assert_eq!(p.pick(&"good"), Some(0));
        for i in 0..4 {
            p.completed(i);
        }
        assert!(p.is_done());
        assert_eq!(p.pick(&"good"), None);
    }

    #[test]
    fn claimed_chunks_are_not_picked_until_released() {
        let mut p = ChunkPicker::new(bits(2, &[]), 8);
        p.set_peer("a", bits(2, &[0, 1]));
        assert!(p.claim(0) && !p.claim(0));
        assert!(!p.is_unclaimed(0) && p.is_unclaimed(1));
        assert_eq!(p.pick(&"a"), Some(1));
        assert_eq!(p.pick(&"a"), None);
        p.failed(0);
        assert_eq!(p.pick(&"a"), Some(0));
    }

    #[test]
    fn reports_chunks_no_peer_holds() {
        let mut p = ChunkPicker::new(bits(4, &[0]), 8);
        p.set_peer("a", bits(4, &[1]));
        assert_eq!(p.unavailable().collect::<Vec<_>>(), vec![2, 3]);
        p.peer_has(&"a", 3);
        assert_eq!(p.unavailable().collect::<Vec<_>>(), vec![2]);
    }
}
