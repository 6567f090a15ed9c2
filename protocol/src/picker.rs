//! The chunk picker: which chunk to ask a given peer for next.
//!
//! A pure state machine shared by the agent and the simulator. It favours a
//! window of chunks just past the reader's cursor (the first chunk not yet held)
//! so that a streaming consumer such as the unpacker is fed in order, and picks
//! rarest-first beyond that window so that scarce chunks spread early.

use crate::Bitfield;
use crate::bitfield::{bit, set_bits};
// Fx hashing: banned peer keys are authenticated identities (or node numbers
// in the simulator), not input an attacker can pick to collide.
use rustc_hash::FxHashSet;

/// Chunks past the cursor that are fetched in order before rarest-first applies.
pub const DEFAULT_WINDOW: u32 = 8;

/// Picks chunks of one blob for the peers that hold them.
///
/// Peers are found by a scan of their keys, not a hash probe: a blob has a
/// few dozen peers at most (the agent's `peer.max_peers_per_blob`), their keys
/// share a cache line or two, and the bits of all of them sit in one block
/// whose offsets need no lookup. Pickers are many (one per blob being pulled,
/// 40,000 in `storm-10k`) and each is touched briefly, so what counts is how
/// few separate places a call reads: this layout took the simulator's
/// `storm-10k` from 97 to 85 s (side by side) against a map of per-peer bitfields.
#[derive(Debug, Clone)]
pub struct ChunkPicker<P> {
    held: Bitfield,
    in_flight: Bitfield,
    /// How many usable peers hold each chunk.
    availability: Vec<u32>,
    /// Usable peers, in slots.
    peers: Vec<P>,
    /// The bits of the peer in slot k, at `k * stride`.
    views: Vec<u8>,
    /// Per slot: the last pick found nothing wanted there and nothing has
    /// made any of its chunks wanted since, so the next pick can skip the
    /// scan. Most picks in a busy swarm ask peers with nothing new.
    spent: Vec<bool>,
    banned: FxHashSet<P>,
    window: u32,
    /// The first chunk not held.
    cursor: u32,
    /// Chunks some usable peer holds that are neither held nor in flight.
    offered: u32,
}

impl<P: Clone + Eq + std::hash::Hash> ChunkPicker<P> {
    /// A picker for a blob of which `held` is already here.
    pub fn new(held: Bitfield, window: u32) -> Self {
        let n = held.len();
        let cursor = held.next_zero(0);
        Self {
            in_flight: Bitfield::new(n),
            availability: vec![0; n as usize],
            held,
            peers: Vec::new(),
            views: Vec::new(),
            spent: Vec::new(),
            banned: FxHashSet::default(),
            window,
            cursor,
            offered: 0,
        }
    }

    /// Bytes per peer view.
    fn stride(&self) -> usize {
        self.held.as_bytes().len()
    }

    fn slot(&self, peer: &P) -> Option<usize> {
        self.peers.iter().position(|p| p == peer)
    }

    fn view(&self, slot: usize) -> &[u8] {
        let stride = self.stride();
        &self.views[slot * stride..(slot + 1) * stride]
    }

    /// One more (`up`) or one fewer usable peer holds chunk `i`.
    fn shift(&mut self, i: u32, up: bool) {
        let open = self.is_unclaimed(i);
        let slot = &mut self.availability[i as usize];
        let before = *slot > 0;
        if up {
            *slot += 1;
        } else {
            *slot -= 1;
        }
        if open && before != (*slot > 0) {
            if up {
                self.offered += 1;
            } else {
                self.offered -= 1;
            }
        }
    }

    /// Chunk `i` stops (`false`) or starts (`true`) being pickable: offered
    /// counts it while some peer holds it.
    fn reopen(&mut self, i: u32, open: bool) {
        if self.availability[i as usize] > 0 {
            if open {
                self.offered += 1;
            } else {
                self.offered -= 1;
            }
        }
    }

    /// A peer and what it holds (replaces what was known of it). Banned peers are ignored.
    pub fn set_peer(&mut self, peer: P, bits: Bitfield) {
        if self.banned.contains(&peer) || bits.len() != self.held.len() {
            return;
        }
        match self.slot(&peer) {
            // Only the chunks whose bit changed move the counts: a peer's
            // bitfield mostly grows by a few chunks between looks.
            Some(k) => {
                self.spent[k] = false;
                let stride = self.stride();
                let old = &mut self.views[k * stride..(k + 1) * stride];
                let mut moves = Vec::new();
                for (byte, (was, &now)) in old.iter_mut().zip(bits.as_bytes()).enumerate() {
                    let mut changed = *was ^ now;
                    *was = now;
                    while changed != 0 {
                        let b = changed.leading_zeros();
                        changed &= !(0x80 >> b);
                        moves.push((byte as u32 * 8 + b, now & (0x80 >> b) != 0));
                    }
                }
                for (i, up) in moves {
                    self.shift(i, up);
                }
            }
            None => {
                for i in bits.ones() {
                    self.shift(i, true);
                }
                self.peers.push(peer);
                self.spent.push(false);
                self.views.extend_from_slice(bits.as_bytes());
            }
        }
    }

