//! Which peers a pull fetches one blob from: the rotation rule, and the
//! watcher cap a serving node holds to. The agent's transfers and the
//! simulator's nodes both run them, so a simulated storm rotates and is
//! refused as agents are.
//!
//! - **Rotation**: a swarm pull keeps at most `cap` live peers per blob. A
//!   peer named past it retires the oldest: no new chunk is asked of it, and
//!   it stays known (not named again) until its requests in flight end and
//!   the caller lets it [`leave`](Roster::leave); it may be named again
//!   after. With a tracker handing out peers that gained chunks, the swarm
//!   keeps meeting new holders (see `max_peers_per_blob` in
//!   [`crate::defaults`]).
//! - **BUSY** is not a roster rule: the request slot (lane) a peer refused
//!   waits `busy_backoff_ms` before asking again, and the peer's other
//!   lanes carry on (the simulator retries a node's fills after the
//!   back-off). Leaving the whole peer alone for the back-off was measured
//!   worse (`docs/results.md`).
//! - **Watchers**: a node serves at most `max_watchers_per_blob` long-polled
//!   bitfield watchers per blob; one more is refused BUSY at once, and the
//!   asker retires that peer (it hears of the blob's chunks from others).

use std::borrow::Borrow;

/// What [`Roster::admit`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit<K> {
    /// Already known (live, or retired with requests still ending): nothing changed.
    Known,
    /// Added; at the cap, the oldest live peer was retired to make way.
    Added { retired: Option<K> },
}

/// One live peer of a pull.
#[derive(Clone, Debug)]
pub struct Member<K, V> {
    pub key: K,
    /// What the caller keeps with the peer.
    pub value: V,
}

/// The peers one pull of one blob fetches from, oldest first.
#[derive(Clone, Debug)]
pub struct Roster<K, V> {
    /// Live peers at most; `None`: every peer named is kept (a fixed list
    /// of peers, or a baseline without rotation).
    cap: Option<usize>,
    live: Vec<Member<K, V>>,
    /// Retired, with requests in flight still ending.
    retiring: Vec<(K, V)>,
}

impl<K: PartialEq + Clone, V> Roster<K, V> {
    pub fn new(cap: Option<usize>) -> Self {
        Self {
            cap: cap.map(|c| c.max(1)),
            live: Vec::new(),
            retiring: Vec::new(),
        }
    }

    /// A peer named for the blob. Past the cap, the oldest live peer is
    /// retired (see [`Roster::retire`]) and named in the answer.
    pub fn admit(&mut self, key: K, value: V) -> Admit<K> {
        if self.contains::<K>(&key) {
            return Admit::Known;
        }
        let retired = match self.cap {
            Some(cap) if self.live.len() >= cap => {
                let old = self.live.remove(0);
                let key = old.key.clone();
                self.retiring.push((old.key, old.value));
                Some(key)
            }
            _ => None,
        };
        self.live.push(Member { key, value });
        Admit::Added { retired }
    }

    /// No new request goes to `key` (too slow, gone, refused its watcher, or
    /// rotated out); it stays known until it [leaves](Roster::leave). Its
    /// value if it was live.
    pub fn retire<Q>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        let at = self.live.iter().position(|m| m.key.borrow() == key)?;
        let m = self.live.remove(at);
        self.retiring.push((m.key, m.value));
        self.retiring.last().map(|(_, v)| v)
    }

    /// Forgets `key`, live or retired (its requests have ended, or it left
    /// the swarm): it may be named again. Its value, if it was known.
    pub fn leave<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        if let Some(at) = self.live.iter().position(|m| m.key.borrow() == key) {
            return Some(self.live.remove(at).value);
        }
        let at = self.retiring.iter().position(|(k, _)| k.borrow() == key)?;
        Some(self.retiring.remove(at).1)
    }

    pub fn is_live<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        self.live.iter().any(|m| m.key.borrow() == key)
    }

    /// Whether `key` is known, live or retiring.
    pub fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        self.is_live(key) || self.retiring.iter().any(|(k, _)| k.borrow() == key)
    }

    /// The value kept with `key`, live or retiring.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        self.live
            .iter()
            .find(|m| m.key.borrow() == key)
            .map(|m| &m.value)
            .or_else(|| {
                self.retiring
                    .iter()
                    .find(|(k, _)| k.borrow() == key)
                    .map(|(_, v)| v)
            })
    }

    /// The value kept with `key`, live or retiring, to change.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        if let Some(m) = self.live.iter_mut().find(|m| m.key.borrow() == key) {
            return Some(&mut m.value);
        }
        self.retiring
            .iter_mut()
            .find(|(k, _)| k.borrow() == key)
            .map(|(_, v)| v)
    }

    /// The retired peers whose requests are still ending.
    pub fn retiring(&self) -> impl Iterator<Item = &K> {
        self.retiring.iter().map(|(k, _)| k)
    }

    /// The live peers, oldest first.
    pub fn live(&self) -> &[Member<K, V>] {
        &self.live
    }

    pub fn live_mut(&mut self) -> &mut [Member<K, V>] {
        &mut self.live
    }

    /// Forgets every peer, live or retiring.
    pub fn clear(&mut self) {
        self.live.clear();
        self.retiring.clear();
    }
}

