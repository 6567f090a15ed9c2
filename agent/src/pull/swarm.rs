//! The swarm: pulling a blob with the tracker's help, and announcing what this
//! agent holds.
//!
//! A pull asks the registry for the blob's size only, then announces that it
//! wants the blob. The tracker answers with peers and with registry-fetch
//! assignments (runs of chunks nobody holds). The agent fetches its runs with
//! HTTP range requests, publishes their chunk hashes, and takes everything else
//! from peers, verifying each chunk against the published hashes.
//!
//! Never worse than a direct pull: if no chunk arrives for a while, the agent
//! keeps the peers it has and fetches every unclaimed chunk from the registry
//! itself. Sooner, if the tracker answers but reports no registry fetch of
//! the blob while nothing arrives, it fetches the chunks no live peer can
//! give it. What a pull does with the registry (which runs it starts and
//! stops, when and how it falls back) is decided by its
//! [`dray_protocol::pull::PullMachine`], which the simulator's nodes run too;
//! `drive` carries its actions out. While the tracker is silent it fetches only the chunks no known
//! peer can give it, and stops (dropping those fetches) once the tracker
//! answers again: in a large storm every node falls back at once, and
//! fetching everything would turn the outage into a registry stampede that
//! outlasts it. Fetched chunks' hashes are published (without holding up the
//! fetch), and a node republishes the hashes of every chunk it holds when a
//! tracker asks for a full announce, so a restarted tracker can again vouch
//! for chunks only partial holders have. If the assembled blob fails its
//! digest (a published hash was wrong), the agent reports it and keeps its
//! chunks while the tracker rechecks them against the registry; a chunk
//! whose hash the recheck replaces is fetched again. A second failure in one
//! pull sends the node to the registry alone.
//!
//! An announce lists what the store holds, from its records (closed blobs
//! included), within the tracker's limits: at most `max_announce_blobs`
//! blobs, [`MAX_ANNOUNCE_CHUNKS`] chunks and a request body of
//! [`MAX_ANNOUNCE_BYTES`]. A node holding more announces the most useful
//! first (blobs it is pulling, then partial ones, then complete ones, most
//! recently used first) and logs what it left out. Recency, not the
//! cluster's copy counts, orders the complete ones: the tracker counts only
//! the blobs it is told of, so ranking by its counts made the announced set
//! swap at every answer (three full announces at start instead of one, 600
//! blobs over a limit of 512).

use crate::discovery::advertise::{self, Advertised};
use crate::discovery::dht::{Dht, DhtConfig, NodeRecord};
use crate::discovery::preheat::Preheats;
use crate::discovery::tracker_client::TrackerClient;
use crate::error::{Error, Result};
use crate::peer::PeerNode;
use crate::pull::events::{EventKind, Events};
use crate::pull::fetch::{PeerAddr, Transfer};
use crate::pull::registry::RegistryClient;
use crate::serving::metrics::{FallbackReason, Source};
use crate::store::{Blob, Holding, PutOutcome};
use dray_protocol::defaults::{DEFAULTS, announce_spread};
use dray_protocol::dht::{
    FETCHERS, counted_fetchers, dht_runs, lookup_after, overflow_list, pick_peers,
};
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::preheat;
use dray_protocol::pull::{Action, Arbiter, Fallback, News, PullConfig, PullMachine, RunId};
use dray_protocol::scheduler::SchedulerConfig;
use dray_protocol::settings::duration;
use dray_protocol::{Bitfield, BlobDigest, ChunkMap, DEFAULT_CHUNK_SIZE, VerifyError};
use prost::Message;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Swarm settings; every key optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwarmConfig {
    /// Tracker replica base URLs. None: every pull goes to the registry alone.
    pub trackers: Vec<String>,
    /// Addresses peers should dial (one of each family on a dual-stack
    /// node; a bare IP takes the endpoint's port); defaults to the peer
    /// endpoint's address. See [`crate::discovery::advertise`].
    #[serde(with = "crate::discovery::advertise::serde_list")]
    pub advertise: Vec<Advertised>,
    /// Topology labels (zone, rack) sent with announces.
    pub labels: BTreeMap<String, String>,
    /// Announce period while a pull is running (`pull_announce_ms` before).
    #[serde(with = "duration", alias = "pull_announce_ms")]
    pub pull_announce: Duration,
    /// Announce period otherwise (the tracker's interval caps it).
    #[serde(with = "duration", alias = "idle_announce_ms")]
    pub idle_announce: Duration,
    /// Tracker silent this long during a pull: carry on with known peers and the registry.
    #[serde(with = "duration", alias = "tracker_grace_ms")]
    pub tracker_grace: Duration,
    /// Nothing arrived and nothing was in flight for this long, and the
    /// tracker reported no registry fetch of the blob under way (or nothing
    /// arrived for `fetching_patience` (in [`DEFAULTS`]) times this long, whatever it
    /// reported): fetch unclaimed chunks from the registry.
    #[serde(with = "duration", alias = "stall_ms")]
    pub stall: Duration,
    /// Registry runs in flight at once when falling back to the registry.
    pub registry_parallel: usize,
    /// Chunks per registry run when falling back.
    pub run_chunks: u32,
    pub chunk_size: u32,
    /// Blobs one announce lists at most: the tracker's `max_blobs_per_node`
    /// (it refuses an announce listing more); past it the least useful are
    /// left out.
    pub max_announce_blobs: usize,
    /// The Kademlia DHT, used when no tracker is configured and while every
    /// replica is down (see [`crate::discovery::dht`]); off unless `dht.listen` is set.
    pub dht: DhtConfig,
}

