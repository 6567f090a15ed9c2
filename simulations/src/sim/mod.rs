//! The simulated cluster: nodes, the tracker, and what each strategy does when
//! a node starts, a flow ends, an announce is due or an idle node wakes up.
//!
//! `dray` nodes drive the real [`Scheduler`], one real [`ChunkPicker`] and
//! one real [`PullMachine`] per blob, as the agent does: announce (full,
//! then `Held::Added` deltas) every `announce_interval_s` (±10%) while
//! pulling and right after each registry run, hand each pull's machine the
//! tracker's answer and fetch the runs it starts chunk by chunk from the
//! registry, take the rest from the peers the tracker named, and poll the
//! machines on every chunk and every `poll_s` (their fallback rules). A
//! node sees a peer's chunks as its lanes do: the bitfield when it first
//! looks, then each chunk the peer gains (the long-polled bitfield), and
//! only the chunks whose hashes it has (its own, and the tracker's map as
//! of its last announce).
//!
//! This module holds the world (links, nodes, the tracker thread, the event
//! loop) and sets a run up; [`lifecycle`] starts and finishes nodes,
//! [`transfers`] moves chunks between peers, [`dray`] is the dray node model
//! (announces, runs, fallback), [`dht`] the dray node without a tracker
//! (DHT lookups, the shared rules of `dray_protocol::dht`), [`disturbances`]
//! the churn and outages a scenario injects, [`kraken`] the Kraken-like
//! baseline's peer graph.

mod dht;
mod disturbances;
mod dray;
mod kraken;
mod lifecycle;
mod registry;
mod transfers;

use crate::Strategy;
use crate::net::{Ev, FlowId, LinkId, Net, Payload, Purpose, Rng, Source, to_ns};
use crate::report::{Adversity, Fallbacks, Outcome, Samples, SimReport};
use crate::scenario::Scenario;
use crate::tracker::Tracker;
use dray_protocol::chunkmap::ChunkHash;
use dray_protocol::defaults::{DEFAULTS, announce_spread, secs};
use dray_protocol::peers::{Admit, Member, Roster, may_watch};
use dray_protocol::picker::{ChunkPicker, DEFAULT_WINDOW};
use dray_protocol::pull::{
    Action, ChunkRates, News, PullConfig, PullMachine, RunId, SilenceReports,
};
use dray_protocol::scheduler::{Announce, AnnounceDecision, BlobAnnounce, Held, SchedulerConfig};
use dray_protocol::{Bitfield, BlobDigest};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

struct BlobInfo {
    digest: BlobDigest,
    chunks: u32,
    bytes: u64,
}

/// A registry run the node's pull machine started (the tracker's, the DHT
/// coordinator's or the fallback's): its chunks are fetched in order.
struct RunState {
    id: RunId,
    blob: u16,
    /// The run's chunks this node claimed (not held or in flight from a peer).
    chunks: Vec<u32>,
    next: usize,
    flow: Option<FlowId>,
    /// Failed attempts of the current chunk's request that a server error failed.
    attempts: u32,
}

/// A chunk request to a frozen peer: sent, never answered.
#[derive(Clone, Copy, Debug)]
struct Hung {
    blob: u16,
    chunk: u32,
    peer: u32,
    /// Its deadline.
    due_ns: u64,
}

/// A simulated chunk carries no bytes: its content is its hash, the true
/// one or, from a liar, another; a node checks it with the agent's check
/// ([`dray_protocol::chunkmap::hash_matches`]).
const TRUE_HASH: ChunkHash = [0; 32];
const FORGED_HASH: ChunkHash = [0xff; 32];

/// A pull's timings and limits as the agent's defaults set them (without a
/// tracker configured, no tracker-silence rule).
fn pull_config(sc: &Scenario, strategy: Strategy) -> PullConfig {
    PullConfig {
        tracker_grace: if strategy == Strategy::DrayDht {
            Duration::MAX
        } else {
            Duration::from_secs_f64(sc.tracker_grace_s)
        },
        stall: Duration::from_secs_f64(sc.stall_s),
        patience: DEFAULTS.fetching_patience,
        run_chunks: DEFAULTS.run_chunks,
        registry_parallel: sc.registry_parallel,
    }
}

