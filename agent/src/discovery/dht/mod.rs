//! Discovery without a tracker: a Kademlia DHT (libp2p) among the cluster's
//! nodes, used when no tracker is configured.
//!
//! Only cluster members take part: every DHT connection is mutual TLS
//! against the cluster CA ([`tls`]), so a node without a certificate the CA
//! signed cannot connect, let alone publish a record. Two kinds of record
//! live in it:
//! - **Provider records**, one key per blob: the nodes that hold or are
//!   pulling it. A node provides the blobs its store holds or it pulls only
//!   while no tracker answers it, and withdraws them when a tracker answers
//!   again or a blob leaves its store (`Swarm`'s announcer calls
//!   [`Dht::provide_only`]); a record lives [`RECORD_TTL`] unless
//!   republished, and expired ones are purged every [`PURGE_EVERY`]. A
//!   puller stops counting a node the DHT names once that node answers
//!   that its store does not know the blob (see
//!   [`crate::peer::PeerNode::bitfield_with_hashes`]). A store keeps the
//!   first 256 providers of a key; a node a blob's list left out provides
//!   it in one of the blob's overflow lists instead, where the others left
//!   out find it ([`dray_protocol::dht::overflow_list`]). What other members
//!   may make a node store is quota'd per member ([`store`]).
//! - **Node records**, one per node: its dray peer id and the peer-plane
//!   address(es) to dial, as an announce to the tracker carries them. A node
//!   stores another's record only when that node sent it itself (the TLS
//!   handshake proved who sent it), so no member can speak for another.
//!
//! A lookup's answers come from members, and one of them may lie:
//! - a provider list longer than a store keeps is forged: only the first
//!   `dht_max_providers` of it are taken (the rest counted, and logged
//!   once), and it is no witness for [`counts_itself`];
//! - one lookup asks for at most [`FETCHERS`] + 2 × the watched peers' node
//!   records: the blob's fetcher candidates, first by
//!   [`dray_protocol::dht::fetcher_rank`] (the same order at every node,
//!   whatever list it got), and the peers this node will watch;
//! - a node record a lookup finds may come from a third party, which can
//!   forge its address: a lookup takes only the node's own answer (the
//!   record's key is the node's id, so the lookup reaches it), kept
//!   [`RECORD_TTL`] (a record not found, [`MISSING_TTL`]); and a peer-plane
//!   address is only ever dialled expecting the peer id (the peer plane's
//!   mutual TLS checks the certificate names it,
//!   [`crate::peer::PeerNode::connect`]).
//!
//! The data path is unchanged: chunks move over the authenticated QUIC peer
//! plane. What the tracker did besides naming peers, choosing who fetches
//! which chunk from the registry and vouching for chunk hashes, the swarm
//! engine does itself in this mode (see `crate::pull::swarm`).
//!
//! A node joins through `dht.bootstrap`: addresses or DNS names (a headless
//! Service over the DaemonSet resolves to every node), dialled until the
//! routing table holds peers, then Kademlia's own bootstrap fills it (run
//! again at each round while the table is short, so a member whose record
//! was lost is found within seconds, not at the next refresh). Names
//! are resolved off the event loop, one lookup per entry at a time, so a
//! DNS server that never answers delays only that entry's dials, never a
//! query; rounds back off from [`DIAL_EVERY`] to [`DIAL_EVERY_MAX`] while
//! the routing table is not empty (a cluster smaller than [`ENOUGH_PEERS`]
//! never fills it).
//!
//! The DHT port takes connections from anyone who can reach it, before the
//! TLS handshake says who they are; they are capped
//! ([`MAX_PENDING_INCOMING`] handshakes at once, [`MAX_ESTABLISHED_INCOMING`]
//! members, [`MAX_PER_PEER`] per member) by libp2p's connection limits, and
//! to [`limits::MAX_PENDING_PER_ADDRESS`] handshakes per remote address, so
//! a flood of half-open connections costs the node a bounded number of
//! descriptors and tasks, and one host cannot keep new members out; what
//! the caps close is counted in `dht_connections_over_limit`.

pub mod limits;
pub mod store;
pub mod tls;

use crate::error::{Error, Result};
use crate::identity::Identity;
use dray_protocol::BlobDigest;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::dht::{
    FETCHERS, counts_itself, fetcher_candidates, fetcher_rank, overflow_list,
};
use dray_protocol::settings::duration;
use futures_util::StreamExt;
use libp2p::core::ConnectedPoint;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryId, QueryResult, Quorum, Record};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, StreamProtocol, Swarm, Transport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use store::BoundedStore;
use tokio::sync::{mpsc, oneshot, watch};

pub use tls::libp2p_id;

/// The Kademlia protocol name: dray's own DHT, not the public IPFS one.
pub const KAD_PROTOCOL: &str = "/dray/kad/1";
/// A provider or node record lives this long unless its node republishes it.
const RECORD_TTL: Duration = Duration::from_secs(30 * 60);
/// How long a lookup that found no node record for a member keeps it so.
const MISSING_TTL: Duration = Duration::from_secs(60);
/// How often expired records leave the store (not only when read).
pub const PURGE_EVERY: Duration = Duration::from_secs(60);
/// How often a node republishes its provider records.
const PROVIDE_EVERY: Duration = Duration::from_secs(10 * 60);
/// How often a node refreshes its routing table and republishes its record.
const REFRESH_EVERY: Duration = Duration::from_secs(60);
/// How often bootstrap addresses are dialled again while the routing table
/// is short of peers.
const DIAL_EVERY: Duration = Duration::from_secs(2);
/// Bootstrap addresses dialled per round, at most.
const DIALS_PER_ROUND: usize = 16;
/// The longest pause between bootstrap rounds while the routing table holds
/// peers (a table that empties goes back to [`DIAL_EVERY`]).
const DIAL_EVERY_MAX: Duration = Duration::from_secs(60);
/// Routing-table peers past which bootstrap addresses are not dialled again.
const ENOUGH_PEERS: usize = 16;
/// Incoming connections in their TLS handshake at once, at most: anyone
/// who reaches the port can open one (10 s each at most, the upgrade's
/// timeout), and a member joining needs one only for milliseconds.
const MAX_PENDING_INCOMING: u32 = 128;
/// Members connected to this node at their initiative, at most: Kademlia's
/// queries reach a node from about k × log2(nodes) others (20 × 14 at
/// 16,000 nodes), and idle connections close after 5 minutes.
const MAX_ESTABLISHED_INCOMING: u32 = 1024;
/// Connections one member keeps to this node, at most (each side may dial).
const MAX_PER_PEER: u32 = 2;
/// A DHT query gives up after this long (a cluster network answers in ms).
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest node record taken (a peer id and two addresses need far less).
const MAX_NODE_RECORD: usize = 1024;
/// Largest DHT message: a full provider list (`dht_max_providers`
/// entries of an id and a few addresses, about 60-200 bytes each) and 20
/// closer peers. libp2p's 16 KiB would cut a full list off on a dual-stack
/// node, failing the answer.
pub const MAX_PACKET: usize = 64 << 10;

