//! The announcer: what this node tells the tracker. Periodic announces of
//! what the store holds and the pulls want, within the tracker's limits
//! (most useful blobs first), each answer handed to the pulls it concerns;
//! the chunk hashes a registry run publishes, bad-chunk and digest-failure
//! reports, and the leave at shutdown. Without a tracker answering, the
//! blobs the node provides through the DHT follow its store and pulls.

use super::{MAX_ANNOUNCE_BYTES, MAX_ANNOUNCE_CHUNKS, Swarm, Update, lock};
use crate::discovery::advertise::{self};
use crate::discovery::dht::Dht;
use crate::error::Result;
use crate::pull::fetch::{PeerAddr, Transfer};
use crate::store::{Blob, Holding};
use dray_protocol::defaults::announce_spread;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::preheat;
use dray_protocol::{Bitfield, BlobDigest, ChunkMap};
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

impl Swarm {
    /// Announces until the task is dropped: often while pulls run, seldom otherwise.
    pub fn spawn_announcer(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let swarm = self.clone();
        tokio::spawn(async move {
            let provider = async {
                if let Some(dht) = &swarm.dht {
                    loop {
                        swarm.provide_through(dht).await;
                        tokio::time::sleep(PROVIDE_CHECK_EVERY).await;
                    }
                }
            };
            let announcer = async {
                if swarm.tracker.is_configured() {
                    swarm.announce_forever().await;
                }
            };
            futures_util::future::join(provider, announcer).await;
        })
    }

    /// Makes the blobs this node provides through the DHT those its store
    /// holds and those it pulls, while no tracker answers it (what an
    /// announce tells the tracker; Kademlia republishes them), and none
    /// while one does: a blob that left the store (evicted, removed) or a
    /// pull given up is withdrawn within [`PROVIDE_CHECK_EVERY`].
    async fn provide_through(&self, dht: &Dht) {
        let tracker_answers = self.tracker.is_configured() && !self.tracker.all_down();
        let mut wanted = HashSet::new();
        if !tracker_answers {
            wanted.extend(self.node.store().holdings().into_iter().map(|h| h.digest));
            wanted.extend(lock(&self.wanted).keys().copied());
        }
        dht.provide_only(&wanted).await;
    }

    /// Announces to the tracker until the task is dropped.
    async fn announce_forever(self: &Arc<Self>) {
        loop {
            self.announce_once().await;
            self.node
                .metrics()
                .tracker_reachable(self.tracker_reachable().unwrap_or(false));
            let busy = !lock(&self.wanted).is_empty();
            let wait = if busy {
                self.config.pull_announce
            } else {
                self.config.idle_announce
            };
            let wait = announce_spread(wait, fastrand::f64());
            let _ = tokio::time::timeout(wait, self.poke.notified()).await;
        }
    }

    /// Tells every replica this agent announced to that it is stopping, so
    /// that it is forgotten at once (not after missing its announces): nobody
    /// is handed a peer that is going away, and its registry runs go to other
    /// nodes. Stop the announcer first, or its next announce rejoins.
    pub async fn leave(&self) {
        let replicas: Vec<String> = lock(&self.sent).keys().cloned().collect();
        let leave = pb::Leave {
            peer_id: self.node.peer_id().to_string(),
        };
        let sent = replicas.iter().map(|replica| {
            let body = Body::Leave(leave.clone());
            async move { (replica, self.tracker.send(replica, body).await) }
        });
        for (replica, answer) in futures_util::future::join_all(sent).await {
            match answer {
                Ok(_) => tracing::info!(%replica, "left the tracker"),
                Err(e) => {
                    tracing::warn!(%replica, error = %e, "could not tell the tracker this node leaves")
                }
            }
        }
    }

    /// An announce of `blobs` from this node.
    fn announce_of(&self, blobs: Vec<pb::BlobHolding>, full: bool) -> Result<pb::Announce> {
        let address = advertise::announced(&self.config.advertise, self.node.local_addr()?);
        Ok(pb::Announce {
            peer_id: self.node.peer_id().to_string(),
            address,
            upload_bytes_per_s: self.node.config.upload_bytes_per_s.unwrap_or(0),
            active_uploads: self.node.active_uploads(),
            labels: self.config.labels.clone().into_iter().collect(),
            blobs,
            full,
            preheats: Vec::new(),
        })
    }