/// The tracker's ticker period.
fn tick_s() -> f64 {
    secs(DEFAULTS.tracker_tick_ms)
}

/// The origin every announce names: a scenario has one registry.
const REGISTRY_ORIGIN: &str = "registry";

/// What a node keeps with a known peer of a blob.
#[derive(Clone, Copy, Debug, Default)]
struct PeerView {
    /// The picker has a view of it.
    looked: bool,
    /// Chunk requests to it in flight: for dray at most
    /// `DEFAULTS.depth_per_peer`, the agent's lanes per peer.
    asked: u32,
}

struct NodeBlob {
    held: Bitfield,
    /// Chunks whose hashes this node has (its own, and what the tracker's map
    /// held at its last announce): it can verify, so fetch, only these from peers.
    known: Bitfield,
    picker: Option<ChunkPicker<u32>>,
    /// The pull machine of a dray node's pull of the blob, from its start:
    /// what the agent decides, decided by the agent's code.
    pull: Option<PullMachine>,
    /// Known peers, oldest first, each with whether the picker has a view
    /// of it yet (taken at the first look, then kept current by
    /// [`World::tell_watchers`] and [`World::learn_hashes`], as the agent's
    /// long-polled bitfields do). Rotated past `max_peers_per_blob` for dray
    /// as the agent's transfers do; the baselines keep every peer.
    peers: Roster<u32, PeerView>,
    /// Some peer in `peers` has not been looked at yet.
    unlooked: bool,
    /// Nodes that have this node as a known peer of the blob, and hear at
    /// once when it gains a chunk (the lanes' long-polled bitfields).
    watchers: Vec<u32>,
    /// Chunks verified since the last successful announce.
    added: Vec<u32>,
    complete: bool,
    /// Held chunks whose bytes fail their hash (taken only if the check is
    /// broken: a planted bug).
    bad: Bitfield,
    /// The rates of the last chunks from peers, for request deadlines.
    rates: ChunkRates,
    /// Peers the pull dropped as silent or too slow, reported to the
    /// tracker at once and again while the pull runs.
    silence: SilenceReports<u32>,
    /// Chunks that failed their hash, with their senders, not yet heard by
    /// the tracker (it could not be reached): sent at the next announce
    /// that reaches it, as the agent's transfers send them again.
    unreported: Vec<(u32, u32)>,
    /// The registry answered a request for it with the whole blob (said in
    /// its announces).
    whole_answer: bool,
}

struct Node {
    start: f64,
    started: bool,
    alive: bool,
    done_at: Option<f64>,
    blobs: Vec<NodeBlob>,
    /// Peer chunk downloads in flight.
    downloads: u32,
    in_flows: Vec<FlowId>,
    out_flows: Vec<FlowId>,
    announce_gen: u32,
    poll_at: Option<u64>,
    need_full: bool,
    /// Cut off from the tracker (a scenario's partition): its announces are lost.
    cut_off: bool,
    runs: Vec<RunState>,
    rotor: usize,
    /// When its registry token was taken (a scenario's `token_expiry`).
    token_at: f64,
    /// Where each whole-blob answer it keeps open stands, by blob (a
    /// registry that ignores `Range`; the agent's `OpenBodies`).
    kept: Vec<(u16, u32)>,
    /// Serves bytes that fail their hash for every chunk asked of it.
    liar: bool,
    /// A liar that sent some node a chunk, and one that some node banned.
    lied: bool,
    caught: bool,
    /// Stopped for good, its connections open (not `alive`).
    frozen: bool,
    /// Alive, pulling and announcing, and answering no chunk request.
    withholds: bool,
    /// Reports every peer the tracker names to it silent.
    accuses: bool,
    /// Alive, pulling and announcing, and answering every chunk request
    /// too slowly to meet its deadline, never silent.
    trickles: bool,
    /// Claims every chunk of every blob from its start (announces and
    /// bitfields: it counts as holding them) and answers no chunk request;
    /// it pulls nothing.
    claims: bool,
    /// Its disk is full: it pulls each blob whole from the registry, as
    /// containerd does past the agent's 502, and joins no swarm.
    disk_full: bool,
    /// Requests to frozen peers in flight.
    hung: Vec<Hung>,
}