/// The DHT's metrics, registered with the agent's others.
#[derive(Clone, Debug, Default)]
pub struct DhtMetrics {
    peers: Gauge,
    bytes: Family<DirectionLabel, Counter>,
    refused: Counter,
    over_limit: Counter,
    ignored_providers: Counter,
    refused_records: Counter,
    stored_keys: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    direction: &'static str,
}

impl DhtMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "dht_peers",
            "Nodes in this agent's DHT routing table",
            self.peers.clone(),
        );
        r.register_with_unit(
            "dht",
            "DHT traffic (inside its TLS), by direction",
            Unit::Bytes,
            self.bytes.clone(),
        );
        r.register(
            "dht_refused_connections",
            "DHT connections that failed their handshake (no node certificate the cluster CA signed, or no TLS at all)",
            self.refused.clone(),
        );
        r.register(
            "dht_connections_over_limit",
            "Incoming DHT connections closed at once because too many were in their handshake or connected (see the DHT module's caps)",
            self.over_limit.clone(),
        );
        r.register(
            "dht_ignored_providers",
            "Provider ids past dht_max_providers in one lookup answer (no store keeps so many: a forged list), ignored",
            self.ignored_providers.clone(),
        );
        r.register(
            "dht_refused_records",
            "Records a member sent that were not kept: provider records past its quota or the room for all members' records, and node records not of the sender itself",
            self.refused_records.clone(),
        );
        r.register(
            "dht_stored_provider_keys",
            "Provider records this node's DHT store holds (its own and other members'), after the last purge",
            self.stored_keys.clone(),
        );
    }

    /// The counters of bytes read and written on DHT connections.
    fn traffic(&self) -> (Counter, Counter) {
        // One at a time: the family's guard must be gone before the next.
        let counter = |direction| {
            self.bytes
                .get_or_create(&DirectionLabel { direction })
                .clone()
        };
        let read = counter("in");
        (read, counter("out"))
    }
}

/// DHT settings (`[swarm.dht]`); every key optional. The DHT is off unless
/// `listen` is set.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DhtConfig {
    /// TCP address the DHT listens on (the chart: the node's IP, port 7882).
    pub listen: Option<SocketAddr>,
    /// Where to join: `host:port` entries; a DNS name may resolve to many
    /// nodes (a headless Service), and is resolved again at every round.
    pub bootstrap: Vec<String>,
    /// How long a pull gathers the blob's other pullers from the DHT before
    /// it fetches its share from the registry: a shorter wait risks two
    /// nodes fetching the same chunk, a longer one delays a pull alone.
    #[serde(with = "duration")]
    pub settle: Duration,
    /// How often a pull asks the DHT again who holds or pulls its blob.
    #[serde(with = "duration")]
    pub lookup: Duration,
}

impl Default for DhtConfig {
    fn default() -> Self {
        Self {
            listen: None,
            bootstrap: Vec::new(),
            settle: Duration::from_millis(DEFAULTS.dht_settle_ms),
            lookup: Duration::from_millis(DEFAULTS.dht_lookup_ms),
        }
    }
}

/// A node as its record in the DHT names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Its dray peer id (its certificate's name).
    pub peer_id: String,
    /// Its peer-plane address(es), as an announce carries them.
    pub address: String,
    /// Its DHT address(es): a node that learns them from the record (sent
    /// by the node itself) can route to a node that only dialled it.
    #[serde(default)]
    pub dht: Vec<SocketAddr>,
}

/// The key of `peer`'s node record: its own id, so that Kademlia hashes
/// the key to the node's own place (distance 0) and a lookup of the record
/// always reaches the node itself, whose answer is the only one taken (see
/// `on_kad`).
pub fn node_key(peer: &PeerId) -> kad::RecordKey {
    kad::RecordKey::new(&peer.to_bytes())
}

/// The key of a blob's provider list.
pub fn blob_key(digest: &BlobDigest) -> kad::RecordKey {
    kad::RecordKey::new(&format!("dray/blob/{digest}"))
}

fn overflow_key(digest: &BlobDigest, list: u32) -> kad::RecordKey {
    kad::RecordKey::new(&format!("dray/blob/{digest}/overflow/{list}"))
}

/// The node record `record` holds, if it is a well-formed record of `peer`.
fn node_record(peer: &PeerId, record: &Record) -> Option<NodeRecord> {
    if record.key != node_key(peer) || record.value.len() > MAX_NODE_RECORD {
        return None;
    }
    let node: NodeRecord = serde_json::from_slice(&record.value).ok()?;
    (libp2p_id(&node.peer_id) == *peer).then_some(node)
}

/// Where the DHT's listener stands.
#[derive(Clone, Debug)]
enum Listening {
    Pending,
    On(SocketAddr),
    Failed(String),
    Closed(String),
}

/// What a provider query found: the providers, and the size of each other
/// store's answer, as [`counts_itself`] reads them.
#[derive(Debug, Default)]
struct Providers {
    ids: HashSet<PeerId>,
    answers: Vec<usize>,
}

/// A blob's members as the DHT lists them: the few whose node records a
/// lookup found (see the module docs for the bounds).
#[derive(Debug, Default)]
pub struct Members {
    /// The blob's fetcher candidates other than this node, first by
    /// [`fetcher_rank`], at most [`FETCHERS`] with this node: those that
    /// answer the pull fetch the registry's blocks.
    pub fetchers: Vec<NodeRecord>,
    /// Other nodes of the blob's own list this node watches, in its own
    /// order.
    pub others: Vec<NodeRecord>,
    /// Those of this node's overflow list, if it looked one up: peers only.
    pub overflow: Vec<NodeRecord>,
    /// Whether the DHT lists this node too ([`counts_itself`]).
    pub listed: bool,
    /// Whether this node is listed and one of the blob's fetcher
    /// candidates: only then does it take blocks of the registry's work.
    pub fetcher: bool,
}