    /// A peer announced a chunk it verified.
    pub fn peer_has(&mut self, peer: &P, index: u32) {
        if index >= self.held.len() {
            return;
        }
        let Some(k) = self.slot(peer) else {
            return;
        };
        let (byte, mask) = bit(index);
        let at = k * self.stride() + byte;
        if self.views[at] & mask == 0 {
            self.views[at] |= mask;
            self.spent[k] &= !self.is_unclaimed(index);
            self.shift(index, true);
        }
    }

    pub fn remove_peer(&mut self, peer: &P) {
        let Some(k) = self.slot(peer) else {
            return;
        };
        let gone: Vec<u32> = set_bits(self.view(k).iter().copied()).collect();
        for i in gone {
            self.shift(i, false);
        }
        // The last slot moves into the freed one.
        let stride = self.stride();
        let last = self.peers.len() - 1;
        self.views
            .copy_within(last * stride..(last + 1) * stride, k * stride);
        self.views.truncate(last * stride);
        self.peers.swap_remove(k);
        self.spent.swap_remove(k);
    }

    /// A peer sent a chunk that failed its hash, or missed its deadline:
    /// never ask it again.
    pub fn ban(&mut self, peer: &P) {
        self.remove_peer(peer);
        self.banned.insert(peer.clone());
    }

    pub fn is_banned(&self, peer: &P) -> bool {
        self.banned.contains(peer)
    }

    /// Some peer was dropped for good (it lied, froze or trickled).
    pub fn banned_any(&self) -> bool {
        !self.banned.is_empty()
    }

    /// The first chunk not yet held: where an in-order reader waits.
    pub fn cursor(&self) -> u32 {
        self.cursor
    }

