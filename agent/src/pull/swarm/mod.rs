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
//!
//! The swarm's jobs are rooms of this folder: [`announcer`] (what the node
//! tells the tracker), [`drive`] (a pull, from start to a verified blob),
//! [`coordinate`] (a pull's stand-in for the tracker, through the DHT) and
//! [`registry_runs`] (the chunks a pull fetches from the registry).

mod announcer;
mod coordinate;
mod drive;
mod registry_runs;

use crate::discovery::advertise::Advertised;
use crate::discovery::dht::{Dht, DhtConfig};
use crate::discovery::preheat::Preheats;
use crate::discovery::tracker_client::TrackerClient;
use crate::peer::PeerNode;
use crate::pull::events::Events;
use crate::pull::fetch::{PeerAddr, Transfer};
use crate::pull::registry::RegistryClient;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::scheduler::SchedulerConfig;
use dray_protocol::settings::duration;
use dray_protocol::{Bitfield, BlobDigest, ChunkMap, DEFAULT_CHUNK_SIZE};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

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
    /// Chunk requests waited for past their deadline, half there by it,
    /// and answered (see `fetch`).
    pub extended_requests: u32,
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
    /// The pull's registry client. Announces name its base URL (the
    /// origin: the tracker budgets registry fetches per registry) and
    /// whether it ignores `Range`.
    registry: Arc<RegistryClient>,
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
                origin: w.registry.base().to_owned(),
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
}