/// What this node knows of a member's node record.
#[derive(Clone, Debug)]
enum Known {
    Found(NodeRecord),
    /// No lookup found one.
    Missing,
}

/// The node records lookups found, each until it expires ([`RECORD_TTL`],
/// [`MISSING_TTL`] for one not found).
#[derive(Debug, Default)]
struct RecordCache(HashMap<PeerId, (Known, Instant)>);

impl RecordCache {
    /// What is known of `id` at `now`, if that has not expired.
    fn get(&self, id: &PeerId, now: Instant) -> Option<&Known> {
        self.0
            .get(id)
            .filter(|(_, until)| *until > now)
            .map(|(k, _)| k)
    }

    /// Keeps what a lookup found of `id` at `now`, and drops what expired.
    fn insert(&mut self, id: PeerId, found: Option<NodeRecord>, now: Instant) {
        self.0.retain(|_, (_, until)| *until > now);
        let entry = match found {
            Some(r) => (Known::Found(r), now + RECORD_TTL),
            None => (Known::Missing, now + MISSING_TTL),
        };
        self.0.insert(id, entry);
    }
}

/// The order in which `me` picks the members it watches (a BLAKE3 hash of
/// both ids): each node its own few.
fn watch_rank(me: &PeerId, id: &PeerId) -> [u8; 32] {
    *blake3::Hasher::new()
        .update(&me.to_bytes())
        .update(&id.to_bytes())
        .finalize()
        .as_bytes()
}

enum Command {
    Provide(kad::RecordKey),
    Withdraw(kad::RecordKey),
    Providers(kad::RecordKey, oneshot::Sender<Providers>),
    Record(PeerId, oneshot::Sender<Option<NodeRecord>>),
    Routing(oneshot::Sender<usize>),
}

/// This node's handle on the DHT; the DHT runs on its own task until the
/// handle is dropped or [`Dht::stop`] is called.
pub struct Dht {
    commands: mpsc::Sender<Command>,
    /// Ends the DHT's task: its listener and connections close with it.
    stop: tokio_util::sync::CancellationToken,
    local: PeerId,
    /// This node's overflow list ([`overflow_list`]).
    overflow_list: u32,
    listening: watch::Receiver<Listening>,
    /// Node records found so far, by libp2p id.
    records: Mutex<RecordCache>,
    /// The blobs this node provides.
    provided: Mutex<HashSet<BlobDigest>>,
    config: DhtConfig,
}

impl Dht {
    /// Joins the DHT as the node of `identity`, whose peer plane is reached at
    /// `address` (as announced). Fails if the listen address cannot be
    /// bound. Runs on the current tokio runtime.
    pub fn join(
        identity: &Identity,
        config: &DhtConfig,
        address: String,
        metrics: DhtMetrics,
    ) -> Result<Arc<Self>> {
        let listen = config
            .listen
            .ok_or_else(|| Error::Config("the DHT needs dht.listen".into()))?;
        let local = libp2p_id(&identity.peer_id);
        let me = NodeRecord {
            peer_id: identity.peer_id.clone(),
            address,
            dht: Vec::new(),
        };
        let mut kad_config = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
        kad_config
            // Records are checked before they are stored: see `on_inbound`.
            .set_record_filtering(kad::StoreInserts::FilterBoth)
            .set_caching(kad::Caching::Disabled)
            .set_query_timeout(QUERY_TIMEOUT)
            .set_record_ttl(Some(RECORD_TTL))
            .set_provider_record_ttl(Some(RECORD_TTL))
            .set_provider_publication_interval(Some(PROVIDE_EVERY))
            // Only a record's own node may store it (see `node_record`),
            // so copies from other nodes would be refused anyway.
            .set_replication_interval(None)
            .set_publication_interval(Some(REFRESH_EVERY * 10))
            .set_periodic_bootstrap_interval(Some(REFRESH_EVERY))
            .set_max_packet_size(MAX_PACKET);
        let store = BoundedStore::new(local, MAX_NODE_RECORD, DEFAULTS.dht_max_providers);
        let mut kad = kad::Behaviour::with_config(local, store, kad_config);
        kad.set_mode(Some(kad::Mode::Server));
        let limits = libp2p::connection_limits::ConnectionLimits::default()
            .with_max_pending_incoming(Some(MAX_PENDING_INCOMING))
            .with_max_established_incoming(Some(MAX_ESTABLISHED_INCOMING))
            .with_max_established_per_peer(Some(MAX_PER_PEER));
        let behaviour = Behaviour {
            per_address: limits::PendingPerAddress::new(limits::MAX_PENDING_PER_ADDRESS),
            limits: libp2p::connection_limits::Behaviour::new(limits),
            kad,
        };
        let mut swarm = member_swarm(identity, metrics.traffic(), behaviour)?;
        swarm
            .listen_on(multiaddr_of(listen))
            .map_err(|e| Error::Config(format!("the DHT cannot listen on {listen}: {e}")))?;
        let (commands, rx) = mpsc::channel(256);
        let (bound, listening) = watch::channel(Listening::Pending);
        let runner = Runner {
            swarm,
            me,
            own: None,
            bootstrap: config.bootstrap.clone(),
            resolving: HashSet::new(),
            pause: DIAL_EVERY,
            next_round: Instant::now(),
            bound,
            providers: HashMap::new(),
            records: HashMap::new(),
            published: false,
            warned_oversize: false,
            warned_forged: false,
            metrics,
        };
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(runner.run(rx, stop.clone()));
        Ok(Arc::new(Self {
            commands,
            stop,
            local,
            overflow_list: overflow_list(&identity.peer_id),
            listening,
            records: Mutex::new(RecordCache::default()),
            provided: Mutex::new(HashSet::new()),
            config: config.clone(),
        }))
    }

    pub fn config(&self) -> &DhtConfig {
        &self.config
    }