struct World<'a> {
    sc: &'a Scenario,
    strategy: Strategy,
    net: Net,
    rng: Rng,
    nodes: Vec<Node>,
    /// Nodes that pull (origins of the kraken-like baseline come after them).
    pullers: u32,
    blobs: Vec<BlobInfo>,
    digest_index: HashMap<BlobDigest, u16>,
    /// The real scheduler, on its own thread: answers arrive a round trip
    /// after their announce (`Ev::Answer`), in the order asked.
    sched: Tracker,
    sched_config: SchedulerConfig,
    tracker_up: bool,
    base: Instant,
    names: Vec<String>,
    /// Nodes holding each complete blob (spegel-like).
    seeds: Vec<Vec<u32>>,
    /// The tracker's chunk map of each blob: the hashes published so far.
    published: Vec<Bitfield>,
    /// The tracker has a swarm for each blob: a full announce naming it
    /// reached it since it last started. Until then it refuses the blob's
    /// publications (the real tracker answers `MapForUnknownBlob`), so they
    /// are not in its map: a republication racing the first full announce
    /// after a restart is lost, and the full announce's own republication
    /// must still count (docs/results.md, "The chaos sweep": seed 896).
    tracked: Vec<bool>,
    /// Chunk uploads in flight, by node.
    uploads: Vec<u32>,
    /// Pullers neither done nor gone.
    pending: u32,
    samples: Samples,
    registry_link: LinkId,
    /// The DHT of a `dray-dht` run.
    dht: Option<dht::DhtWorld>,
    /// Escalations of pull machines' fallbacks.
    fallbacks: Fallbacks,
    /// What the adversaries and the rules against them did.
    adversity: Adversity,
}

/// Makes a node one kind of adversary.
type Mark = fn(&mut Node);
/// Where a run's count of one kind of adversary goes.
type Tally = fn(&mut Adversity) -> &mut u32;

impl Node {
    /// An adversary of any class (a frozen node is none: it is stopped).
    fn hostile(&self) -> bool {
        self.liar || self.accuses || self.withholds || self.trickles || self.claims
    }

    /// A frozen node, a withholder, a trickler or a claimer: a request to
    /// it is neither answered in time nor refused (its upload slots do not
    /// fill: it never says BUSY).
    fn hangs(&self) -> bool {
        self.frozen || self.withholds || self.trickles || self.claims
    }
}