/// Chunks one announce lists at most, over all its blobs: the tracker's
/// default `max_chunks_per_peer` (past it, it refuses the blobs that pass).
pub const MAX_ANNOUNCE_CHUNKS: u64 = 1 << 20;

/// Bytes of blob holdings one announce carries at most: the tracker's
/// request body limit less room for the rest of the request (peer id,
/// address, 16 labels).
pub const MAX_ANNOUNCE_BYTES: usize = dray_protocol::framing::MAX_TRACKER_FRAME - (64 << 10);

impl Default for SwarmConfig {
    fn default() -> Self {
        Self {
            trackers: Vec::new(),
            advertise: Vec::new(),
            labels: BTreeMap::new(),
            pull_announce: Duration::from_millis(DEFAULTS.pull_announce_ms),
            idle_announce: Duration::from_millis(DEFAULTS.idle_announce_ms),
            tracker_grace: Duration::from_millis(DEFAULTS.tracker_grace_ms),
            stall: Duration::from_millis(DEFAULTS.stall_ms),
            registry_parallel: DEFAULTS.registry_parallel,
            run_chunks: DEFAULTS.run_chunks,
            chunk_size: DEFAULT_CHUNK_SIZE,
            max_announce_blobs: SchedulerConfig::default().max_blobs_per_peer,
            dht: DhtConfig::default(),
        }
    }
}

/// What a pull did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PullReport {
    pub digest: String,
    pub size: u64,
    pub seconds: f64,
    pub chunks_from_registry: u32,
    pub bytes_from_registry: u64,
    pub chunks_from_peers: u32,
    pub bytes_from_peers: u64,
    pub resumed_chunks: u32,
    /// Peers that sent chunks failing their hash.
    pub bad_peers: Vec<String>,
    /// Peers dropped for missing a chunk's deadline (see `fetch`).
    pub slow_peers: Vec<String>,
    /// Times the assembled blob failed its digest and was pulled again.
    pub map_failures: u32,
    /// Bytes held here as verified that turned out wrong and were thrown
    /// away: chunks a recheck replaced (counted at the chunk size), and the
    /// whole blob when it failed its digest twice and was pulled alone.
    /// Such bytes may have been served to peers, which check the digest too.
    pub discarded_bytes: u64,
    /// The pull fell back to fetching unclaimed chunks from the registry itself.
    pub fell_back: bool,
    /// Peers whose chunk hashes the registry's bytes contradicted (a pull
    /// on peers' word for hashes), dropped from the pull.
    pub liars: Vec<String>,
    /// Chunks fetched from the registry to settle whose word was true.
    pub checks: u32,
}

/// The tracker's latest word on one wanted blob.
#[derive(Clone, Debug, Default)]
struct Update {
    tracker_ok: bool,
    /// The tracker sees registry runs of the blob live: the swarm waits on
    /// the registry, so a long wait is not a stall.
    fetching: bool,
    peers: Vec<PeerAddr>,
    runs: Vec<(u32, u32)>,
    /// `runs` lists every live run of this node for the blob (a tracker's
    /// answer does; the DHT coordinator hands out only the next few), so a
    /// run of ours missing from it was taken back.
    runs_complete: bool,
    map: Option<ChunkMap>,
}

/// A blob being pulled.
struct Want {
    /// The tracker's news for the pull.
    updates: watch::Sender<Update>,
    /// The registry it comes from (base URL), named in announces so that
    /// the tracker budgets registry fetches per registry.
    origin: String,
    /// The repository, the pull's start and its current attempt, for `dray status`.
    repo: String,
    started: Instant,
    transfer: Arc<Transfer>,
}

/// A pull in progress, as `dray status` shows it.
pub struct Pulling {
    pub digest: BlobDigest,
    pub repo: String,
    /// The registry's base URL.
    pub origin: String,
    pub started: Instant,
    /// The pull's current attempt (a wrong chunk map starts another).
    pub transfer: Arc<Transfer>,
}