    /// Leaves the DHT as a crash would: its task ends, closing its listener
    /// and connections, while other holders of this handle may still ask
    /// (and hear nothing).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// The address the DHT listens on (a port 0 made real), once bound;
    /// why not, if binding it failed.
    pub async fn listening(&self) -> Result<SocketAddr> {
        let mut rx = self.listening.clone();
        let state = rx
            .wait_for(|l| !matches!(l, Listening::Pending))
            .await
            .map(|l| l.clone())
            .unwrap_or_else(|_| Listening::Failed("the DHT's task ended".into()));
        match state {
            Listening::On(addr) => Ok(addr),
            Listening::Failed(why) | Listening::Closed(why) => Err(Error::Config(format!(
                "the DHT cannot listen on {}: {why}",
                self.config
                    .listen
                    .map(|a| a.to_string())
                    .unwrap_or_default()
            ))),
            Listening::Pending => unreachable!("waited past it"),
        }
    }

    /// Tells the DHT this node holds or pulls `digest`.
    pub async fn provide(&self, digest: &BlobDigest) {
        lock(&self.provided).insert(*digest);
        let _ = self.commands.send(Command::Provide(blob_key(digest))).await;
    }

    /// Withdraws this node's provider records of `digest`: the blob's own
    /// list and its overflow list.
    async fn withdraw(&self, digest: &BlobDigest) {
        lock(&self.provided).remove(digest);
        for key in [blob_key(digest), overflow_key(digest, self.overflow_list)] {
            let _ = self.commands.send(Command::Withdraw(key)).await;
        }
    }

    /// Makes `wanted` the blobs this node provides: provides those it does
    /// not yet, withdraws the others (a blob that left the store, a pull
    /// given up, or every blob while a tracker answers).
    pub async fn provide_only(&self, wanted: &HashSet<BlobDigest>) {
        let (new, old): (Vec<BlobDigest>, Vec<BlobDigest>) = {
            let provided = lock(&self.provided);
            (
                wanted.difference(&provided).copied().collect(),
                provided.difference(wanted).copied().collect(),
            )
        };
        for d in &old {
            self.withdraw(d).await;
        }
        for d in &new {
            self.provide(d).await;
        }
        if !old.is_empty() || !new.is_empty() {
            tracing::debug!(
                provided = new.len(),
                withdrawn = old.len(),
                "the blobs this node provides through the DHT changed"
            );
        }
    }

    /// Peers in this node's routing table.
    pub async fn routing_peers(&self) -> usize {
        let (tx, rx) = oneshot::channel();
        let _ = self.commands.send(Command::Routing(tx)).await;
        rx.await.unwrap_or(0)
    }

    /// The blob's members the DHT names ([`Members`]): its fetcher
    /// candidates, at most `watch` others of its list and, with
    /// `overflow`, of that overflow list ([`Dht::provide_overflow`]);
    /// members `gone` (by dray peer id) and those whose record cannot be
    /// found are left out. Asks for at most [`FETCHERS`] + 2 × `watch` node
    /// records, however many members the answers name.
    pub async fn members(
        &self,
        digest: &BlobDigest,
        overflow: Option<u32>,
        watch: usize,
        gone: impl Fn(&str) -> bool,
    ) -> Members {
        let more = async {
            match overflow {
                Some(list) => self.providers(overflow_key(digest, list)).await,
                None => Providers::default(),
            }
        };
        let (own, more) = futures_util::future::join(self.providers(blob_key(digest)), more).await;
        let listed = counts_itself(own.answers, DEFAULTS.dht_max_providers);
        let rank = |id: &PeerId| fetcher_rank(digest, &id.to_bytes());
        let mut ranked: Vec<PeerId> = own
            .ids
            .iter()
            .copied()
            .filter(|id| *id != self.local)
            .collect();
        ranked.sort_by_cached_key(rank);
        let (fetchers, fetcher) = fetcher_candidates(
            &rank(&self.local),
            listed,
            self.first_records(&ranked, FETCHERS, &gone).await,
            |r| rank(&libp2p_id(&r.peer_id)),
        );
        let chosen: HashSet<&str> = fetchers.iter().map(|r| r.peer_id.as_str()).collect();
        ranked.sort_by_cached_key(|id| watch_rank(&self.local, id));
        let others = self
            .first_records(&ranked, watch, |p: &str| gone(p) || chosen.contains(p))
            .await;
        let mut extra: Vec<PeerId> = more
            .ids
            .difference(&own.ids)
            .copied()
            .filter(|id| *id != self.local)
            .collect();
        extra.sort_by_cached_key(|id| watch_rank(&self.local, id));
        let overflow = self.first_records(&extra, watch, &gone).await;
        Members {
            fetchers,
            others,
            overflow,
            listed,
            fetcher,
        }
    }

    /// Tells the DHT this node pulls `digest`, in its overflow list `list`
    /// ([`dray_protocol::dht::overflow_list`]): for a node the blob's own
    /// list left out.
    pub async fn provide_overflow(&self, digest: &BlobDigest, list: u32) {
        let key = overflow_key(digest, list);
        let _ = self.commands.send(Command::Provide(key)).await;
    }

    /// What the stores of `key` answer.
    async fn providers(&self, key: kad::RecordKey) -> Providers {
        let (tx, rx) = oneshot::channel();
        if self
            .commands
            .send(Command::Providers(key, tx))
            .await
            .is_err()
        {
            return Providers::default();
        }
        rx.await.unwrap_or_default()
    }