    /// Reports that the blob of `map`, assembled here from chunks verified
    /// against it, failed its digest. The tracker believes that only from a
    /// node that held every chunk, and the store forgets the chunks of a
    /// failed blob before the announcer could say so: the report follows an
    /// announce of them all.
    pub(super) async fn report_digest_failure(&self, map: &ChunkMap, origin: &str) {
        let mut all = Bitfield::new(map.chunk_count());
        for i in 0..map.chunk_count() {
            all.set(i);
        }
        let held = pb::BlobHolding {
            digest: map.digest().to_string(),
            size: map.size(),
            chunk_size: map.chunk_size(),
            bits: all.as_bytes().to_vec().into(),
            wanted: true,
            origin: origin.to_owned(),
            ..Default::default()
        };
        let assembled = match self.announce_of(vec![held], false) {
            Ok(a) => a,
            Err(e) => return tracing::error!(error = %e, "no address to advertise"),
        };
        if let Err(e) = self
            .tracker
            .send_for(&map.digest(), Body::Announce(assembled))
            .await
        {
            tracing::warn!(error = %e, "could not tell the tracker this node assembled the blob");
        }
        let failed = Body::DigestFailed(pb::BlobDigestFailed {
            reporter: self.node.peer_id().to_string(),
            digest: map.digest().to_string(),
        });
        if let Err(e) = self.tracker.send_for(&map.digest(), failed).await {
            tracing::warn!(error = %e, "could not report the failed digest");
        }
    }