impl World<'_> {
    fn up(&self, n: u32) -> LinkId {
        2 * n
    }
    fn down(&self, n: u32) -> LinkId {
        2 * n + 1
    }
    fn rack(&self, n: u32) -> Option<u32> {
        let r = self.sc.racks.as_ref()?;
        (n < self.pullers).then_some(n / r.nodes_per_rack)
    }
    fn rack_up(&self, r: u32) -> LinkId {
        2 * self.nodes.len() as u32 + 2 * r
    }

    /// The links a transfer from `from` to `to` crosses (at most 4), without
    /// an allocation: one is made per chunk.
    fn path(&self, from: Source, to: u32) -> ([LinkId; 4], usize) {
        let mut links = [0; 4];
        let mut n = 0;
        let mut push = |l| {
            links[n] = l;
            n += 1;
        };
        let to_rack = self.rack(to);
        match from {
            Source::Registry => push(self.registry_link),
            Source::Peer(p) => {
                push(self.up(p));
                let from_rack = self.rack(p);
                if from_rack != to_rack
                    && let Some(r) = from_rack
                {
                    push(self.rack_up(r));
                }
                if from_rack == to_rack {
                    push(self.down(to));
                    return (links, n);
                }
            }
        }
        if let Some(r) = to_rack {
            push(self.rack_up(r) + 1);
        }
        push(self.down(to));
        (links, n)
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.net.now_ns())
    }

    fn chunk_bytes(&self, blob: u16, chunk: u32) -> f64 {
        let info = &self.blobs[blob as usize];
        let first = u64::from(chunk) * self.sc.sim_chunk_bytes;
        (info.bytes - first.min(info.bytes)).min(self.sc.sim_chunk_bytes) as f64
    }

    /// What `n` can fetch from peer `p` of blob `b`: the chunks `p` holds
    /// whose hashes `n` knows.
    fn usable(&self, n: u32, b: usize, p: u32) -> Bitfield {
        let theirs = &self.nodes[p as usize].blobs[b].held;
        let known = &self.nodes[n as usize].blobs[b].known;
        let bytes: Vec<u8> = theirs
            .as_bytes()
            .iter()
            .zip(known.as_bytes())
            .map(|(t, k)| t & k)
            .collect();
        Bitfield::from_bytes(theirs.len(), &bytes).expect("same length as the peer's bitfield")
    }

    /// Gives `n`'s picker its first view of peer `p` (in `slot`).
    fn look(&mut self, n: u32, b: usize, slot: usize) {
        let Member { key: p, value } = self.nodes[n as usize].blobs[b].peers.live()[slot];
        if value.looked {
            return;
        }
        let bits = self.usable(n, b, p);
        let nb = &mut self.nodes[n as usize].blobs[b];
        nb.peers.live_mut()[slot].value.looked = true;
        if let Some(picker) = nb.picker.as_mut() {
            picker.set_peer(p, bits);
        }
    }

    /// `n` learned the hashes of `chunks` of blob `b`: what its peers hold of
    /// them becomes fetchable.
    fn learn_hashes(&mut self, n: u32, b: usize, chunks: &[u32]) {
        let nu = n as usize;
        for slot in 0..self.nodes[nu].blobs[b].peers.live().len() {
            let Member { key: p, value } = self.nodes[nu].blobs[b].peers.live()[slot];
            if !value.looked {
                continue;
            }
            for &c in chunks {
                if self.nodes[p as usize].blobs[b].held.get(c)
                    && let Some(picker) = self.nodes[nu].blobs[b].picker.as_mut()
                {
                    picker.peer_has(&p, c);
                }
            }
        }
    }

    /// Chunk `c` of blob `b`'s hash reaches the tracker's map (and its
    /// scheduler, as the tracker's publication handler tells it: a hash
    /// already in the map settles the chunk again, which changes nothing
    /// unless the blob's swarm formed anew).
    fn publish(&mut self, b: usize, c: u32) {
        if self.tracked[b] {
            self.published[b].set(c);
            let at = self.instant();
            self.sched.hash_settled(self.blobs[b].digest, c, at);
        }
    }

    fn start_flow(&mut self, mut payload: Payload, bytes: f64) -> FlowId {
        payload.asked_ns = self.net.now_ns();
        let (links, hops) = self.path(payload.from, payload.to);
        let sigma = self.sc.flow_weight_sigma;
        let weight = if sigma > 0.0 {
            self.rng.lognormal(sigma)
        } else {
            1.0
        };
        // Every transfer is a request: its first byte comes a round trip later.
        let id = self
            .net
            .start(payload, bytes, &links[..hops], self.sc.rtt_s, weight);
        self.nodes[payload.to as usize].in_flows.push(id);
        if let Source::Peer(p) = payload.from {
            self.nodes[p as usize].out_flows.push(id);
        }
        id
    }

    fn registry_chunk(&mut self, to: u32, blob: u16, chunk: u32, purpose: Purpose) -> FlowId {
        let bytes = self.registry_read_bytes(to, blob, chunk);
        let bytes = match purpose {
            Purpose::RunChunkCut => bytes / 2.0,
            _ => bytes,
        };
        let payload = Payload::new(to, Source::Registry, blob, chunk, purpose);
        self.start_flow(payload, bytes)
    }

    /// Whether what `n` sends the tracker now reaches it.
    fn reaches_tracker(&self, n: u32) -> bool {
        self.strategy == Strategy::Dray && self.tracker_up && !self.nodes[n as usize].cut_off
    }

    fn schedule_poll(&mut self, n: u32, secs: f64) {
        let at = self.net.now_ns().saturating_add(to_ns(secs));
        let node = &mut self.nodes[n as usize];
        if node.poll_at.is_some_and(|t| t <= at) {
            return;
        }
        node.poll_at = Some(at);
        self.net.after(secs, Ev::Poll(n));
    }

    fn schedule_announce(&mut self, n: u32, secs: f64) {
        let node = &mut self.nodes[n as usize];
        node.announce_gen = node.announce_gen.wrapping_add(1);
        let ev = Ev::Announce(n, node.announce_gen);
        self.net.after(secs, ev);
    }
}