    /// The node records of the first `n` of `ids`, in their order, less
    /// those `skip`ped (by dray peer id) or not found: at most `n` lookups,
    /// fewer for records known; a record a lookup does not find this time
    /// is looked up again at a later call.
    async fn first_records(
        &self,
        ids: &[PeerId],
        n: usize,
        skip: impl Fn(&str) -> bool,
    ) -> Vec<NodeRecord> {
        let now = Instant::now();
        let mut picked = Vec::new();
        let mut missing = Vec::new();
        {
            let known = lock(&self.records);
            for (i, id) in ids.iter().enumerate() {
                if picked.len() + missing.len() >= n {
                    break;
                }
                match known.get(id, now) {
                    Some(Known::Found(r)) if !skip(&r.peer_id) => picked.push((i, r.clone())),
                    Some(_) => {}
                    None => missing.push((i, *id)),
                }
            }
        }
        let looked_up =
            futures_util::future::join_all(missing.into_iter().map(|(i, id)| async move {
                let (tx, rx) = oneshot::channel();
                let found = match self.commands.send(Command::Record(id, tx)).await {
                    Ok(()) => rx.await.ok().flatten(),
                    Err(_) => None,
                };
                (i, id, found)
            }))
            .await;
        let mut known = lock(&self.records);
        for (i, id, found) in looked_up {
            known.insert(id, found.clone(), now);
            if let Some(r) = found.filter(|r| !skip(&r.peer_id)) {
                picked.push((i, r));
            }
        }
        picked.sort_by_key(|(i, _)| *i);
        picked.into_iter().map(|(_, r)| r).collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The DHT addresses other nodes dial: the bound one, or, bound to every
/// interface (0.0.0.0, [::]), the peer plane's advertised addresses with the
/// DHT's port.
fn dht_addresses(bound: SocketAddr, peer_addresses: &str) -> Vec<SocketAddr> {
    if !bound.ip().is_unspecified() {
        return vec![bound];
    }
    peer_addresses
        .split(',')
        .filter_map(|a| a.trim().parse::<SocketAddr>().ok())
        .map(|a| SocketAddr::new(a.ip(), bound.port()))
        .collect()
}

/// A libp2p swarm of `behaviour` as the member `identity`: TCP, the
/// cluster's mutual TLS (counting its bytes in `traffic`, read and
/// written), yamux, a 10 s handshake deadline, and 5 minutes before an idle
/// connection closes.
pub fn member_swarm<B: libp2p::swarm::NetworkBehaviour>(
    identity: &Identity,
    traffic: (Counter, Counter),
    behaviour: B,
) -> Result<Swarm<B>> {
    let transport =
        libp2p::tcp::tokio::Transport::new(libp2p::tcp::Config::default().nodelay(true))
            .upgrade(libp2p::core::upgrade::Version::V1Lazy)
            .authenticate(tls::ClusterTls::new(identity, traffic)?)
            .multiplex(libp2p::yamux::Config::default())
            .timeout(Duration::from_secs(10))
            .boxed();
    let local = libp2p_id(&identity.peer_id);
    Ok(Swarm::new(
        transport,
        behaviour,
        local,
        libp2p::swarm::Config::with_tokio_executor()
            .with_idle_connection_timeout(Duration::from_secs(300)),
    ))
}

/// The libp2p address of a TCP socket address.
pub fn multiaddr_of(addr: SocketAddr) -> Multiaddr {
    Multiaddr::from(addr.ip()).with(Protocol::Tcp(addr.port()))
}

/// The TCP socket address of a libp2p address, if it is one.
pub fn socket_of(addr: &Multiaddr) -> Option<SocketAddr> {
    let mut parts = addr.iter();
    let ip = match parts.next()? {
        Protocol::Ip4(ip) => std::net::IpAddr::V4(ip),
        Protocol::Ip6(ip) => std::net::IpAddr::V6(ip),
        _ => return None,
    };
    match parts.next()? {
        Protocol::Tcp(port) => Some(SocketAddr::new(ip, port)),
        _ => None,
    }
}

/// The DHT's libp2p behaviour: Kademlia behind the connection caps.
#[derive(libp2p::swarm::NetworkBehaviour)]
struct Behaviour {
    // First: it must see every handshake end (`limits::PendingPerAddress`).
    per_address: limits::PendingPerAddress,
    limits: libp2p::connection_limits::Behaviour,
    kad: kad::Behaviour<BoundedStore>,
}

/// A bootstrap entry's addresses, as its lookup found them.
type Resolved = (String, Vec<SocketAddr>);

/// The pause before the next bootstrap round after one that found the
/// routing table holding `peers`: doubling while it holds any, up to
/// [`DIAL_EVERY_MAX`]; back to [`DIAL_EVERY`] once it is empty.
fn next_pause(pause: Duration, peers: usize) -> Duration {
    if peers == 0 {
        DIAL_EVERY
    } else {
        (pause * 2).min(DIAL_EVERY_MAX)
    }
}

/// The DHT's task: the libp2p swarm, and the queries it runs for the handle.
struct Runner {
    swarm: Swarm<Behaviour>,
    /// This node's record without its DHT addresses.
    me: NodeRecord,
    /// This node's record, once the listener is bound; published after
    /// every refresh.
    own: Option<Record>,
    bootstrap: Vec<String>,
    /// The bootstrap entries whose lookup is under way (one each at most:
    /// the resolver's own timeouts bound it).
    resolving: HashSet<String>,
    /// The pause after the last bootstrap round, and when the next is due.
    pause: Duration,
    next_round: Instant,
    /// The address listened on, once bound.
    bound: watch::Sender<Listening>,
    providers: HashMap<QueryId, (Providers, oneshot::Sender<Providers>)>,
    records: HashMap<QueryId, (PeerId, oneshot::Sender<Option<NodeRecord>>)>,
    /// Whether the own record went out since the routing table was empty.
    published: bool,
    /// Whether a provider list longer than a store keeps was logged.
    warned_oversize: bool,
    /// Whether a node record not of its sender was logged.
    warned_forged: bool,
    metrics: DhtMetrics,
}

impl Runner {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        // One message per lookup under way, at most one per bootstrap entry.
        let (found, mut resolved) = mpsc::unbounded_channel::<Resolved>();
        let mut tick = tokio::time::interval(DIAL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut purge = tokio::time::interval(PURGE_EVERY);
        purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                command = commands.recv() => match command {
                    Some(c) => self.on_command(c),
                    None => return,
                },
                event = self.swarm.select_next_some() => self.on_event(event),
                _ = tick.tick() => {
                    let peers = self.routing_peers();
                    self.metrics.peers.set(peers as i64);
                    let now = Instant::now();
                    if now >= self.next_round {
                        self.resolve_bootstrap(peers, &found);
                        self.refill(peers);
                        self.pause = next_pause(self.pause, peers);
                        self.next_round = now + self.pause;
                    }
                }
                Some((entry, addrs)) = resolved.recv() => {
                    self.resolving.remove(&entry);
                    self.dial_bootstrap(addrs);
                }
                _ = purge.tick() => self.purge(Instant::now()),
            }
        }
    }

    fn kad(&mut self) -> &mut kad::Behaviour<BoundedStore> {
        &mut self.swarm.behaviour_mut().kad
    }

    /// Drops the records expired at `now` from the store.
    fn purge(&mut self, now: Instant) {
        let store = self.kad().store_mut();
        let purged = store.purge(now);
        let (keys, _) = store.size();
        self.metrics.stored_keys.set(keys as i64);
        if purged > 0 {
            tracing::debug!(purged, keys, "purged expired DHT records");
        }
    }