/// An agent's membership in the swarm.
pub struct Swarm {
    node: Arc<PeerNode>,
    tracker: TrackerClient,
    config: SwarmConfig,
    wanted: Mutex<HashMap<BlobDigest, Want>>,
    /// What each replica was last told, per blob (for delta announces).
    sent: Mutex<HashMap<String, HashMap<BlobDigest, Bitfield>>>,
    /// How many blobs the last announce to each replica left out.
    left_out: Mutex<HashMap<String, usize>>,
    poke: Notify,
    /// The preheat jobs this node was handed.
    preheats: Preheats,
    /// The DHT, if this node joined one.
    dht: Option<Arc<Dht>>,
    /// Recent fallbacks, bans and drops (`dray status`).
    events: Events,
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Swarm {
    pub fn new(node: Arc<PeerNode>, config: SwarmConfig, dht: Option<Arc<Dht>>) -> Arc<Self> {
        Arc::new(Self {
            tracker: TrackerClient::new(config.trackers.clone(), node.identity()),
            node,
            config,
            wanted: Mutex::new(HashMap::new()),
            sent: Mutex::new(HashMap::new()),
            left_out: Mutex::new(HashMap::new()),
            poke: Notify::new(),
            preheats: Preheats::default(),
            dht,
            events: Events::default(),
        })
    }

    pub fn config(&self) -> &SwarmConfig {
        &self.config
    }

    pub fn node(&self) -> &Arc<PeerNode> {
        &self.node
    }

    /// The DHT this node joined, if any.
    pub fn dht(&self) -> Option<&Arc<Dht>> {
        self.dht.as_ref()
    }

    /// Recent fallbacks, bans and drops of this node's pulls.
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// The pulls in progress.
    pub fn pulling(&self) -> Vec<Pulling> {
        lock(&self.wanted)
            .iter()
            .map(|(digest, w)| Pulling {
                digest: *digest,
                repo: w.repo.clone(),
                origin: w.origin.clone(),
                started: w.started,
                transfer: w.transfer.clone(),
            })
            .collect()
    }

    /// Whether a tracker replica answers this node now (none failing its
    /// last request or hanging); `None` with no tracker configured.
    pub fn tracker_reachable(&self) -> Option<bool> {
        self.tracker
            .is_configured()
            .then(|| !self.tracker.all_down())
    }

    /// The preheat jobs this node was handed, and where new ones go.
    pub fn preheats(&self) -> &Preheats {
        &self.preheats
    }

    /// Announces now rather than at the next period (a preheat job ended).
    pub fn announce_soon(&self) {
        self.poke.notify_one();
    }

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
    async fn report_digest_failure(&self, map: &ChunkMap, origin: &str) {
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

    /// Drops `digest`'s file and record, to pull it anew.
    async fn forget(&self, digest: BlobDigest) -> Result<()> {
        let store = self.node.store().clone();
        tokio::task::spawn_blocking(move || store.remove(&digest)).await?
    }

    /// One round of announces: every blob held or wanted, to its owner
    /// replica; and, from an agent that runs preheat jobs (`dray agent`),
    /// its preheat progress to the replica that coordinates them (see
    /// [`dray_protocol::preheat`]), even when it holds none of that
    /// replica's blobs: the coordinator must know every such node to
    /// choose some.
    async fn announce_once(&self) {
        let wanted: HashMap<BlobDigest, String> = lock(&self.wanted)
            .iter()
            .map(|(d, w)| (*d, w.origin.clone()))
            .collect();
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

    /// Pulls a blob into the store, asking the registry its size first;
    /// returns when it is complete and verified.
    pub async fn pull(
        self: &Arc<Self>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        digest: BlobDigest,
    ) -> Result<PullReport> {
        let size = registry.blob_size(repo, &digest).await?;
        self.pull_sized(registry, repo, digest, size).await
    }

    /// Pulls a blob of `size` bytes (from a verified manifest, or the
    /// registry's answer to the caller's own access check: a wrong size
    /// fails the digest) into the store; returns when it is complete and
    /// verified. Its lines, and its tasks' (peer lanes, registry runs), are
    /// logged in a `pull` span naming the blob.
    #[tracing::instrument(name = "pull", skip_all, fields(%digest))]
    pub async fn pull_sized(
        self: &Arc<Self>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        digest: BlobDigest,
        size: u64,
    ) -> Result<PullReport> {
        let started = Instant::now();
        let timer = self.node.metrics().pull_started();
        let mut report = PullReport {
            digest: digest.to_string(),
            size,
            ..Default::default()
        };
        let dht = self.dht.clone();
        let mut alone = !self.tracker.is_configured() && dht.is_none();
        // Without a tracker to recheck a wrong map against the registry,
        // the first one sends the pull to the registry alone.
        let failures_before_alone = if dht.is_some() && !self.tracker.is_configured() {
            1
        } else {
            MAP_FAILURES_BEFORE_ALONE
        };
        let mut recut = false;
        // Wrong maps this node found itself (not replacements it was told of).
        let mut own_failures = 0;
        // Whose word each hash taken from a peer is, across attempts: a
        // liar ruled in one attempt stays out of the next.
        let mut arbiter = None;
        loop {
            let map = ChunkMap::unhashed(digest, size, self.config.chunk_size)?;
            let transfer = Transfer::start(&self.node, &map, true).await?;
            let chunks = transfer.blob().map().chunk_count();
            transfer.judged_by(
                arbiter
                    .get_or_insert_with(|| Arc::new(Mutex::new(Arbiter::new(chunks))))
                    .clone(),
            );
            let (tx, rx) = watch::channel(Update {
                tracker_ok: true,
                ..Default::default()
            });
            // Without a tracker, or while every replica is down, the DHT's
            // members and the rendezvous rule stand in for its answers.
            let _coordinator = match &dht {
                Some(dht) if !alone => {
                    let task = self
                        .clone()
                        .coordinate(dht.clone(), transfer.clone(), tx.clone());
                    Some(AbortOnDrop(tokio::spawn(task.in_current_span())))
                }
                _ => None,
            };
            let origin = registry.base().to_owned();
            lock(&self.wanted).insert(
                digest,
                Want {
                    updates: tx,
                    origin,
                    repo: repo.to_owned(),
                    started,
                    transfer: transfer.clone(),
                },
            );
            self.poke.notify_one();
            let outcome = self
                .drive(&transfer, rx, registry, repo, alone, &mut report)
                .await;
            // Still wanted while a failure is reported: a node the tracker
            // saw give the blob up could not report it.
            let fetched = transfer.finish().await.inspect_err(|_| {
                lock(&self.wanted).remove(&digest);
            })?;
            report.resumed_chunks = report.resumed_chunks.max(fetched.resumed_chunks);
            report.chunks_from_peers += fetched.chunks_by_peer.values().sum::<u32>();
            report.bytes_from_peers += fetched.bytes_received;
            report.chunks_from_registry += fetched.chunks_from_registry;
            report.bytes_from_registry += fetched.bytes_from_registry;
            for (peer, index) in &fetched.slow_peers {
                let why = format!("chunk {index} past its deadline");
                self.events.record(
                    EventKind::Dropped,
                    digest.to_string(),
                    Some(peer.clone()),
                    why,
                );
            }
            report.slow_peers.extend(fetched.slow_peers.into_keys());
            report.liars.extend(fetched.liars);
            report.checks += fetched.checks;
            for (peer, index) in transfer.take_bad_chunks() {
                self.report_bad_chunk(&digest, &peer, index).await;
            }
            for (peer, index) in &fetched.bad_peers {
                report.bad_peers.push(peer.clone());
                let why = format!("chunk {index} failed its hash");
                self.events
                    .record(EventKind::Ban, digest.to_string(), Some(peer.clone()), why);
            }
            if alone || !matches!(&outcome, Err(e) if is_map_failure(e)) {
                lock(&self.wanted).remove(&digest);
            }
            match outcome {
                Ok(()) => {
                    self.publish(transfer.blob()).await;
                    self.poke.notify_one();
                    report.seconds = started.elapsed().as_secs_f64();
                    timer.completed();
                    return Ok(report);
                }
                // Once: the swarm's geometry is the blob's now.
                Err(Error::Recut { chunk_size, .. }) if !recut => {
                    tracing::info!(%digest, chunk_size, "joining the swarm in its chunk size");
                    recut = true;
                    arbiter = None;
                }
                // Liars were found out: what was held on their word goes,
                // and the next attempt fetches it from others.
                Err(Error::Ruled { chunks, liars, .. }) => {
                    report.discarded_bytes += u64::from(chunks) * u64::from(map.chunk_size());
                    tracing::warn!(%digest, chunks, %liars, "dropped the chunks held on liars' word; fetching them again");
                }
                // A recheck found a wrong chunk held here: the new attempt
                // fetches what was dropped, through the swarm.
                Err(Error::Replaced { chunks, .. }) => {
                    report.map_failures += 1;
                    report.discarded_bytes += u64::from(chunks) * u64::from(map.chunk_size());
                    tracing::warn!(%digest, chunks, "the swarm replaced chunks held here; fetching them again");
                }
                Err(e) if is_map_failure(&e) && !alone => {
                    report.map_failures += 1;
                    own_failures += 1;
                    // A second wrong map of our own in one pull: the swarm
                    // cannot be trusted with this blob now, the registry
                    // alone can.
                    alone = own_failures >= failures_before_alone;
                    // The tracker believes a node once per report window.
                    if own_failures == 1 {
                        self.report_digest_failure(&transfer.blob().map(), registry.base())
                            .await;
                    }
                    if alone {
                        tracing::warn!(error = %e, %digest, "the published chunk map was wrong again; pulling the blob from the registry alone");
                        self.node.metrics().fell_back(FallbackReason::MapFailure);
                        self.events.record(
                            EventKind::Fallback,
                            digest.to_string(),
                            None,
                            format!("map_failure: {e}"),
                        );
                        report.discarded_bytes += transfer.blob().held_bytes();
                        lock(&self.wanted).remove(&digest);
                        self.forget(digest).await?;
                    } else {
                        tracing::warn!(error = %e, %digest, "the published chunk map was wrong; keeping the chunks while the swarm rechecks them against the registry");
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs one attempt of a pull until the blob completes or fails.
    async fn drive(
        self: &Arc<Self>,
        t: &Arc<Transfer>,
        mut rx: watch::Receiver<Update>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        alone: bool,
        report: &mut PullReport,
    ) -> Result<()> {
        let digest = t.blob().digest();
        // The registry runs under way, each ending with its id, and the
        // token that stops each.
        let mut runs = tokio::task::JoinSet::new();
        let mut stops: HashMap<RunId, CancellationToken> = HashMap::new();
        // Chunks fetched from the registry to settle whose word was true.
        let mut checks = tokio::task::JoinSet::new();
        // With no tracker configured (the DHT's mode), no tracker can fall silent.
        let tracker_grace = match self.tracker.is_configured() {
            true => self.config.tracker_grace,
            false => Duration::MAX,
        };
        let mut machine = PullMachine::new(
            Instant::now(),
            alone,
            t.blob().held().count(),
            PullConfig {
                tracker_grace,
                stall: self.config.stall,
                patience: DEFAULTS.fetching_patience,
                run_chunks: self.config.run_chunks,
                registry_parallel: self.config.registry_parallel,
            },
        );
        let mut actions = Vec::new();
        let mut woke = false;
        loop {
            if let Some(e) = t.take_error() {
                return Err(e);
            }
            while let Some(done) = runs.try_join_next() {
                let (run, result) = done?;
                stops.remove(&run);
                machine.run_ended(run);
                match result {
                    // Failed with chunks on peers' word: checked below.
                    Err(Error::Verify(VerifyError::BlobDigest { .. }))
                        if t.blob().unvouched() > 0 => {}
                    r => r?,
                }
            }
            while let Some(done) = checks.try_join_next() {
                done??;
            }
            // A peer that sent a chunk failing its hash is reported at once:
            // until the tracker hears it, it counts the liar as holding the
            // chunk and hands nobody a registry run of it, and every pull the
            // liar lies to starves for it and fetches it from the registry
            // on its own (the chaos sweep's `liars` class found it).
            for (peer, index) in t.take_bad_chunks() {
                let swarm = self.clone();
                let task = async move { swarm.report_bad_chunk(&digest, &peer, index).await };
                tokio::spawn(task.in_current_span());
            }
            if t.blob().is_complete() {
                return Ok(());
            }
            // Disputes, and after a failed digest the suspects: one chunk
            // from the registry each (see `dray_protocol::pull::arbiter`).
            let mut due: Vec<u32> = std::iter::from_fn(|| t.next_check()).collect();
            if checks.is_empty()
                && due.is_empty()
                && t.blob().is_failed()
                && t.blob().unvouched() > 0
            {
                match t.suspect() {
                    Some(index) => due.push(index),
                    // Every claimant's checked chunk held: a lie only the
                    // whole blob shows. The registry alone can serve it.
                    None => return Err(Error::RecheckStalled(digest)),
                }
            }
            for index in due {
                let task = check_chunk(t.clone(), registry.clone(), repo.to_string(), index);
                checks.spawn(task.in_current_span());
            }
            let now = Instant::now();
            if std::mem::take(&mut woke) || rx.has_changed().unwrap_or(false) {
                let u = rx.borrow_and_update().clone();
                if !u.tracker_ok {
                    machine.tracker_failed();
                } else {
                    if !alone {
                        self.take_news(t, &u)?;
                    }
                    let news = News {
                        fetching: u.fetching,
                        runs: &u.runs,
                        runs_complete: u.runs_complete,
                    };
                    machine.answered(now, news, &mut actions);
                }
            }
            // Chunks whose hashes are published: somebody holds them.
            let published = t.blob().known();
            let progress = (t.blob().held().count(), t.blob().is_failed());
            t.with_picker(|p| machine.poll(now, progress, p, |c| published.get(c), &mut actions));
            for action in actions.drain(..) {
                match action {
                    Action::Start {
                        run, first, count, ..
                    } => {
                        let stop = CancellationToken::new();
                        stops.insert(run, stop.clone());
                        let fetch = fetch_run(
                            self.clone(),
                            t.clone(),
                            registry.clone(),
                            repo.to_string(),
                            first,
                            count,
                            stop,
                        );
                        runs.spawn(async move { (run, fetch.await) }.in_current_span());
                    }
                    Action::Stop(run) => {
                        if let Some(stop) = stops.get(&run) {
                            tracing::info!(%digest, ?run, "stopping a registry run (taken back, or the tracker answers again)");
                            stop.cancel();
                        }
                    }
                    Action::FellBack(mode) => {
                        let reason = match mode {
                            Fallback::All => FallbackReason::Stall,
                            Fallback::Starved => FallbackReason::Starved,
                            _ => FallbackReason::TrackerSilent,
                        };
                        tracing::warn!(%digest, ?reason, tracker_silent_s = machine.rule().tracker_silent_for(now).as_secs_f64(), "falling back to the registry");
                        self.node.metrics().fell_back(reason);
                        self.events.record(
                            EventKind::Fallback,
                            digest.to_string(),
                            None,
                            reason.as_str().to_string(),
                        );
                        report.fell_back = true;
                    }
                    Action::Quiet => tracing::info!(
                        held = t.blob().held().count(),
                        chunks = t.blob().map().chunk_count(),
                        in_flight = t.in_flight(),
                        tracker_fetching = machine.rule().tracker_fetching(),
                        fallback = ?machine.mode(),
                        "no chunk arrived for swarm.stall; waiting on the requests in flight and the registry fetches the tracker reports"
                    ),
                    // Every chunk is held: the registry fallback has nothing
                    // to fetch, and the recheck found nothing wrong in time.
                    Action::RecheckStalled => return Err(Error::RecheckStalled(digest)),
                    Action::Republish => {
                        let (publisher, blob) = (self.clone(), t.blob().clone());
                        tokio::spawn(async move { publisher.publish(&blob).await });
                    }
                }
            }
            // `changed()` marks the value seen, so remember that it fired.
            woke = matches!(
                tokio::time::timeout(Duration::from_millis(50), rx.changed()).await,
                Ok(Ok(()))
            );
        }
    }

    /// Takes what a pull's news says of the swarm: the chunk map (joining
    /// the swarm's chunk geometry if it differs) and the peers.
    fn take_news(&self, t: &Arc<Transfer>, u: &Update) -> Result<()> {
        let digest = t.blob().digest();
        if let Some(m) = u
            .map
            .as_ref()
            .filter(|m| m.chunk_size() != t.blob().chunk_size())
        {
            // The swarm's first holders had another `swarm.chunk_size`:
            // join it in its chunks, unless this node holds chunks
            // of its own (then the registry fallback serves it).
            if t.blob().adopt_geometry(m)? {
                return Err(Error::Recut {
                    digest,
                    chunk_size: m.chunk_size(),
                });
            }
            tracing::warn!(%digest, swarm = m.chunk_size(), ours = t.blob().chunk_size(), "the swarm cuts this blob in other chunks than the ones held here");
        } else if let Some(m) = &u.map {
            match t.blob().adopt(m)? {
                (_, chunks @ 1..) => return Err(Error::Replaced { digest, chunks }),
                (1.., _) => t.nudge(),
                _ => {}
            }
        }
        for p in &u.peers {
            t.add_peer(p.clone());
        }
        Ok(())
    }

    /// A pull's stand-in for the tracker when there is none, or while every
    /// replica is down (it waits while one answers: the tracker's runs
    /// come first). Every `dht.lookup` it hands the transfer the blob's
    /// other holders and pullers as peers, whose word it takes for chunk
    /// hashes; it asks the DHT for them again at that pace while they
    /// change, and less often while they stay the same ([`lookup_after`]).
    /// A node the blob's list leaves out joins an overflow list
    /// ([`overflow_list`]), whose members are peers, not fetchers. After
    /// `dht.settle` (time for the other pullers of a storm to show up), it
    /// also hands the pull its registry runs ([`dht_runs`]) among the
    /// blob's fetchers: its first candidates by
    /// [`dray_protocol::dht::fetcher_rank`] ([`FETCHERS`]) that answered
    /// this pull's bitfield request (which every puller makes of them; no
    /// runs while one is still to answer), so a member named by a forged
    /// list, that neither holds nor pulls the blob, is never given blocks
    /// to wait for; with every candidate failed here, the pull fetches
    /// alone. A fetcher's blocks that never come are fetched by the stall
    /// fallback.
    async fn coordinate(
        self: Arc<Self>,
        dht: Arc<Dht>,
        t: Arc<Transfer>,
        updates: watch::Sender<Update>,
    ) {
        let digest = t.blob().digest();
        let Ok(local) = self.node.local_addr() else {
            return;
        };
        let me = self.node.peer_id().to_string();
        let mut standing_in: Option<Instant> = None;
        // The members last found (the reachable fetcher candidates, watched
        // ones of the blob's own list and of this node's overflow list, and
        // whether the DHT lists this node and it is a candidate), and how
        // many answers in a row named them.
        let mut found: Option<Found> = None;
        // The overflow list this node provides the blob in, once its own
        // list is full without it.
        let mut overflow = None;
        let mut asked_at = Instant::now();
        let mut unchanged = 0;
        loop {
            let tracker_answers = self.tracker.is_configured() && !self.tracker.all_down();
            match (tracker_answers, standing_in) {
                (true, None) => {}
                (true, Some(_)) => {
                    tracing::info!(%digest, "a tracker replica answers again: its runs take over from the DHT's");
                    standing_in = None;
                }
                (false, None) => {
                    if self.tracker.is_configured() {
                        tracing::warn!(%digest, "every tracker replica is down: finding peers through the DHT");
                    }
                    t.take_hashes_from_peers();
                    // Only now: while a tracker answers, it names the peers.
                    dht.provide(&digest).await;
                    standing_in = Some(Instant::now());
                }
                (false, Some(since)) => {
                    let due = asked_at.elapsed() >= lookup_after(dht.config().lookup, unchanged);
                    let watch = self.node.config.max_peers_per_blob.saturating_sub(FETCHERS);
                    let now = match found.clone() {
                        Some(kept) if !due => kept,
                        _ => {
                            let gone = |p: &str| t.is_gone(p);
                            let members = dht.members(&digest, overflow, watch, gone).await;
                            asked_at = Instant::now();
                            if !members.listed && overflow.is_none() {
                                let list = overflow_list(&me);
                                tracing::info!(%digest, list, "the blob's list in the DHT is full: joining an overflow list");
                                dht.provide_overflow(&digest, list).await;
                                overflow = Some(list);
                            }
                            let reachable = |records: Vec<NodeRecord>| {
                                let mut peers: Vec<PeerAddr> = records
                                    .into_iter()
                                    .filter_map(|m| {
                                        Some(PeerAddr {
                                            addr: advertise::reachable(&m.address, local)?,
                                            peer_id: m.peer_id,
                                        })
                                    })
                                    .collect();
                                peers.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
                                peers
                            };
                            let now = Found {
                                fetchers: reachable(members.fetchers),
                                peers: reachable(members.others),
                                more: reachable(members.overflow),
                                fetcher: members.fetcher,
                            };
                            unchanged = if found.as_ref() == Some(&now) {
                                unchanged + 1
                            } else {
                                0
                            };
                            found = Some(now.clone());
                            now
                        }
                    };
                    let mut runs = Vec::new();
                    if since.elapsed() >= dht.config().settle {
                        // The candidates that answered here (every puller
                        // asks the same ones): the set every puller computes
                        // the same, once none is still to answer. This node
                        // only if it is a candidate (nobody else counts it),
                        // or if every other failed here.
                        let live: Vec<(&str, bool)> = now
                            .fetchers
                            .iter()
                            .filter(|p| !t.is_gone(&p.peer_id))
                            .map(|p| (p.peer_id.as_str(), t.has_shown(&p.peer_id)))
                            .collect();
                        let fetchers = counted_fetchers(&me, now.fetcher, &live);
                        let mut held = t.held_by_peers();
                        for i in t.blob().held().ones() {
                            held.set(i);
                        }
                        runs = dht_runs(
                            &digest,
                            &me,
                            fetchers.into_iter(),
                            &held,
                            self.config.run_chunks,
                        );
                        // As many as run at once: the next come as these finish.
                        runs.truncate(self.config.registry_parallel.max(1));
                    }
                    updates.send_replace(Update {
                        tracker_ok: true,
                        fetching: false,
                        runs_complete: false,
                        // Its overflow list's members are peers, not fetchers.
                        peers: self.dht_peers(now, &t),
                        runs,
                        map: None,
                    });
                }
            }
            tokio::time::sleep(dht.config().lookup).await;
        }
    }

    /// Of a blob's members, the peers a pull without a tracker hands its
    /// transfer: the fetcher candidates that have not failed there (asked
    /// by every puller, so that each learns which answer), then those of
    /// the blob's list (`peers`) and of its overflow list (`more`) that
    /// have not failed there nor refused to be watched (at their watcher
    /// cap), up to `peer.max_peers_per_blob` in all, half from each list
    /// if it can ([`pick_peers`]), in an order of this node's own (a hash
    /// of both ids), so that each node watches a different few of a large
    /// swarm, and the same few at every lookup.
    fn dht_peers(&self, found: Found, t: &Transfer) -> Vec<PeerAddr> {
        let fit = |mut v: Vec<PeerAddr>| {
            v.retain(|p| !t.is_gone(&p.peer_id) && !t.is_refused(&p.peer_id));
            v
        };
        let mut peers: Vec<PeerAddr> = found
            .fetchers
            .into_iter()
            .filter(|p| !t.is_gone(&p.peer_id))
            .collect();
        let room = self
            .node
            .config
            .max_peers_per_blob
            .saturating_sub(peers.len());
        if room > 0 {
            peers.extend(pick_peers(
                self.node.peer_id(),
                fit(found.peers),
                fit(found.more),
                |p| p.peer_id.as_str(),
                room,
            ));
        }
        peers
    }

    async fn publish(&self, blob: &Blob) {
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
    async fn publish_chunk(&self, index: u32, blob: &Blob) {
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

    async fn report_bad_chunk(&self, digest: &BlobDigest, offender: &str, index: u32) {
        let body = Body::BadChunk(pb::BadChunkReport {
            reporter: self.node.peer_id().to_string(),
            offender: offender.to_string(),
            digest: digest.to_string(),
            index,
        });
        if let Err(e) = self.tracker.send_for(digest, body).await {
            tracing::warn!(error = %e, "could not report a bad chunk");
        }
    }
}

/// Wrong chunk maps one pull finds itself before it fetches the blob from
/// the registry alone. After the first the node keeps its chunks: once a
/// quorum of nodes reports the failure the tracker has the chunks fetched
/// again from the registry, a few at a time, until one differs, whose hash
/// it replaces; every node then fetches that chunk again from a peer (about
/// half a copy more of the blob from the registry on average, whatever the
/// node count). A second failure in the same pull means the swarm keeps
/// getting it wrong.
const MAP_FAILURES_BEFORE_ALONE: u32 = 2;

/// The members a pull without a tracker last found through the DHT (see
/// [`crate::discovery::dht::Members`]), with the addresses it can reach them at.
#[derive(Clone, Debug, PartialEq)]
struct Found {
    fetchers: Vec<PeerAddr>,
    peers: Vec<PeerAddr>,
    more: Vec<PeerAddr>,
    fetcher: bool,
}

/// How often the blobs a node provides through the DHT are checked against
/// its store, its pulls and the tracker's health ([`Swarm::provide_through`]).
const PROVIDE_CHECK_EVERY: Duration = Duration::from_secs(10);

/// Errors that mean the published chunk map cannot be trusted.
/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn is_map_failure(e: &Error) -> bool {
    matches!(
        e,
        Error::RecheckStalled(_)
            | Error::Verify(VerifyError::BlobDigest { .. } | VerifyError::HashConflict { .. })
    )
}

/// Fetches chunks `[first, first + count)` from the registry into the blob
/// and publishes each chunk's hash; stops (releasing the chunk it was
/// fetching) when `cancel` fires. A chunk then in flight from a peer is
/// left to that request and, after the rest of the run, waited for: if the
/// request fails (the peer left, or lied), the run fetches the chunk itself,
/// as the tracker that assigned it expects.
async fn fetch_run(
    swarm: Arc<Swarm>,
    t: Arc<Transfer>,
    registry: Arc<RegistryClient>,
    repo: String,
    first: u32,
    count: u32,
    cancel: CancellationToken,
) -> Result<()> {
    let map = t.blob().map();
    let mut in_flight = Vec::new();
    for index in first..first.saturating_add(count).min(map.chunk_count()) {
        if cancel.is_cancelled() {
            return Ok(());
        }
        // A chunk held by a blob that failed its digest is fetched again and
        // compared: the tracker's recheck.
        let recheck = t.blob().take_recheck(index);
        if !recheck && !t.claim(index) {
            if !t.blob().has(index) {
                in_flight.push(index);
            }
            continue;
        }
        if !fetch_chunk(
            &swarm,
            &t,
            (&registry, &repo),
            &map,
            index,
            recheck,
            &cancel,
        )
        .await?
        {
            return Ok(());
        }
    }
    for index in in_flight {
        let Some(true) = cancel.run_until_cancelled(t.claim_when_free(index)).await else {
            continue;
        };
        if !fetch_chunk(&swarm, &t, (&registry, &repo), &map, index, false, &cancel).await? {
            return Ok(());
        }
    }
    Ok(())
}

/// Fetches chunk `index` from the registry to settle a dispute or check a
/// suspect claim, stores it (vouched) and hands the transfer the ruling.
async fn check_chunk(
    t: Arc<Transfer>,
    registry: Arc<RegistryClient>,
    repo: String,
    index: u32,
) -> Result<()> {
    let map = t.blob().map();
    let (digest, offset, len) = (map.digest(), map.offset(index), map.chunk_len(index));
    tracing::info!(
        index,
        "fetching a chunk from the registry to check peers' word for it"
    );
    let data = match registry
        .blob_range(&repo, &digest, offset, len as u64)
        .await
    {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(index, error = %e, "could not check a chunk against the registry");
            return t.checked(index, None);
        }
    };
    let hash = dray_protocol::chunkmap::chunk_hash(&data);
    match t.store(index, data, None).await {
        // The blob failed its digest again: the next suspect is checked.
        Ok(_) | Err(Error::Verify(VerifyError::BlobDigest { .. })) => t.checked(index, Some(hash)),
        Err(e) => {
            t.checked(index, None)?;
            Err(e)
        }
    }
}

/// Fetches one claimed chunk (or one to recheck) from the registry, stores
/// and publishes it. False when `cancel` fired first (the claim released).
async fn fetch_chunk(
    swarm: &Arc<Swarm>,
    t: &Arc<Transfer>,
    (registry, repo): (&RegistryClient, &str),
    map: &ChunkMap,
    index: u32,
    recheck: bool,
    cancel: &CancellationToken,
) -> Result<bool> {
    let settle = |stored| {
        if !recheck {
            t.settle(index, stored);
        }
    };
    tracing::debug!(index, recheck, "requesting registry chunk");
    let digest = map.digest();
    let range = registry.blob_range(
        repo,
        &digest,
        map.offset(index),
        map.chunk_len(index) as u64,
    );
    let Some(fetched) = cancel.run_until_cancelled(range).await else {
        settle(false);
        return Ok(false);
    };
    let data = match fetched {
        Ok(d) => d,
        Err(e) => {
            settle(false);
            return Err(e.into());
        }
    };
    match t.store(index, data, None).await {
        // A recheck publishes the hash even when it is the same: that
        // settles the chunk at the tracker, and the next goes out.
        Ok(outcome) if recheck || outcome != PutOutcome::Duplicate => {
            tracing::debug!(index, recheck, "registry chunk stored");
            settle(true);
            // Peers can take the chunk only once its hash is published;
            // the next chunk need not wait for that (nor for a dead
            // tracker's timeout), and neither need the announce that
            // tells the tracker we hold it and brings our next run: the
            // two round trips overlap.
            let (publisher, blob) = (swarm.clone(), t.blob().clone());
            tokio::spawn(async move { publisher.publish_chunk(index, &blob).await });
            swarm.poke.notify_one();
        }
        Ok(_) => t.settle(index, true),
        Err(e) => {
            if matches!(
                e,
                Error::Verify(VerifyError::ChunkLength { .. } | VerifyError::HashConflict { .. })
            ) {
                swarm.node.metrics().verify_failed(Source::Registry);
            }
            settle(false);
            return Err(e);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
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