fn fill(bits: &mut Bitfield) {
    for c in 0..bits.len() {
        bits.set(c);
    }
}

fn remove_item(v: &mut Vec<FlowId>, id: FlowId) {
    if let Some(k) = v.iter().position(|&x| x == id) {
        v.swap_remove(k);
    }
}

/// Runs one strategy on one scenario; the same seed gives the same report
/// (except `wall_s`).
pub(crate) fn simulate(sc: &Scenario, strategy: Strategy, seed: u64) -> SimReport {
    let wall = std::time::Instant::now();
    let mut rng = Rng::new(seed);
    let pullers = sc.nodes;
    let layers = sc.layers as usize;
    let layer_bytes = sc.layer_bytes();
    let chunks = layer_bytes.div_ceil(sc.sim_chunk_bytes) as u32;
    let blobs: Vec<BlobInfo> = (0..layers)
        .map(|b| BlobInfo {
            digest: BlobDigest::of(format!("{}/layer{b}", sc.name).as_bytes()),
            chunks,
            bytes: layer_bytes,
        })
        .collect();
    let origins = if strategy == Strategy::KrakenLike {
        layers as u32
    } else {
        0
    };
    let total = pullers + origins;
    let racks = sc
        .racks
        .as_ref()
        .map_or(0, |r| pullers.div_ceil(r.nodes_per_rack));
    let mut caps = Vec::with_capacity(2 * (total + racks) as usize + 1);
    for _ in 0..total {
        caps.push(sc.node_up_bps);
        caps.push(sc.node_down_bps);
    }
    if let Some(r) = &sc.racks {
        let uplink =
            f64::from(r.nodes_per_rack) * sc.node_up_bps.max(sc.node_down_bps) / r.oversubscription;
        for _ in 0..2 * racks {
            caps.push(uplink);
        }
    }
    let registry_link = caps.len() as LinkId;
    caps.push(sc.registry_bps);
    let window = if strategy == Strategy::KrakenLike {
        // Kraken picks rarest-first only, with no in-order window.
        0
    } else {
        DEFAULT_WINDOW
    };
    let uses_pickers = matches!(
        strategy,
        Strategy::Dray | Strategy::DrayDht | Strategy::KrakenLike
    );
    // dray without a tracker: its nodes take chunk hashes from peers, and
    // watch `max_peers_per_blob` as with a tracker.
    let swarming = matches!(strategy, Strategy::Dray | Strategy::DrayDht);
    let base = Instant::now();
    let nodes: Vec<Node> = (0..total)
        .map(|_| Node {
            start: 0.0,
            started: false,
            alive: true,
            done_at: None,
            blobs: (0..layers)
                .map(|_| NodeBlob {
                    held: Bitfield::new(chunks),
                    // Only dray learns hashes as registry fetchers publish
                    // them; the baselines' nodes have the whole map up front.
                    known: {
                        let mut known = Bitfield::new(chunks);
                        if strategy != Strategy::Dray {
                            fill(&mut known);
                        }
                        known
                    },
                    picker: uses_pickers.then(|| ChunkPicker::new(Bitfield::new(chunks), window)),
                    pull: None,
                    peers: Roster::new(swarming.then_some(sc.max_peers_per_blob)),
                    unlooked: false,
                    watchers: Vec::new(),
                    added: Vec::new(),
                    complete: false,
                    bad: Bitfield::new(chunks),
                    rates: ChunkRates::default(),
                    silence: SilenceReports::default(),
                    unreported: Vec::new(),
                    whole_answer: false,
                })
                .collect(),
            downloads: 0,
            in_flows: Vec::new(),
            out_flows: Vec::new(),
            announce_gen: 0,
            poll_at: None,
            need_full: true,
            cut_off: false,
            runs: Vec::new(),
            rotor: 0,
            token_at: 0.0,
            kept: Vec::new(),
            liar: false,
            withholds: false,
            accuses: false,
            trickles: false,
            claims: false,
            disk_full: false,
            lied: false,
            caught: false,
            frozen: false,
            hung: Vec::new(),
        })
        .collect();
    let sched_config = SchedulerConfig::default();
    let lower = sc.lower_bound_s();
    let mut w = World {
        sc,
        strategy,
        net: Net::new(caps, registry_link),
        rng: Rng::new(rng.next_u64()),
        nodes,
        pullers,
        digest_index: blobs
            .iter()
            .enumerate()
            .map(|(b, info)| (info.digest, b as u16))
            .collect(),
        blobs,
        sched: Tracker::new(sched_config.clone()),
        sched_config,
        tracker_up: strategy != Strategy::DrayDht,
        base,
        names: (0..total).map(|n| format!("n{n}")).collect(),
        seeds: vec![Vec::new(); layers],
        published: vec![Bitfield::new(chunks); layers],
        tracked: vec![false; layers],
        pending: pullers,
        uploads: vec![0; total as usize],
        samples: Samples::new(lower / 64.0),
        registry_link,
        dht: (strategy == Strategy::DrayDht).then(|| dht::DhtWorld::new(total, layers, &mut rng)),
        fallbacks: Fallbacks::default(),
        adversity: Adversity::default(),
    };

    // Late joiners are a random subset; everyone else starts at 0.
    let mut order: Vec<u32> = (0..pullers).collect();
    rng.shuffle(&mut order);
    let late = sc
        .late_joiners
        .as_ref()
        .map_or(0, |l| (l.fraction * f64::from(pullers)).round() as usize);
    let mut last_start: f64 = 0.0;
    for (k, &n) in order.iter().enumerate() {
        let at = match &sc.late_joiners {
            Some(l) if k < late => l.at_s,
            _ => 0.0,
        };
        last_start = last_start.max(at);
        w.nodes[n as usize].start = at;
        w.net.at_secs(at, Ev::Start(n));
    }
    if let Some(f) = sc.liars {
        rng.shuffle(&mut order);
        let count = (f * f64::from(pullers)).round() as usize;
        for &n in &order[..count] {
            w.nodes[n as usize].liar = true;
        }
        w.adversity.liars = count as u32;
    }
    // Withholders, accusers, tricklers, claimers, then full disks: a share
    // of the nodes each, none of them chosen already.
    let adversaries: [(Option<f64>, Mark, Tally); 5] = [
        (
            sc.withholders,
            |node| node.withholds = true,
            |a| &mut a.withholders,
        ),
        (sc.accusers, |node| node.accuses = true, |a| &mut a.accusers),
        (
            sc.tricklers,
            |node| node.trickles = true,
            |a| &mut a.tricklers,
        ),
        (sc.claimers, |node| node.claims = true, |a| &mut a.claimers),
        (
            sc.disk_full,
            |node| node.disk_full = true,
            |a| &mut a.disk_full,
        ),
    ];
    for (fraction, mark, tally) in adversaries {
        let Some(f) = fraction else {
            continue;
        };
        rng.shuffle(&mut order);
        let count = (f * f64::from(pullers)).round() as usize;
        let chosen: Vec<u32> = order
            .iter()
            .copied()
            .filter(|&n| {
                let node = &w.nodes[n as usize];
                !(node.hostile() || node.disk_full)
            })
            .take(count)
            .collect();
        for &n in &chosen {
            mark(&mut w.nodes[n as usize]);
        }
        *tally(&mut w.adversity) = chosen.len() as u32;
    }
    if let Some(f) = &sc.freeze {
        w.net.at_secs(f.at_s, Ev::Freeze);
    }
    if strategy == Strategy::KrakenLike {
        kraken::build_kraken_graph(&mut w, origins);
    }
    if strategy == Strategy::Dray {
        w.net.at_secs(tick_s(), Ev::Tick);
        if let Some(o) = &sc.outage {
            w.net.at_secs(o.at_s, Ev::OutageStart);
            w.net.at_secs(o.at_s + o.for_s, Ev::OutageEnd);
        }
        if let Some(h) = &sc.hang {
            w.net.at_secs(h.at_s, Ev::HangStart);
            w.net.at_secs(h.at_s + h.for_s, Ev::HangEnd);
        }
        if let Some(p) = &sc.partition {
            w.net.at_secs(p.at_s, Ev::Partition(true));
            w.net.at_secs(p.at_s + p.for_s, Ev::Partition(false));
        }
    }
    if let Some(c) = &sc.churn {
        w.net.at_secs(c.at_s, Ev::Churn);
    }
    w.net.at_secs(0.0, Ev::Sample);

    // Direct and spegel-like can legitimately take N times the bound; the
    // swarming strategies get a generous multiple before we call them stuck.
    let limit = match strategy {
        Strategy::Direct | Strategy::SpegelLike => lower * (2.0 * f64::from(pullers) + 100.0),
        Strategy::Dray | Strategy::DrayDht | Strategy::KrakenLike => lower * 100.0 + 600.0,
    } + last_start;
    let limit_ns = (limit * 1e9).min(u64::MAX as f64) as u64;
    while w.pending > 0 {
        let Some(ev) = w.net.pop() else {
            break;
        };
        if w.net.now_ns() > limit_ns {
            break;
        }
        w.handle(ev);
    }
    let end = w.net.now();
    let registry_bytes = w.net.registry_bytes_now();
    w.samples.finish(end, registry_bytes);

    let mut times: Vec<f64> = Vec::new();
    let mut left = 0;
    let banned = w.sched.banned();
    w.adversity.honest_banned = w
        .names
        .iter()
        .zip(&w.nodes)
        .filter(|(name, n)| !n.hostile() && banned.contains(name))
        .count() as u32;
    for n in w.nodes[..pullers as usize].iter().filter(|n| !n.liar) {
        w.adversity.bad_chunks += n
            .blobs
            .iter()
            .map(|b| u64::from(b.bad.count()))
            .sum::<u64>();
    }
    // A claimer pulls nothing: neither a completion (nor one at its start
    // in the percentiles) nor a node that left.
    for n in w.nodes[..pullers as usize].iter().filter(|n| !n.claims) {
        if !n.alive {
            left += 1;
        } else if let Some(d) = n.done_at {
            times.push(d - n.start);
        }
    }
    SimReport::new(
        sc,
        Outcome {
            strategy,
            seed,
            times,
            left,
            registry_bytes,
            end,
            events: w.net.events,
            fallbacks: w.fallbacks,
            samples: w.samples,
            wall_s: wall.elapsed().as_secs_f64(),
            dht: w.dht.as_ref().map(|d| d.report(sc)),
            adversity: w.adversity,
        },
    )
}