/// Whether a node serving `watching` long polls of a blob takes one more
/// (`cap`: `max_watchers_per_blob`); if not, it refuses it BUSY at once, and
/// the asker retires the node from its roster for the blob.
pub fn may_watch(watching: usize, cap: usize) -> bool {
    watching < cap
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(r: &Roster<u32, ()>) -> Vec<u32> {
        r.live().iter().map(|m| m.key).collect()
    }

    #[test]
    fn a_peer_named_past_the_cap_retires_the_oldest_until_it_leaves() {
        let mut r = Roster::new(Some(2));
        assert_eq!(r.admit(1, ()), Admit::Added { retired: None });
        assert_eq!(r.admit(2, ()), Admit::Added { retired: None });
        assert_eq!(r.admit(2, ()), Admit::Known);
        assert_eq!(r.admit(3, ()), Admit::Added { retired: Some(1) });
        assert_eq!(keys(&r), vec![2, 3]);
        // Retired with a request still ending: known, not live.
        assert!(r.contains(&1) && !r.is_live(&1));
        assert_eq!(r.admit(1, ()), Admit::Known);
        assert_eq!(r.leave(&1), Some(()));
        // Back as a new peer: it retires the now oldest.
        assert_eq!(r.admit(1, ()), Admit::Added { retired: Some(2) });
        assert_eq!(keys(&r), vec![3, 1]);
    }

    #[test]
    fn without_a_cap_every_peer_named_is_kept() {
        let mut r = Roster::new(None);
        for k in 0..100 {
            assert_eq!(r.admit(k, ()), Admit::Added { retired: None });
        }
        assert_eq!(r.live().len(), 100);
        r.clear();
        assert!(!r.contains(&5));
    }

    #[test]
    fn a_retired_peer_gets_no_request_and_keeps_its_value_until_it_leaves() {
        let mut r = Roster::new(Some(4));
        r.admit("a", 7);
        r.admit("b", 8);
        assert_eq!(r.retire(&"a"), Some(&7));
        assert_eq!(r.retire(&"a"), None, "retired once");
        assert!(!r.is_live(&"a") && r.contains(&"a"));
        assert_eq!(r.retiring().collect::<Vec<_>>(), vec![&"a"]);
        assert_eq!(r.get(&"a"), Some(&7));
        assert_eq!(r.leave(&"a"), Some(7));
        assert_eq!(r.get(&"a"), None);
        assert_eq!(r.leave(&"b"), Some(8), "a live peer that left the swarm");
        assert!(r.live().is_empty());
    }

    #[test]
    fn a_node_refuses_watchers_past_its_cap_and_the_asker_retires_it() {
        assert!(may_watch(0, 256));
        assert!(may_watch(255, 256));
        assert!(!may_watch(256, 256));
        assert!(!may_watch(0, 0));
        let mut r = Roster::new(Some(16));
        r.admit(9, ());
        if !may_watch(256, 256) {
            r.retire(&9);
        }
        assert!(!r.is_live(&9));
        assert_eq!(
            r.admit(9, ()),
            Admit::Known,
            "not named again while it ends"
        );
    }
}