    /// The next chunk to ask `peer` for, marked in flight; `None` if it holds
    /// nothing we still need.
    pub fn pick(&mut self, peer: &P) -> Option<u32> {
        let k = self.slot(peer)?;
        if self.spent[k] {
            return None;
        }
        let theirs = self.view(k);
        let (held, busy) = (self.held.as_bytes(), self.in_flight.as_bytes());
        let window_end = self.cursor.saturating_add(self.window);
        // The lowest wanted chunk in the window, else the rarest wanted one
        // (lowest index among equals). Everything below the cursor is held.
        let mut best: Option<(u32, u32)> = None;
        'scan: for j in (self.cursor / 8) as usize..theirs.len() {
            let mut wanted = theirs[j] & !held[j] & !busy[j];
            while wanted != 0 {
                let bit = wanted.leading_zeros();
                wanted &= !(0x80 >> bit);
                let i = j as u32 * 8 + bit;
                if i < window_end {
                    best = Some((0, i));
                    break 'scan;
                }
                let a = self.availability[i as usize];
                if best.is_none_or(|(rarest, _)| a < rarest) {
                    best = Some((a, i));
                    // This peer holds it: nothing is rarer.
                    if a <= 1 {
                        break 'scan;
                    }
                }
            }
        }
        let Some((_, pick)) = best else {
            self.spent[k] = true;
            return None;
        };
        self.in_flight.set(pick);
        self.reopen(pick, false);
        Some(pick)
    }

    /// Marks a chunk in flight from a source outside the picker (the registry);
    /// false if it is held or already in flight.
    pub fn claim(&mut self, index: u32) -> bool {
        if index >= self.held.len() || self.held.get(index) || self.in_flight.get(index) {
            return false;
        }
        self.in_flight.set(index);
        self.reopen(index, false);
        true
    }

    /// Neither held nor in flight.
    pub fn is_unclaimed(&self, index: u32) -> bool {
        index < self.held.len() && !self.held.get(index) && !self.in_flight.get(index)
    }

    /// The chunk arrived and verified.
    pub fn completed(&mut self, index: u32) {
        if self.is_unclaimed(index) {
            self.reopen(index, false);
        }
        self.in_flight.clear(index);
        self.held.set(index);
        if index == self.cursor {
            self.cursor = self.held.next_zero(index);
        }
    }

    /// The request for the chunk failed; it may be picked again.
    pub fn failed(&mut self, index: u32) {
        if self.in_flight.clear(index) && !self.held.get(index) {
            self.reopen(index, true);
            // Wanted again: worth a look at every peer that holds it.
            let (byte, mask) = bit(index);
            let stride = self.stride();
            for (k, spent) in self.spent.iter_mut().enumerate() {
                *spent &= self.views[k * stride + byte] & mask == 0;
            }
        }
    }

    /// Whether some usable peer holds a chunk that is neither held nor in
    /// flight: if not, no [`ChunkPicker::pick`] can return anything.
    pub fn offers_any(&self) -> bool {
        self.offered > 0
    }

    /// Chunks requested and not yet completed or failed.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.count()
    }

    pub fn is_done(&self) -> bool {
        self.held.is_full()
    }

    /// Chunks neither held nor in flight, in order.
    pub fn unclaimed(&self) -> impl Iterator<Item = u32> + '_ {
        (self.cursor..self.held.len()).filter(|&i| self.is_unclaimed(i))
    }

    /// Chunks not held that no usable peer holds either.
    pub fn unavailable(&self) -> impl Iterator<Item = u32> + '_ {
        self.held
            .zeros()
            .filter(|&i| self.availability[i as usize] == 0)
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

    /// What `pick` must return, written the obvious way.
    fn reference_pick(
        held: &Bitfield,
        busy: &Bitfield,
        peers: &[Bitfield],
        peer: usize,
        window: u32,
    ) -> Option<u32> {
        let n = held.len();
        let wanted = |i: u32| peers[peer].get(i) && !held.get(i) && !busy.get(i);
        let cursor = held.zeros().next().unwrap_or(n);
        let window_end = cursor.saturating_add(window).min(n);
        let availability = |i: u32| peers.iter().filter(|p| p.get(i)).count();
        (cursor..window_end).find(|&i| wanted(i)).or_else(|| {
            (window_end..n)
                .filter(|&i| wanted(i))
                .min_by_key(|&i| (availability(i), i))
        })
    }

    proptest::proptest! {
        #[test]
        fn picks_what_the_reference_picks(
            n in 1u32..80,
            window in 0u32..10,
            seeds in proptest::collection::vec(proptest::collection::vec(proptest::bool::weighted(0.4), 80), 4),
            steps in proptest::collection::vec((0u8..8, 0usize..3, 0u32..80), 1..60),
        ) {
            let field = |k: usize| {
                let ones: Vec<u32> = (0..n).filter(|&i| seeds[k][i as usize]).collect();
                bits(n, &ones)
            };
            let mut held = field(3);
            let mut busy = Bitfield::new(n);
            // A peer the picker dropped holds nothing as far as the reference knows.
            let mut peers: Vec<Bitfield> = (0..3).map(field).collect();
            let mut present = [true; 3];
            let mut p = ChunkPicker::new(held.clone(), window);
            for (k, bits) in peers.iter().enumerate() {
                p.set_peer(k, bits.clone());
            }
            for (op, peer, chunk) in steps {
                let chunk = chunk % n;
                let in_flight = busy.ones().find(|&i| i >= chunk).or_else(|| busy.ones().next());
                match op {
                    0 => {
                        let want = reference_pick(&held, &busy, &peers, peer, window);
                        let got = p.pick(&peer);
                        proptest::prop_assert_eq!(got, want);
                        if let Some(i) = got {
                            busy.set(i);
                        }
                    }
                    1 | 2 => {
                        if let Some(i) = in_flight {
                            busy.clear(i);
                            if op == 1 {
                                p.completed(i);
                                held.set(i);
                            } else {
                                p.failed(i);
                            }
                        }
                    }
                    3 => {
                        p.peer_has(&peer, chunk);
                        if present[peer] {
                            peers[peer].set(chunk);
                        }
                    }
                    4 => {
                        let free = !held.get(chunk) && !busy.get(chunk);
                        proptest::prop_assert_eq!(p.claim(chunk), free);
                        busy.set(chunk);
                    }
                    5 => {
                        p.remove_peer(&peer);
                        present[peer] = false;
                        peers[peer] = Bitfield::new(n);
                    }
                    6 => {
                        // A fresh look at a peer: one chunk more or less than before.
                        let mut view = peers[peer].clone();
                        if !view.clear(chunk) {
                            view.set(chunk);
                        }
                        p.set_peer(peer, view.clone());
                        present[peer] = true;
                        peers[peer] = view;
                    }
                    _ => {
                        // A chunk that arrived from elsewhere (the registry).
                        p.completed(chunk);
                        held.set(chunk);
                        busy.clear(chunk);
                    }
                }
                let offered = (0..n)
                    .filter(|&i| !held.get(i) && !busy.get(i) && peers.iter().any(|q| q.get(i)))
                    .count();
                proptest::prop_assert_eq!(p.offers_any(), offered > 0);
            }
        }
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
