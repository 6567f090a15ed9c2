//! The DHT's record store: libp2p's [`MemoryStore`], with what other
//! members may make this node keep bounded, and expired records purged on
//! a timer rather than only when read.
//!
//! - Provider records of other nodes: at most [`PER_PEER_KEYS`] keys per
//!   provider, [`REMOTE_KEYS`] in all. One member sending random keys fills
//!   its own quota, not the store.
//! - This node's own provider records: up to [`OWN_KEYS`] keys, room kept
//!   apart from the others', so the node can always publish its blobs.
//! - Node records: one per member (a member stores only its own, see
//!   `on_inbound`), [`MAX_RECORDS`] in all.
//!
//! [`BoundedStore::purge`] drops the records whose time is up; the DHT's
//! task calls it every [`super::PURGE_EVERY`].

use libp2p::PeerId;
use libp2p::kad::store::{Error as StoreError, MemoryStore, MemoryStoreConfig, RecordStore};
use libp2p::kad::{ProviderRecord, Record, RecordKey};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Keys this node provides itself, at most: a store holds a few thousand
/// blobs, and a node in an overflow list provides two keys per blob.
pub const OWN_KEYS: usize = 16 << 10;
/// Keys one other member may provide through this node, at most: in a
/// cluster of up to `k` (20) nodes every node stores every key, so a
/// member's whole store (a few thousand blobs) must fit.
pub const PER_PEER_KEYS: usize = 4 << 10;
/// Provider records of other members kept, at most (a record is about
/// 200 bytes: 13 MiB): sixteen members at their quota.
pub const REMOTE_KEYS: usize = 64 << 10;
/// Node records kept, at most: one per member.
pub const MAX_RECORDS: usize = 16 << 10;

/// A [`MemoryStore`] whose other members' provider records are quota'd per
/// member, and whose expired records can be purged (see the module docs).
pub struct BoundedStore {
    inner: MemoryStore,
    local: PeerId,
    /// The keys this node provides.
    own: HashSet<RecordKey>,
    /// Other members' provider records: when each expires, by provider
    /// and key.
    remote: HashMap<PeerId, HashMap<RecordKey, Option<Instant>>>,
    /// Entries of `remote`, all providers together.
    remote_count: usize,
}

impl BoundedStore {
    pub fn new(local: PeerId, max_value_bytes: usize, max_providers_per_key: usize) -> Self {
        let inner = MemoryStore::with_config(
            local,
            MemoryStoreConfig {
                max_records: MAX_RECORDS,
                max_value_bytes,
                max_providers_per_key,
                // Every key, its own and others': each kind bounded here.
                max_provided_keys: OWN_KEYS + REMOTE_KEYS,
            },
        );
        Self {
            inner,
            local,
            own: HashSet::new(),
            remote: HashMap::new(),
            remote_count: 0,
        }
    }

    /// Drops every record expired at `now`: other members' provider
    /// records and node records (this node's own provider records are
    /// republished by Kademlia, and withdrawn by `stop_providing`).
    /// Returns how many went.
    pub fn purge(&mut self, now: Instant) -> usize {
        let expired = |at: &Option<Instant>| at.is_some_and(|t| t <= now);
        let mut gone = Vec::new();
        for (peer, keys) in &self.remote {
            gone.extend(
                keys.iter()
                    .filter(|(_, at)| expired(at))
                    .map(|(k, _)| (k.clone(), *peer)),
            );
        }
        for (key, peer) in &gone {
            self.remove_provider(key, peer);
        }
        let stale: Vec<RecordKey> = self
            .inner
            .records()
            .filter(|r| expired(&r.expires))
            .map(|r| r.key.clone())
            .collect();
        for key in &stale {
            self.inner.remove(key);
        }
        gone.len() + stale.len()
    }

    /// Provider keys stored (this node's and others'), and node records.
    pub fn size(&self) -> (usize, usize) {
        (
            self.own.len() + self.remote_count,
            self.inner.records().len(),
        )
    }
}

impl RecordStore for BoundedStore {
    type RecordsIter<'a> = <MemoryStore as RecordStore>::RecordsIter<'a>;
    type ProvidedIter<'a> = <MemoryStore as RecordStore>::ProvidedIter<'a>;