    /// One round of announces: every blob held or wanted, to its owner
    /// replica; and, from an agent that runs preheat jobs (`dray agent`),
    /// its preheat progress to the replica that coordinates them (see
    /// [`dray_protocol::preheat`]), even when it holds none of that
    /// replica's blobs: the coordinator must know every such node to
    /// choose some.
    async fn announce_once(&self) {
        let (wanted, whole): (HashMap<BlobDigest, String>, HashSet<BlobDigest>) = {
            let wants = lock(&self.wanted);
            let whole = wants
                .iter()
                .filter(|(_, w)| w.registry.ignores_ranges())
                .map(|(d, _)| *d)
                .collect();
            (
                wants
                    .iter()
                    .map(|(d, w)| (*d, w.registry.base().to_owned()))
                    .collect(),
                whole,
            )
        };
        let store = self.node.store();
        let mut groups: HashMap<String, Vec<Holding>> = HashMap::new();
        for h in store.holdings() {
            if let Some(owner) = self.tracker.owner(&h.digest) {
                groups.entry(owner).or_default().push(h);
            }
        }
        let coordinator = self
            .preheats
            .runs_jobs()
            .then(|| self.tracker.owner(&preheat::coordinator_key()))
            .flatten();
        if let Some(c) = &coordinator {
            groups.entry(c.clone()).or_default();
        }
        for (replica, all) in groups {
            let held_here = all.len();
            let picked = pick(
                all,
                &wanted,
                self.config.max_announce_blobs,
                MAX_ANNOUNCE_CHUNKS,
                MAX_ANNOUNCE_BYTES,
            );
            let before = lock(&self.left_out).insert(replica.clone(), picked.left_out);
            if picked.left_out > 0 && before != Some(picked.left_out) {
                tracing::warn!(
                    %replica,
                    announced = picked.blobs.len(),
                    held = held_here,
                    left_out = picked.left_out,
                    left_out_complete = picked.left_out_complete,
                    "this node holds more blobs than one announce may list (swarm.max_announce_blobs = {}, {MAX_ANNOUNCE_CHUNKS} chunks, {MAX_ANNOUNCE_BYTES} bytes): the tracker is not told of {} of them (blobs being pulled and partial ones go first, then the most recently used complete ones)",
                    self.config.max_announce_blobs,
                    picked.left_out,
                );
            } else if picked.left_out == 0 && before.is_some_and(|n| n > 0) {
                tracing::info!(%replica, announced = held_here, "every blob this node holds fits in its announces again");
            }
            let blobs = picked.blobs;
            let previous = lock(&self.sent).get(&replica).cloned();
            let full = previous
                .as_ref()
                .is_none_or(|p| p.keys().any(|d| !blobs.iter().any(|b| b.digest == *d)));
            let mut now_sent = HashMap::new();
            let holdings = blobs
                .iter()
                .map(|b| {
                    let mut holding = full_holding(b, wanted.get(&b.digest));
                    holding.ranges_ignored = whole.contains(&b.digest);
                    let before = previous.as_ref().and_then(|p| p.get(&b.digest));
                    let grew_from =
                        before.filter(|prev| !full && prev.ones().all(|i| b.held.get(i)));
                    if let Some(prev) = grew_from {
                        holding.bits = Vec::new().into();
                        holding.added = b.held.ones().filter(|&i| !prev.get(i)).collect();
                    }
                    now_sent.insert(b.digest, b.held.clone());
                    holding
                })
                .collect();
            let mut announce = match self.announce_of(holdings, full) {
                Ok(a) => a,
                Err(e) => return tracing::error!(error = %e, "no address to advertise"),
            };
            if coordinator.as_ref() == Some(&replica) {
                announce.preheats = self.preheats.reports();
            }
            tracing::debug!(%replica, full, blobs = announce.blobs.len(), "announcing");
            let answer = self.tracker.send(&replica, Body::Announce(announce)).await;
            let mine: Vec<BlobDigest> = blobs
                .iter()
                .map(|b| b.digest)
                .filter(|d| wanted.contains_key(d))
                .collect();
            match answer {
                Ok(Some(mut resp)) => {
                    self.node
                        .store()
                        .gc()
                        .note_holders(resp.holders.iter().filter_map(|h| {
                            let holders = crate::store::gc::Holders {
                                complete: h.complete,
                                rank: h.rank,
                            };
                            Some((h.digest.parse().ok()?, holders))
                        }));
                    tracing::debug!(%replica, peers = resp.peers.len(), runs = resp.assignments.len(), maps = resp.chunk_maps.len(), resend_full = resp.resend_full, "tracker answered");
                    self.preheats.offer(std::mem::take(&mut resp.preheat));
                    if resp.resend_full {
                        lock(&self.sent).remove(&replica);
                        self.poke.notify_one();
                    } else {
                        lock(&self.sent).insert(replica.clone(), now_sent);
                        // A replica that needed a full announce has lost its maps
                        // (restart), and one that hears of a blob from us for the
                        // first time may have just taken it over from a dead
                        // replica: give it the hashes we can vouch for (the
                        // whole map of a blob whose digest we verified, else
                        // those of the chunks we hold). Without them, chunks
                        // that only partial holders have could never again be
                        // verified by anyone else, and their pulls would stall.
                        let new_here = |b: &&Holding| {
                            full || previous.as_ref().is_none_or(|p| !p.contains_key(&b.digest))
                        };
                        for b in blobs.iter().filter(new_here) {
                            let vouched = match store.vouched_map(&b.digest) {
                                Ok(Some(m)) => m,
                                Ok(None) => continue,
                                Err(e) => {
                                    tracing::error!(digest = %b.digest, error = %e, "could not read the chunk map to republish");
                                    continue;
                                }
                            };
                            if !vouched.hashes().iter().any(Option::is_some) {
                                continue;
                            }
                            let body = Body::Publish(pb::PublishChunkMap {
                                peer_id: self.node.peer_id().to_string(),
                                map: Some(vouched.to_pb()),
                            });
                            if let Err(e) = self.tracker.send(&replica, body).await {
                                tracing::warn!(error = %e, "could not republish a chunk map");
                            }
                        }
                    }
                    self.deliver(&mine, &resp);
                }
                Ok(None) => tracing::warn!(%replica, "tracker sent no answer to an announce"),
                Err(e) => {
                    tracing::warn!(error = %e, "announce failed");
                    lock(&self.sent).remove(&replica);
                    for d in &mine {
                        if let Some(w) = lock(&self.wanted).get(d) {
                            w.updates.send_modify(|u| u.tracker_ok = false);
                        }
                    }
                }
            }
        }
    }