    fn routing_peers(&mut self) -> usize {
        self.kad().kbuckets().map(|b| b.num_entries()).sum()
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Provide(key) => {
                if let Err(e) = self.kad().start_providing(key) {
                    tracing::warn!(error = %e, "the DHT cannot hold more provider records");
                }
            }
            Command::Withdraw(key) => self.kad().stop_providing(&key),
            Command::Providers(key, tx) => {
                let id = self.kad().get_providers(key);
                self.providers.insert(id, (Providers::default(), tx));
            }
            Command::Record(peer, tx) => {
                let id = self.kad().get_record(node_key(&peer));
                self.records.insert(id, (peer, tx));
            }
            Command::Routing(tx) => {
                let _ = tx.send(self.routing_peers());
            }
        }
    }

    /// Starts a lookup of each bootstrap entry not already being looked up,
    /// while the routing table (`peers`) is short: off this loop, so that a
    /// DNS server that never answers holds up no query.
    fn resolve_bootstrap(&mut self, peers: usize, found: &mpsc::UnboundedSender<Resolved>) {
        if peers >= ENOUGH_PEERS {
            return;
        }
        for entry in &self.bootstrap {
            if !self.resolving.insert(entry.clone()) {
                continue;
            }
            let (entry, found) = (entry.clone(), found.clone());
            tokio::spawn(async move {
                let addrs = match tokio::net::lookup_host(entry.as_str()).await {
                    Ok(addrs) => addrs.collect(),
                    Err(e) => {
                        tracing::debug!(%entry, error = %e, "a DHT bootstrap entry does not resolve");
                        Vec::new()
                    }
                };
                let _ = found.send((entry, addrs));
            });
        }
    }

    /// While the routing table holds some peers but fewer than
    /// [`ENOUGH_PEERS`], looks this node up again (Kademlia's bootstrap,
    /// which republishes its record at its end): members it does not know
    /// are dialled and enter its table, and its record reaches members
    /// that missed it. Kademlia adds a member that only dialled this node
    /// when its record arrives, so one lost put left that member unknown
    /// here until the next periodic bootstrap, a minute later.
    fn refill(&mut self, peers: usize) {
        if peers > 0 && peers < ENOUGH_PEERS && self.published {
            let _ = self.kad().bootstrap();
        }
    }

    /// Dials up to [`DIALS_PER_ROUND`] of the addresses a bootstrap entry
    /// resolved to, chosen at random, leaving out this node's own.
    fn dial_bootstrap(&mut self, mut addrs: Vec<SocketAddr>) {
        if let Listening::On(own) = *self.bound.borrow() {
            addrs.retain(|a| *a != own);
        }
        fastrand::shuffle(&mut addrs);
        for addr in addrs.into_iter().take(DIALS_PER_ROUND) {
            if let Err(e) = self.swarm.dial(multiaddr_of(addr)) {
                tracing::debug!(%addr, error = %e, "cannot dial a DHT bootstrap address");
            }
        }
    }

    /// Adds a member's DHT addresses, from its record, to the routing table.
    fn learn_addresses(&mut self, peer: &PeerId, node: &NodeRecord) {
        for a in &node.dht {
            self.kad().add_address(peer, multiaddr_of(*a));
        }
    }

    fn publish_own(&mut self) {
        let Some(own) = self.own.clone() else {
            return;
        };
        if let Err(e) = self.kad().put_record(own, Quorum::One) {
            tracing::warn!(error = %e, "cannot publish this node's DHT record");
        }
    }

    fn on_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::ConnectionEstablished {
                peer_id,
                endpoint: ConnectedPoint::Dialer { address, .. },
                ..
            } => {
                // Only members get this far (the TLS handshake): a node we
                // dialled is routable at the address we dialled.
                self.kad().add_address(&peer_id, address);
                if !std::mem::replace(&mut self.published, true) {
                    let _ = self.kad().bootstrap();
                    self.publish_own();
                }
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                let Some(addr) = socket_of(&address) else {
                    return;
                };
                if !matches!(*self.bound.borrow(), Listening::Pending) {
                    return;
                }
                tracing::info!(listening = %addr, peer = %self.swarm.local_peer_id(), "joined the DHT");
                self.bound.send_replace(Listening::On(addr));
                let mut me = self.me.clone();
                me.dht = dht_addresses(addr, &me.address);
                let value = serde_json::to_vec(&me).expect("a node record serializes");
                let mut own = Record::new(node_key(self.swarm.local_peer_id()), value);
                own.publisher = Some(*self.swarm.local_peer_id());
                if let Err(e) = self.kad().store_mut().put(own.clone()) {
                    tracing::error!(error = %e, "cannot keep this node's own DHT record");
                }
                self.own = Some(own);
                if self.published {
                    self.publish_own();
                }
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::error!(%error, "the DHT's listener failed");
                self.bound.send_if_modified(|l| {
                    let pending = matches!(l, Listening::Pending);
                    if pending {
                        *l = Listening::Failed(format!("{error:?}"));
                    }
                    pending
                });
            }
            SwarmEvent::ListenerClosed { reason, .. } => {
                let why = match reason {
                    Ok(()) => "closed".to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::error!(error = %why, "the DHT stopped listening");
                self.bound.send_replace(Listening::Closed(why));
            }
            SwarmEvent::IncomingConnectionError {
                error: libp2p::swarm::ListenError::Denied { cause },
                send_back_addr,
                ..
            } => {
                // At most one line a connection a flood opens, at debug.
                self.metrics.over_limit.inc();
                tracing::debug!(from = %send_back_addr, error = %cause, "closed a DHT connection over the limits");
            }
            SwarmEvent::IncomingConnectionError {
                error,
                send_back_addr,
                ..
            } => {
                self.metrics.refused.inc();
                tracing::warn!(from = %send_back_addr, error = %error, "refused a DHT connection");
            }
            SwarmEvent::OutgoingConnectionError { error, .. } => {
                tracing::debug!(error = %error, "a DHT dial failed");
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(event)) => self.on_kad(event),
            _ => {}
        }
    }

    fn on_kad(&mut self, event: kad::Event) {
        match event {
            kad::Event::InboundRequest { request } => self.on_inbound(request),
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => match result {
                QueryResult::GetProviders(found) => {
                    let local = *self.swarm.local_peer_id();
                    let Some((seen, _)) = self.providers.get_mut(&id) else {
                        return;
                    };
                    if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = found {
                        let max = DEFAULTS.dht_max_providers;
                        if providers.len() > max {
                            // No store keeps so many: a forged list, and no
                            // witness either (see `counts_itself`).
                            let extra = providers.len() - max;
                            self.metrics.ignored_providers.inc_by(extra as u64);
                            seen.ids.extend(providers.into_iter().take(max));
                            if !std::mem::replace(&mut self.warned_oversize, true) {
                                tracing::warn!(
                                    listed = max + extra,
                                    max,
                                    "a DHT member answered a provider list longer than any store keeps: took {max}, ignoring the rest (counted in dht_ignored_providers)"
                                );
                            }
                        } else {
                            // Other stores leave this node out: one that
                            // names it is its own, no witness.
                            if !providers.contains(&local) {
                                seen.answers.push(providers.len());
                            }
                            seen.ids.extend(providers);
                        }
                    }
                    if step.last
                        && let Some((seen, tx)) = self.providers.remove(&id)
                    {
                        let _ = tx.send(seen);
                    }
                }
                QueryResult::GetRecord(found) => {
                    let Some((peer, _)) = self.records.get(&id) else {
                        return;
                    };
                    let peer = *peer;
                    let (record, from) = match found {
                        Ok(GetRecordOk::FoundRecord(r)) => (node_record(&peer, &r.record), r.peer),
                        _ => (None, None),
                    };
                    // A third party's copy may name any address: only the
                    // node's own answer is taken, or this store's copy (kept
                    // only when the node sent it, `on_inbound`). Taking the
                    // first answer let a liar's forged record of every node
                    // win the race, and pullers dialled its address for an
                    // honest node for as long as the cache kept it
                    // (tests/hostile_dht.rs). The query goes on to the node.
                    let record = record.filter(|_| from.is_none() || from == Some(peer));
                    if let Some(node) = record.as_ref().filter(|_| from == Some(peer)) {
                        self.learn_addresses(&peer, node);
                    }
                    if record.is_some() || step.last {
                        if let Some((_, tx)) = self.records.remove(&id) {
                            let _ = tx.send(record);
                        }
                        if let Some(mut q) = self.kad().query_mut(&id) {
                            q.finish();
                        }
                    }
                }
                QueryResult::Bootstrap(_) if step.last => self.publish_own(),
                _ => {}
            },
            kad::Event::RoutingUpdated { peer, .. } => {
                tracing::debug!(%peer, "a DHT node joined the routing table");
                let peers = self.routing_peers();
                self.metrics.peers.set(peers as i64);
            }
            _ => {}
        }
    }

    /// Stores what a member sent, if it may: a provider record only of
    /// the sender itself (Kademlia checks that), a node record only of the
    /// sender itself and well formed.
    fn on_inbound(&mut self, request: kad::InboundRequest) {
        match request {
            kad::InboundRequest::AddProvider {
                record: Some(record),
            } => {
                let provider = record.provider;
                if let Err(e) = self.kad().store_mut().add_provider(record) {
                    self.metrics.refused_records.inc();
                    tracing::debug!(%provider, error = %e, "a DHT provider record was not kept");
                }
            }
            kad::InboundRequest::PutRecord {
                source,
                record: Some(record),
                ..
            } => {
                let Some(node) = node_record(&source, &record) else {
                    // A liar pushes one per node it forges: counted, and
                    // the first logged (naming its sender).
                    self.metrics.refused_records.inc();
                    if !std::mem::replace(&mut self.warned_forged, true) {
                        tracing::warn!(%source, "refused a DHT record that is not the sender's own node record (further ones counted in dht_refused_records, not logged)");
                    }
                    return;
                };
                // The sender may have only dialled us: now it is routable.
                self.learn_addresses(&source, &node);
                if let Err(e) = self.kad().store_mut().put(record) {
                    tracing::debug!(error = %e, "a DHT record was not kept");
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_rounds_back_off_while_the_routing_table_holds_peers() {
        let mut pause = DIAL_EVERY;
        let mut seen = Vec::new();
        for _ in 0..7 {
            pause = next_pause(pause, 3);
            seen.push(pause.as_secs());
        }
        assert_eq!(seen, [4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(next_pause(DIAL_EVERY_MAX, 0), DIAL_EVERY, "an empty table");
        assert_eq!(next_pause(DIAL_EVERY, 0), DIAL_EVERY);
    }

    #[test]
    fn a_node_record_is_taken_only_under_its_own_key_and_id() {
        let a = libp2p_id("node-a");
        let b = libp2p_id("node-b");
        assert_ne!(a, b);
        assert_eq!(a, libp2p_id("node-a"));
        let rec = |id: &str| {
            serde_json::to_vec(&NodeRecord {
                peer_id: id.into(),
                address: "127.0.0.1:7881".into(),
                dht: vec!["127.0.0.1:7882".parse().unwrap()],
            })
            .unwrap()
        };
        let good = Record::new(node_key(&a), rec("node-a"));
        assert_eq!(node_record(&a, &good).unwrap().peer_id, "node-a");
        // b speaking for a: under a's key, or naming a under its own key.
        assert!(node_record(&b, &good).is_none());
        assert!(node_record(&b, &Record::new(node_key(&b), rec("node-a"))).is_none());
        assert!(node_record(&a, &Record::new(node_key(&a), b"{".to_vec())).is_none());
        let big = Record::new(node_key(&a), vec![b' '; MAX_NODE_RECORD + 1]);
        assert!(node_record(&a, &big).is_none());
    }

    /// A handle on a DHT whose task is `answer` (a member's forged
    /// answers), and the node records it was asked for.
    fn handle_on(
        answer: impl Fn(&PeerId) -> Option<NodeRecord> + Send + 'static,
        listed: Vec<PeerId>,
    ) -> (Dht, Arc<Mutex<Vec<PeerId>>>) {
        let (commands, mut rx) = mpsc::channel(256);
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = asked.clone();
        tokio::spawn(async move {
            while let Some(c) = rx.recv().await {
                match c {
                    Command::Providers(_, tx) => {
                        let _ = tx.send(Providers {
                            ids: listed.iter().copied().collect(),
                            answers: Vec::new(),
                        });
                    }
                    Command::Record(id, tx) => {
                        seen.lock().unwrap().push(id);
                        let _ = tx.send(answer(&id));
                    }
                    _ => {}
                }
            }
        });
        let (_, listening) = watch::channel(Listening::Pending);
        let dht = Dht {
            commands,
            stop: Default::default(),
            local: libp2p_id("me"),
            overflow_list: overflow_list("me"),
            listening,
            records: Mutex::new(RecordCache::default()),
            provided: Mutex::new(HashSet::new()),
            config: DhtConfig::default(),
        };
        (dht, asked)
    }

    #[tokio::test]
    async fn a_forged_list_of_300_ids_costs_a_bounded_number_of_record_lookups() {
        let digest = BlobDigest::of(b"blob");
        let forged: Vec<PeerId> = (0..300).map(|_| PeerId::random()).collect();
        // No record matches a made-up id (the DHT task checks a record's
        // key and id, `node_record`): none is found.
        let (dht, asked) = handle_on(|_| None, forged);
        let watch = 8;
        let members = dht.members(&digest, Some(3), watch, |_| false).await;
        let asked_once = asked.lock().unwrap().len();
        assert!(
            asked_once <= FETCHERS + 2 * watch,
            "{asked_once} record lookups for one answer"
        );
        assert!(members.fetchers.is_empty() && members.others.is_empty());
        // The node is still a fetcher candidate: 300 ids do not push it out.
        assert!(members.listed && members.fetcher);
        // Ids found missing are not asked for again at the next lookup.
        dht.members(&digest, Some(3), watch, |_| false).await;
        assert!(asked.lock().unwrap().len() <= 2 * (FETCHERS + 2 * watch));
    }

    #[tokio::test]
    async fn fetcher_candidates_are_the_first_by_rank_whatever_the_list() {
        let digest = BlobDigest::of(b"blob");
        let names: Vec<String> = (0..40).map(|i| format!("node-{i}")).collect();
        let ids: Vec<PeerId> = names.iter().map(|n| libp2p_id(n)).collect();
        let by_id: HashMap<PeerId, String> = ids.iter().copied().zip(names.clone()).collect();
        let (dht, asked) = handle_on(
            move |id| {
                Some(NodeRecord {
                    peer_id: by_id.get(id)?.clone(),
                    address: "127.0.0.1:9".into(),
                    dht: Vec::new(),
                })
            },
            ids.clone(),
        );
        let members = dht.members(&digest, None, 4, |_| false).await;
        let mut all: Vec<(PeerId, &str)> = ids
            .iter()
            .copied()
            .zip(names.iter().map(String::as_str))
            .collect();
        all.push((libp2p_id("me"), "me"));
        all.sort_by_cached_key(|(id, _)| fetcher_rank(&digest, &id.to_bytes()));
        let first: Vec<&str> = all.iter().take(FETCHERS).map(|(_, n)| *n).collect();
        let mut got: Vec<&str> = members
            .fetchers
            .iter()
            .map(|r| r.peer_id.as_str())
            .collect();
        if members.fetcher {
            got.push("me");
        }
        got.sort();
        let mut want = first.clone();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(members.fetcher, first.contains(&"me"));
        assert!(asked.lock().unwrap().len() <= FETCHERS + 4);
        // A candidate gone for the pull makes room for the next.
        let gone = members.fetchers[0].peer_id.clone();
        let again = dht.members(&digest, None, 4, |p| p == gone).await;
        assert!(again.fetchers.iter().all(|r| r.peer_id != gone));
        assert_eq!(again.fetchers.len(), members.fetchers.len());
    }

    #[test]
    fn a_node_record_found_by_a_lookup_expires() {
        let id = libp2p_id("node-a");
        let forged = NodeRecord {
            peer_id: "node-a".into(),
            address: "203.0.113.9:7881".into(),
            dht: Vec::new(),
        };
        let mut cache = RecordCache::default();
        let now = Instant::now();
        cache.insert(id, Some(forged), now);
        assert!(matches!(cache.get(&id, now), Some(Known::Found(_))));
        assert!(
            cache.get(&id, now + RECORD_TTL).is_none(),
            "kept past its TTL"
        );
        let other = libp2p_id("node-b");
        cache.insert(other, None, now);
        assert!(matches!(cache.get(&other, now), Some(Known::Missing)));
        assert!(cache.get(&other, now + MISSING_TTL).is_none());
        // Expired entries leave the cache at the next insert.
        cache.insert(libp2p_id("node-c"), None, now + RECORD_TTL);
        assert_eq!(cache.0.len(), 1);
    }

    #[tokio::test]
    async fn a_dht_address_in_use_fails_the_start_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let id = crate::identity::ClusterCa::generate()
            .unwrap()
            .issue("a")
            .unwrap();
        let config = DhtConfig {
            listen: Some(addr),
            ..DhtConfig::default()
        };
        let joined = Dht::join(&id, &config, "127.0.0.1:7881".into(), DhtMetrics::default());
        let err = match joined {
            Err(e) => e,
            Ok(dht) => dht.listening().await.unwrap_err(),
        };
        assert!(
            err.to_string()
                .contains(&format!("the DHT cannot listen on {addr}")),
            "{err}"
        );
    }

    /// `Agent::kill` leaves the DHT as a crash would: with the handle still
    /// held, `stop` ends the task and its listener with it.
    #[tokio::test]
    async fn a_stopped_dht_closes_its_listener_while_its_handle_lives() {
        let id = crate::identity::ClusterCa::generate()
            .unwrap()
            .issue("a")
            .unwrap();
        let config = DhtConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..DhtConfig::default()
        };
        let dht = Dht::join(&id, &config, "127.0.0.1:7881".into(), DhtMetrics::default()).unwrap();
        let addr = dht.listening().await.unwrap();
        tokio::net::TcpStream::connect(addr)
            .await
            .expect("a running DHT accepts connections");
        dht.stop();
        let started = Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the DHT still listens on {addr} after stop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[test]
    fn a_dht_bound_to_every_interface_is_reached_at_the_advertised_addresses() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            dht_addresses(at("10.0.0.1:7882"), "10.0.0.1:7881"),
            [at("10.0.0.1:7882")]
        );
        assert_eq!(
            dht_addresses(at("[::]:7882"), "10.0.0.1:7881,[fd00::1]:7881"),
            [at("10.0.0.1:7882"), at("[fd00::1]:7882")]
        );
    }

    #[test]
    fn addresses_convert_both_ways_for_both_families() {
        for s in ["127.0.0.1:7882", "[::1]:7882"] {
            let addr: SocketAddr = s.parse().unwrap();
            assert_eq!(socket_of(&multiaddr_of(addr)), Some(addr));
        }
    }
}