    fn get(&self, k: &RecordKey) -> Option<Cow<'_, Record>> {
        self.inner.get(k)
    }

    fn put(&mut self, r: Record) -> Result<(), StoreError> {
        self.inner.put(r)
    }

    fn remove(&mut self, k: &RecordKey) {
        self.inner.remove(k)
    }

    fn records(&self) -> Self::RecordsIter<'_> {
        self.inner.records()
    }

    /// Refuses a key past its provider's quota: [`OWN_KEYS`] for this
    /// node, [`PER_PEER_KEYS`] for another member, and [`REMOTE_KEYS`] for
    /// all other members together. A record already kept is renewed.
    fn add_provider(&mut self, record: ProviderRecord) -> Result<(), StoreError> {
        if record.provider == self.local {
            if !self.own.contains(&record.key) && self.own.len() >= OWN_KEYS {
                return Err(StoreError::MaxProvidedKeys);
            }
            let key = record.key.clone();
            self.inner.add_provider(record)?;
            self.own.insert(key);
            return Ok(());
        }
        let (key, expires, provider) = (record.key.clone(), record.expires, record.provider);
        let keys = self.remote.entry(provider).or_default();
        let known = keys.contains_key(&key);
        if !known && (keys.len() >= PER_PEER_KEYS || self.remote_count >= REMOTE_KEYS) {
            if keys.is_empty() {
                self.remote.remove(&provider);
            }
            return Err(StoreError::MaxProvidedKeys);
        }
        self.inner.add_provider(record)?;
        let keys = self.remote.entry(provider).or_default();
        if keys.insert(key, expires).is_none() {
            self.remote_count += 1;
        }
        Ok(())
    }

    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        self.inner.providers(key)
    }

    fn provided(&self) -> Self::ProvidedIter<'_> {
        self.inner.provided()
    }

    fn remove_provider(&mut self, k: &RecordKey, p: &PeerId) {
        self.inner.remove_provider(k, p);
        if *p == self.local {
            self.own.remove(k);
        }
        if let Some(keys) = self.remote.get_mut(p) {
            if keys.remove(k).is_some() {
                self.remote_count -= 1;
            }
            if keys.is_empty() {
                self.remote.remove(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const TTL: Duration = Duration::from_secs(30 * 60);

    fn record(key: &str, provider: PeerId, now: Instant) -> ProviderRecord {
        let mut r = ProviderRecord::new(RecordKey::new(&key), provider, Vec::new());
        r.expires = Some(now + TTL);
        r
    }

    #[test]
    fn a_flood_of_keys_from_one_member_stops_at_its_quota_and_own_records_still_fit() {
        let (me, liar, honest) = (PeerId::random(), PeerId::random(), PeerId::random());
        let mut store = BoundedStore::new(me, 1024, 256);
        let now = Instant::now();
        let mut kept = 0;
        for i in 0..(OWN_KEYS + REMOTE_KEYS) {
            kept += store
                .add_provider(record(&format!("junk/{i}"), liar, now))
                .is_ok() as usize;
        }
        assert_eq!(
            kept, PER_PEER_KEYS,
            "one member keeps no more than its quota"
        );
        // A record the flooder already has is renewed, not refused.
        assert!(store.add_provider(record("junk/0", liar, now)).is_ok());
        assert!(
            store
                .add_provider(record("blob/honest", honest, now))
                .is_ok()
        );
        for i in 0..OWN_KEYS {
            store
                .add_provider(record(&format!("blob/{i}"), me, now))
                .unwrap_or_else(|e| panic!("own record {i} refused: {e:?}"));
        }
        assert_eq!(store.provided().len(), OWN_KEYS);
        assert!(store.add_provider(record("one/more", me, now)).is_err());
        assert_eq!(store.size().0, OWN_KEYS + PER_PEER_KEYS + 1);
    }

    #[test]
    fn expired_records_are_purged_without_being_read() {
        let (me, other) = (PeerId::random(), PeerId::random());
        let mut store = BoundedStore::new(me, 1024, 256);
        let now = Instant::now();
        for i in 0..100 {
            store
                .add_provider(record(&format!("k/{i}"), other, now))
                .unwrap();
        }
        let mut node = Record::new(RecordKey::new(&"node"), b"{}".to_vec());
        node.expires = Some(now + TTL);
        store.put(node).unwrap();
        store.add_provider(record("mine", me, now)).unwrap();
        assert_eq!(store.purge(now + TTL / 2), 0);
        assert_eq!(store.size(), (101, 1));
        assert_eq!(store.purge(now + TTL), 101);
        // Only this node's own record is left (Kademlia republishes it).
        assert_eq!(store.size(), (1, 0));
        assert!(store.providers(&RecordKey::new(&"k/0")).is_empty());
        // The member's quota is free again.
        assert!(
            store
                .add_provider(record("k/new", other, now + TTL))
                .is_ok()
        );
    }

    /// A month of churn in minutes of fake time: 20 members, each
    /// providing 50 new blobs an hour (a busy cluster's image turnover)
    /// and republishing each for 2 h before it leaves their store, the
    /// store purged every minute. Prints the figures (`--nocapture`).
    #[test]
    fn a_month_of_provider_churn_keeps_the_store_bounded() {
        let me = PeerId::random();
        let members: Vec<PeerId> = (0..20).map(|_| PeerId::random()).collect();
        let mut store = BoundedStore::new(me, 1024, 256);
        let start = Instant::now();
        let (mut largest, mut refused, mut added) = (0, 0, 0u64);
        let minutes = 30 * 24 * 60;
        for minute in 0..minutes {
            let now = start + Duration::from_secs(minute * 60);
            // Every 10 minutes each member republishes the blobs it holds
            // (those of the last 2 hours) and adds 50/6 new ones.
            if minute % 10 == 0 {
                let hour_blobs = |h: u64| h * 50..h * 50 + 50;
                let hour = minute / 60;
                for (m, peer) in members.iter().enumerate() {
                    for h in hour.saturating_sub(1)..=hour {
                        for b in hour_blobs(h) {
                            let key = format!("blob/{m}/{b}");
                            match store.add_provider(record(&key, *peer, now)) {
                                Ok(()) => added += 1,
                                Err(_) => refused += 1,
                            }
                        }
                    }
                }
            }
            store.purge(now);
            largest = largest.max(store.size().0);
        }
        let end = store.size().0;
        println!(
            "month of churn: {added} provider records added, {refused} refused, largest store {largest} keys, {end} at the end"
        );
        assert_eq!(refused, 0);
        // 20 members × 100 blobs held, plus those not yet expired (30 min).
        assert!(largest <= 20 * 150, "{largest}");
        assert!(end <= 20 * 150, "{end}");
    }
}