    fn deliver(&self, digests: &[BlobDigest], resp: &pb::AnnounceResponse) {
        let me = self.node.peer_id();
        let Ok(local) = self.node.local_addr() else {
            return;
        };
        for d in digests {
            let key = d.to_string();
            let peers = resp
                .peers
                .get(&key)
                .map(|l| {
                    l.peers
                        .iter()
                        .filter(|p| p.peer_id != me)
                        .filter_map(|p| {
                            Some(PeerAddr {
                                peer_id: p.peer_id.clone(),
                                addr: advertise::reachable(&p.address, local)?,
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            let runs = resp
                .assignments
                .iter()
                .filter(|a| a.digest == key)
                .map(|a| (a.first, a.count))
                .collect();
            let map = resp
                .chunk_maps
                .iter()
                .filter(|m| m.digest == key)
                .find_map(|m| {
                    ChunkMap::from_pb(m)
                        .map_err(|e| tracing::warn!(error = %e, "tracker sent a bad chunk map"))
                        .ok()
                });
            let update = Update {
                tracker_ok: true,
                fetching: resp.fetching.contains(&key),
                peers,
                runs,
                runs_complete: true,
                map,
            };
            if let Some(w) = lock(&self.wanted).get(d) {
                w.updates.send_replace(update);
            }
        }
    }

    pub(super) async fn publish(&self, blob: &Blob) {
        if !self.tracker.is_configured() {
            return;
        }
        let map = blob.map();
        let body = Body::Publish(pb::PublishChunkMap {
            peer_id: self.node.peer_id().to_string(),
            map: Some(map.to_pb()),
        });
        if let Err(e) = self.tracker.send_for(&map.digest(), body).await {
            tracing::warn!(error = %e, "could not publish chunk hashes");
        }
    }

    /// Publishes the hash of one chunk this agent read from the registry.
    pub(super) async fn publish_chunk(&self, index: u32, blob: &Blob) {
        if !self.tracker.is_configured() {
            return;
        }
        let one = match blob.map_of([index]) {
            Ok(m) => m,
            Err(e) => return tracing::error!(error = %e, "bad geometry"),
        };
        if one.hashes().iter().any(Option::is_some) {
            let body = Body::Publish(pb::PublishChunkMap {
                peer_id: self.node.peer_id().to_string(),
                map: Some(one.to_pb()),
            });
            if let Err(e) = self.tracker.send_for(&blob.digest(), body).await {
                tracing::warn!(error = %e, "could not publish a chunk hash");
            }
        }
    }

    /// Reports, each in its own task (a hung tracker never holds a pull),
    /// the peers `transfer` found sending a chunk that failed its hash or
    /// leaving a request unanswered (or too slow for its deadline) since
    /// the last call. Until the tracker
    /// hears it, it counts such a peer as holding what it announced and
    /// hands nobody a registry run of it, so every pull it lies to or
    /// ignores starves for those chunks and fetches them from the registry
    /// on its own (the chaos sweep's `liars` and `withholders` found it).
    /// A report that does not reach the tracker goes back to the
    /// transfer, due again at the next announce.
    pub(super) fn spawn_reports(self: &Arc<Self>, digest: &BlobDigest, transfer: &Arc<Transfer>) {
        for (peer, index) in transfer.take_bad_chunks() {
            let (swarm, digest, transfer) = (self.clone(), *digest, transfer.clone());
            let task = async move {
                if !swarm.report_bad_chunk(&digest, &peer, index).await {
                    transfer.bad_chunk_unsent(peer, index);
                }
            };
            tokio::spawn(task.in_current_span());
        }
        for (peer, index) in transfer.take_silent_peers() {
            let (swarm, digest, transfer) = (self.clone(), *digest, transfer.clone());
            let task = async move {
                if !swarm.report_silent(&digest, &peer, index).await {
                    transfer.silent_report_unsent(&peer);
                }
            };
            tokio::spawn(task.in_current_span());
        }
    }

    /// Whether the report reached the tracker.
    async fn report_bad_chunk(&self, digest: &BlobDigest, offender: &str, index: u32) -> bool {
        let body = Body::BadChunk(pb::BadChunkReport {
            reporter: self.node.peer_id().to_string(),
            offender: offender.to_string(),
            digest: digest.to_string(),
            index,
        });
        self.report(digest, body, "a bad chunk").await
    }

    /// Whether the report reached the tracker.
    async fn report_silent(&self, digest: &BlobDigest, offender: &str, index: u32) -> bool {
        let body = Body::SilentPeer(pb::SilentPeerReport {
            reporter: self.node.peer_id().to_string(),
            offender: offender.to_string(),
            digest: digest.to_string(),
            index,
        });
        self.report(digest, body, "a silent peer").await
    }

    /// Sends a report about `what` to the replica of `digest`; whether it
    /// reached it.
    async fn report(&self, digest: &BlobDigest, body: Body, what: &str) -> bool {
        match self.tracker.send_for(digest, body).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "could not report {what}");
                false
            }
        }
    }
}

/// One blob as an announce lists it, with all its bits: the most it can
/// weigh in the request.
fn full_holding(h: &Holding, origin: Option<&String>) -> pb::BlobHolding {
    pb::BlobHolding {
        digest: h.digest.to_string(),
        size: h.size,
        chunk_size: h.chunk_size,
        bits: h.held.as_bytes().to_vec().into(),
        added: Vec::new(),
        complete: h.complete,
        wanted: origin.is_some(),
        origin: origin.cloned().unwrap_or_default(),
        ranges_ignored: false,
    }
}

/// What an announce to one replica lists, and what it leaves out.
struct Picked {
    blobs: Vec<Holding>,
    left_out: usize,
    left_out_complete: usize,
}

/// Picks the blobs one announce lists within the limits, most useful to the
/// cluster first: blobs being pulled, then partial ones, then complete
/// ones, most recently used first.
fn pick(
    mut all: Vec<Holding>,
    wanted: &HashMap<BlobDigest, String>,
    max_blobs: usize,
    max_chunks: u64,
    max_bytes: usize,
) -> Picked {
    all.sort_by_cached_key(|h| {
        let rank = if wanted.contains_key(&h.digest) {
            0
        } else if !h.complete {
            1
        } else {
            2
        };
        (rank, std::cmp::Reverse(h.last_used), h.digest)
    });
    let (mut chunks, mut bytes) = (0u64, 0usize);
    let mut picked = Picked {
        blobs: Vec::new(),
        left_out: 0,
        left_out_complete: 0,
    };
    for h in all {
        let weight = full_holding(&h, wanted.get(&h.digest)).encoded_len();
        // Field tag and length prefix.
        let weight = 1 + prost::length_delimiter_len(weight) + weight;
        let n = u64::from(h.held.len());
        if picked.blobs.len() < max_blobs && chunks + n <= max_chunks && bytes + weight <= max_bytes
        {
            (chunks, bytes) = (chunks + n, bytes + weight);
            picked.blobs.push(h);
        } else {
            picked.left_out += 1;
            picked.left_out_complete += usize::from(h.complete);
        }
    }
    picked
}

/// How often the blobs a node provides through the DHT are checked against
/// its store, its pulls and the tracker's health ([`Swarm::provide_through`]).
const PROVIDE_CHECK_EVERY: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use dray_protocol::DEFAULT_CHUNK_SIZE;
    use std::time::SystemTime;

    fn holding(n: u8, chunks: u32, complete: bool, age_s: u64) -> Holding {
        let held = if complete {
            Bitfield::full(chunks)
        } else {
            Bitfield::new(chunks)
        };
        Holding {
            digest: BlobDigest::of(&[n]),
            size: u64::from(chunks) * u64::from(DEFAULT_CHUNK_SIZE),
            chunk_size: DEFAULT_CHUNK_SIZE,
            held,
            complete,
            last_used: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 - age_s),
        }
    }

    #[test]
    fn an_announce_past_the_limits_keeps_pulls_partials_and_recent_blobs() {
        let wanted: HashMap<BlobDigest, String> =
            [(BlobDigest::of(&[1]), "https://registry".to_string())].into();
        let all = vec![
            holding(0, 1, true, 10),  // complete, recent
            holding(1, 1, false, 99), // being pulled
            holding(2, 1, true, 50),  // complete, old
            holding(3, 1, true, 5),   // complete, most recent
            holding(4, 1, false, 90), // partial
        ];
        let names = |p: &Picked| {
            p.blobs
                .iter()
                .map(|h| (0..5).find(|&n| h.digest == BlobDigest::of(&[n])).unwrap())
                .collect::<Vec<u8>>()
        };
        let p = pick(all.clone(), &wanted, 4, 1 << 20, 1 << 20);
        assert_eq!(names(&p), vec![1, 4, 3, 0]);
        assert_eq!((p.left_out, p.left_out_complete), (1, 1));
        // The chunk cap: a blob that does not fit is skipped, smaller ones still go.
        let mut big = all.clone();
        big.push(holding(9, 1000, false, 0));
        let p = pick(big, &wanted, 100, 10, 1 << 20);
        assert_eq!(p.blobs.len(), 5);
        assert_eq!(p.left_out, 1);
        // The byte cap: one blob's holding weighs over 70 bytes (its digest).
        let p = pick(all, &wanted, 100, 1 << 20, 200);
        assert_eq!(names(&p), vec![1, 4]);
        assert_eq!(p.left_out_complete, 3);
    }
}
