//! A map that keeps at most a fixed number of entries, dropping the oldest
//! insertion first: for caches whose keys come from outside (registry names
//! and digests a local client picks), which must not grow without bound.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

pub struct BoundedMap<K, V> {
    capacity: usize,
    map: HashMap<K, V>,
    /// Keys in insertion order; a key is in here once while it is in `map`.
    order: VecDeque<K>,
}

impl<K: Hash + Eq + Clone, V> BoundedMap<K, V> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.map.get(key)
    }

    /// Inserts or replaces; a new key past the capacity evicts the oldest.
    pub fn insert(&mut self, key: K, value: V) {
        if self.map.insert(key.clone(), value).is_none() {
            self.order.push_back(key);
            while self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_entries_up_to_its_capacity() {
        let mut m = BoundedMap::new(2);
        m.insert("a", 1);
        m.insert("b", 2);
        m.insert("a", 3);
        assert_eq!((m.len(), m.get(&"a")), (2, Some(&3)));
        m.insert("c", 4);
        assert_eq!(
            (m.get(&"a"), m.get(&"b"), m.get(&"c")),
            (None, Some(&2), Some(&4))
        );
        assert_eq!(m.len(), 2);
    }
}
