//! The simulated cluster: nodes, the tracker, and what each strategy does when
//! a node starts, a flow ends, an announce is due or an idle node wakes up.
//!
//! `dray` nodes drive the real [`Scheduler`] and one real [`ChunkPicker`] per
//! blob, as the agent does: announce (full, then `Held::Added` deltas) every
//! `announce_interval_s` (±10%) while pulling and right after each registry
//! run, fetch assigned runs chunk by chunk from the registry, take the rest
//! from the peers the tracker named, and fall back to the registry (see
//! [`Fallback`]) after a stall or while the tracker is silent. A node sees
//! a peer's chunks as its lanes do: the bitfield when it first looks, then
//! each chunk the peer gains (the long-polled bitfield), and only the chunks
//! whose hashes it has (its own, and the tracker's map as of its last
//! announce).

use crate::Strategy;
use crate::net::{Ev, FlowId, LinkId, Net, Payload, Purpose, Rng, Source, to_ns};
use crate::report::{Outcome, Samples, SimReport};
use crate::scenario::Scenario;
use crate::tracker::Tracker;
use dray_protocol::defaults::{DEFAULTS, secs};
use dray_protocol::picker::{ChunkPicker, DEFAULT_WINDOW};
use dray_protocol::pull::{Fallback, FallbackRule};
use dray_protocol::scheduler::{Announce, AnnounceDecision, BlobAnnounce, Held, SchedulerConfig};
use dray_protocol::{Bitfield, BlobDigest};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

struct BlobInfo {
    digest: BlobDigest,
    chunks: u32,
    bytes: u64,
}

/// A registry run the tracker gave a node: its chunks are fetched in order.
struct RunState {
    blob: u16,
    first: u32,
    /// The run's chunks this node claimed (not held or in flight from a peer).
    chunks: Vec<u32>,
    next: usize,
    flow: Option<FlowId>,
}

/// A node's fallback rules as the agent runs them, starting at `now`.
fn fallback_rule(sc: &Scenario, now: Instant) -> FallbackRule {
    FallbackRule::new(
        now,
        false,
        Duration::from_secs_f64(sc.tracker_grace_s),
        Duration::from_secs_f64(sc.stall_s),
        DEFAULTS.fetching_patience,
    )
}

/// The tracker's ticker period.
fn tick_s() -> f64 {
    secs(DEFAULTS.tracker_tick_ms)
}

/// The origin every announce names: a scenario has one registry.
const REGISTRY_ORIGIN: &str = "registry";

/// A peer a node knows for a blob.
#[derive(Clone, Copy)]
struct KnownPeer {
    node: u32,
    /// Whether the picker has a view of it yet (taken at the first look,
    /// then kept current by [`World::tell_watchers`] and
    /// [`World::learn_hashes`], as the agent's long-polled bitfields do).
    looked: bool,
}

struct NodeBlob {
    held: Bitfield,
    /// Chunks whose hashes this node has (its own, and what the tracker's map
    /// held at its last announce): it can verify, so fetch, only these from peers.
    known: Bitfield,
    picker: Option<ChunkPicker<u32>>,
    /// Known peers, oldest first.
    peers: Vec<KnownPeer>,
    /// Some peer in `peers` has not been looked at yet.
    unlooked: bool,
    /// Nodes that have this node as a known peer of the blob, and hear at
    /// once when it gains a chunk (the lanes' long-polled bitfields).
    watchers: Vec<u32>,
    /// Chunks verified since the last successful announce.
    added: Vec<u32>,
    complete: bool,
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
    /// The agent's fallback rules, in one node-wide state (the agent keeps
    /// one per blob; a scenario's node pulls its layers together).
    fallback: FallbackRule,
    need_full: bool,
    runs: Vec<RunState>,
    /// Registry fetches of the fallback in flight.
    fallback_flows: Vec<FlowId>,
    rotor: usize,
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
    /// Chunk uploads in flight, by node.
    uploads: Vec<u32>,
    /// Pullers neither done nor gone.
    pending: u32,
    samples: Samples,
    registry_link: LinkId,
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
        let KnownPeer { node: p, looked } = self.nodes[n as usize].blobs[b].peers[slot];
        if looked {
            return;
        }
        let bits = self.usable(n, b, p);
        let nb = &mut self.nodes[n as usize].blobs[b];
        nb.peers[slot].looked = true;
        if let Some(picker) = nb.picker.as_mut() {
            picker.set_peer(p, bits);
        }
    }

    /// `n` learned the hashes of `chunks` of blob `b`: what its peers hold of
    /// them becomes fetchable.
    fn learn_hashes(&mut self, n: u32, b: usize, chunks: &[u32]) {
        let nu = n as usize;
        for slot in 0..self.nodes[nu].blobs[b].peers.len() {
            let KnownPeer { node: p, looked } = self.nodes[nu].blobs[b].peers[slot];
            if !looked {
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
    /// scheduler, as the tracker's publication handler tells it).
    fn publish(&mut self, b: usize, c: u32) {
        if self.published[b].set(c) {
            let at = self.instant();
            self.sched.hash_settled(self.blobs[b].digest, c, at);
        }
    }

    fn start_flow(&mut self, payload: Payload, bytes: f64) -> FlowId {
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
        let bytes = self.chunk_bytes(blob, chunk);
        let payload = Payload {
            to,
            from: Source::Registry,
            blob,
            chunk,
            purpose,
        };
        self.start_flow(payload, bytes)
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

    // ---- node lifecycle ---------------------------------------------------

    fn start_node(&mut self, n: u32) {
        let (sc, instant) = (self.sc, self.instant());
        let node = &mut self.nodes[n as usize];
        if node.started || !node.alive {
            return;
        }
        node.started = true;
        node.fallback = fallback_rule(sc, instant);
        match self.strategy {
            Strategy::Dray => {
                self.nodes[n as usize].need_full = true;
                self.announce(n);
            }
            Strategy::KrakenLike => self.try_fill(n),
            Strategy::Direct | Strategy::SpegelLike => {
                for b in 0..self.blobs.len() as u16 {
                    let bytes = self.blobs[b as usize].bytes as f64;
                    self.fetch_whole(n, b, bytes);
                }
            }
        }
    }

    /// Direct and spegel-like: the whole blob from a complete holder if
    /// spegel-like and one exists, else from the registry.
    fn fetch_whole(&mut self, n: u32, blob: u16, bytes: f64) {
        let mut from = Source::Registry;
        if self.strategy == Strategy::SpegelLike {
            let seeds = &mut self.seeds[blob as usize];
            while !seeds.is_empty() {
                let k = self.rng.below(seeds.len());
                let s = seeds[k];
                if self.nodes[s as usize].alive {
                    from = Source::Peer(s);
                    break;
                }
                seeds.swap_remove(k);
            }
        }
        if let Source::Peer(s) = from {
            self.uploads[s as usize] += 1;
        }
        let payload = Payload {
            to: n,
            from,
            blob,
            chunk: 0,
            purpose: Purpose::Whole,
        };
        self.start_flow(payload, bytes);
    }

    /// A chunk (or, for whole-blob strategies, a blob) arrived at `n`.
    fn receive(&mut self, n: u32, blob: u16, chunk: Option<u32>) {
        let now = self.net.now();
        let at = self.instant();
        let node = &mut self.nodes[n as usize];
        node.fallback.arrived(at);
        let nb = &mut node.blobs[blob as usize];
        match chunk {
            Some(c) => {
                if !nb.held.set(c) {
                    return;
                }
                nb.known.set(c);
                if let Some(p) = nb.picker.as_mut() {
                    p.completed(c);
                }
                nb.added.push(c);
                self.tell_watchers(n, blob, c);
            }
            None => {
                fill(&mut nb.held);
                for c in 0..nb.held.len() {
                    self.tell_watchers(n, blob, c);
                }
            }
        }
        let nb = &mut self.nodes[n as usize].blobs[blob as usize];
        if !nb.held.is_full() || nb.complete {
            return;
        }
        nb.complete = true;
        nb.picker = None;
        nb.peers = Vec::new();
        if self.strategy == Strategy::SpegelLike {
            self.seeds[blob as usize].push(n);
        }
        let node = &mut self.nodes[n as usize];
        if node.done_at.is_none() && node.blobs.iter().all(|b| b.complete) && n < self.pullers {
            node.done_at = Some(now);
            self.pending -= 1;
            if self.strategy == Strategy::Dray {
                // Publish the whole map, and tell the tracker at once: the node
                // now seeds instead of wanting.
                for b in 0..self.blobs.len() {
                    if !self.published[b].is_full() {
                        for c in 0..self.published[b].len() {
                            self.publish(b, c);
                        }
                    }
                    fill(&mut self.nodes[n as usize].blobs[b].known);
                }
                self.schedule_announce(n, 0.0);
            }
        }
    }

    /// `n` gained chunk `c` of `blob`: each watcher that can verify it adds
    /// it to its view of `n`, and an idle one that lacks it looks for work
    /// after half a round trip.
    fn tell_watchers(&mut self, n: u32, blob: u16, c: u32) {
        let max_down = self.sc.max_downloads;
        let b = blob as usize;
        for k in 0..self.nodes[n as usize].blobs[b].watchers.len() {
            let w = self.nodes[n as usize].blobs[b].watchers[k];
            let node = &mut self.nodes[w as usize];
            if !node.alive {
                continue;
            }
            let idle = node.done_at.is_none() && node.downloads < max_down;
            let nb = &mut node.blobs[b];
            if !nb.known.get(c) || nb.held.get(c) {
                continue;
            }
            let Some(picker) = nb.picker.as_mut() else {
                continue;
            };
            picker.peer_has(&n, c);
            // A chunk already on its way from elsewhere gives no new work.
            if idle && picker.is_unclaimed(c) {
                self.schedule_poll(w, self.sc.rtt_s / 2.0);
            }
        }
    }

    fn flow_done(&mut self, id: FlowId) {
        let (p, _) = self.net.remove(id);
        let to = p.to;
        let node = &mut self.nodes[to as usize];
        remove_item(&mut node.in_flows, id);
        if let Source::Peer(s) = p.from {
            let sender = &mut self.nodes[s as usize];
            remove_item(&mut sender.out_flows, id);
            self.uploads[s as usize] = self.uploads[s as usize].saturating_sub(1);
        }
        match p.purpose {
            Purpose::Whole => self.receive(to, p.blob, None),
            Purpose::PeerChunk => {
                self.nodes[to as usize].downloads -= 1;
                self.receive(to, p.blob, Some(p.chunk));
            }
            Purpose::RunChunk => {
                // The fetcher publishes the chunk's hash to the tracker.
                self.publish(p.blob as usize, p.chunk);
                self.receive(to, p.blob, Some(p.chunk));
                if let Some(k) = self.nodes[to as usize]
                    .runs
                    .iter()
                    .position(|r| r.flow == Some(id))
                {
                    let run = &mut self.nodes[to as usize].runs[k];
                    run.flow = None;
                    run.next += 1;
                    self.advance_run(to, k);
                }
            }
            Purpose::FallbackChunk => {
                remove_item(&mut self.nodes[to as usize].fallback_flows, id);
                // Published as a run's chunk is, if the tracker is there to hear it.
                if self.tracker_up {
                    self.publish(p.blob as usize, p.chunk);
                }
                self.receive(to, p.blob, Some(p.chunk));
                self.continue_fallback(to);
            }
        }
        if matches!(self.strategy, Strategy::Dray | Strategy::KrakenLike) {
            self.try_fill(to);
        }
    }

    // ---- peer transfers ---------------------------------------------------

    /// Fills `n`'s free download slots with chunks its picker chooses from
    /// known peers that have a free upload slot.
    fn try_fill(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive || !self.nodes[nu].started || self.nodes[nu].done_at.is_some() {
            return;
        }
        let max_down = self.sc.max_downloads;
        let max_up = self.sc.max_uploads;
        let nblobs = self.blobs.len();
        let mut busy = false;
        let rotor = self.nodes[nu].rotor;
        self.nodes[nu].rotor = rotor.wrapping_add(1);
        'blobs: for k in 0..nblobs {
            let b = (rotor + k) % nblobs;
            if self.nodes[nu].blobs[b].picker.is_none() {
                continue;
            }
            // A dray lane asks a new peer for its bitfield first thing.
            self.look_all(n, b);
            if !self.nodes[nu].blobs[b]
                .picker
                .as_ref()
                .is_some_and(|p| p.offers_any())
            {
                continue;
            }
            let npeers = self.nodes[nu].blobs[b].peers.len();
            let mut gone = Vec::new();
            for step in 0..npeers {
                if self.nodes[nu].downloads >= max_down {
                    break 'blobs;
                }
                let slot = (rotor + step) % npeers;
                let p = self.nodes[nu].blobs[b].peers[slot].node;
                let pu = p as usize;
                // Upload counts sit in one dense array: most peers of a busy
                // swarm are busy, and this is the hot check.
                if self.uploads[pu] >= max_up {
                    // The agent's request would be refused BUSY.
                    busy = true;
                    continue;
                }
                if !self.nodes[pu].alive {
                    gone.push(p);
                    continue;
                }
                while self.nodes[nu].downloads < max_down && self.uploads[pu] < max_up {
                    let Some(c) = self.nodes[nu].blobs[b]
                        .picker
                        .as_mut()
                        .and_then(|picker| picker.pick(&p))
                    else {
                        break;
                    };
                    self.nodes[nu].downloads += 1;
                    self.uploads[pu] += 1;
                    let bytes = self.chunk_bytes(b as u16, c);
                    let payload = Payload {
                        to: n,
                        from: Source::Peer(p),
                        blob: b as u16,
                        chunk: c,
                        purpose: Purpose::PeerChunk,
                    };
                    self.start_flow(payload, bytes);
                }
            }
            for p in gone {
                self.drop_peer(n, b, p);
            }
        }
        if self.nodes[nu].downloads < max_down {
            // A lane refused BUSY tries again after the agent's back-off.
            let wait = if busy {
                self.sc.busy_backoff_s
            } else {
                self.sc.poll_s
            };
            self.schedule_poll(n, wait);
        }
    }

    /// Forgets a peer that left; the kraken-like graph gets a random live
    /// replacement, as Kraken's tracker would hand out.
    fn drop_peer(&mut self, n: u32, b: usize, p: u32) {
        let nb = &mut self.nodes[n as usize].blobs[b];
        let Some(slot) = nb.peers.iter().position(|q| q.node == p) else {
            return;
        };
        nb.peers.remove(slot);
        if let Some(picker) = nb.picker.as_mut() {
            picker.remove_peer(&p);
        }
        self.unwatch(n, b, p);
        if self.strategy == Strategy::KrakenLike {
            for _ in 0..8 {
                let q = self.rng.below(self.pullers as usize) as u32;
                let known = self.nodes[n as usize].blobs[b]
                    .peers
                    .iter()
                    .any(|x| x.node == q);
                if q != n && self.nodes[q as usize].alive && !known {
                    self.add_peer(n, b, q);
                    break;
                }
            }
        }
    }

    // ---- dray: tracker, runs, fallback -------------------------------------

    fn announce(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive {
            return;
        }
        let pulling = self.nodes[nu].done_at.is_none();
        let every = if pulling {
            self.sc.announce_interval_s
        } else {
            self.sched_config.announce_interval.as_secs_f64()
        };
        // The agent spreads its announces (±10%), so that nodes started
        // together do not all reach the tracker, or learn its news, at once.
        let every = every * (0.9 + 0.2 * self.rng.unit());
        self.schedule_announce(n, every);
        if !self.tracker_up {
            return;
        }
        self.send_announce(n);
    }

    /// Sends `n`'s announce (full if the tracker asked for one, else what
    /// it gained since); the answer comes a round trip later.
    fn send_announce(&mut self, n: u32) {
        let nu = n as usize;
        let full = self.nodes[nu].need_full;
        let blobs = (0..self.blobs.len())
            .map(|b| {
                let info = &self.blobs[b];
                let nb = &mut self.nodes[nu].blobs[b];
                let held = if full {
                    nb.added.clear();
                    Held::Bits(nb.held.clone())
                } else {
                    Held::Added(std::mem::take(&mut nb.added))
                };
                BlobAnnounce {
                    digest: info.digest,
                    chunk_count: info.chunks,
                    size: info.bytes,
                    chunk_size: 0,
                    held,
                    wanted: !nb.complete,
                    // Every blob comes from the one registry.
                    origin: REGISTRY_ORIGIN.to_owned(),
                }
            })
            .collect();
        let mut labels = BTreeMap::new();
        if let Some(r) = self.rack(n) {
            labels.insert("rack".to_owned(), r.to_string());
        }
        let a = Announce {
            peer: self.names[nu].clone(),
            address: String::new(),
            upload_bytes_per_s: self.sc.node_up_bps as u64,
            active_uploads: self.uploads[nu],
            labels,
            blobs,
            full,
        };
        self.sched.announce(a, self.instant());
        self.net.after(self.sc.rtt_s, Ev::Answer(n, full));
    }

    /// The tracker's answer to `n`'s announce (`full` if it was) arrives.
    fn answered(&mut self, n: u32, full: bool) {
        let nu = n as usize;
        let d = self.sched.answer();
        // Lost with the connection if the tracker or the node went down.
        if !self.tracker_up || !self.nodes[nu].alive {
            return;
        }
        let at = self.instant();
        // A registry fetch under way is not a stall (within patience).
        if self.nodes[nu]
            .fallback
            .tracker_answered(at, !d.fetching.is_empty())
        {
            self.end_tracker_fallback(n);
        }
        if d.resend_full {
            // A restarted tracker asks for a full announce; send it straight away.
            self.nodes[nu].need_full = true;
            self.send_announce(n);
            return;
        }
        if full {
            self.nodes[nu].need_full = false;
        }
        // The answer carries the tracker's maps of the wanted blobs; a full
        // announce republishes the hashes of the chunks the node holds
        // (after a restart the tracker has none: without them, chunks only
        // partial holders have could never be verified by anyone else).
        for b in 0..self.blobs.len() {
            if full {
                let held: Vec<u32> = self.nodes[nu].blobs[b].held.ones().collect();
                for c in held {
                    self.publish(b, c);
                }
            }
            let nb = &mut self.nodes[nu].blobs[b];
            if !nb.complete {
                let fresh: Vec<u32> = self.published[b]
                    .ones()
                    .filter(|&c| nb.known.set(c))
                    .collect();
                if !fresh.is_empty() {
                    self.learn_hashes(n, b, &fresh);
                }
            }
        }
        self.apply_decision(n, d);
        self.try_fill(n);
    }

    fn apply_decision(&mut self, n: u32, d: AnnounceDecision) {
        let nu = n as usize;
        for (digest, contacts) in &d.peers {
            let Some(&b) = self.digest_index.get(digest) else {
                continue;
            };
            for c in contacts {
                let Some(p) = c.peer.strip_prefix('n').and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if p == n || p as usize >= self.nodes.len() {
                    continue;
                }
                self.learn_peer(n, b as usize, p);
            }
        }
        let wanted: Vec<(u16, u32, u32)> = d
            .assignments
            .iter()
            .filter_map(|a| {
                let b = *self.digest_index.get(&a.digest)?;
                Some((b, a.first, a.count))
            })
            .collect();
        // Runs missing from the answer were taken back: stop fetching them.
        let mut k = 0;
        while k < self.nodes[nu].runs.len() {
            let r = &self.nodes[nu].runs[k];
            if wanted.iter().any(|&(b, f, _)| b == r.blob && f == r.first) {
                k += 1;
                continue;
            }
            let run = self.nodes[nu].runs.swap_remove(k);
            self.release_run(n, run);
        }
        for (b, first, count) in wanted {
            if self.nodes[nu]
                .runs
                .iter()
                .any(|r| r.blob == b && r.first == first)
            {
                continue;
            }
            let nb = &mut self.nodes[nu].blobs[b as usize];
            let chunks = match nb.picker.as_mut() {
                Some(p) => (first..first.saturating_add(count))
                    .filter(|&c| p.claim(c))
                    .collect(),
                None => Vec::new(),
            };
            self.nodes[nu].runs.push(RunState {
                blob: b,
                first,
                chunks,
                next: 0,
                flow: None,
            });
            let k = self.nodes[nu].runs.len() - 1;
            self.advance_run(n, k);
        }
    }

    fn learn_peer(&mut self, n: u32, b: usize, p: u32) {
        let nb = &self.nodes[n as usize].blobs[b];
        if nb.picker.is_none() || nb.peers.iter().any(|q| q.node == p) {
            return;
        }
        // A peer watched by as many as it serves answers BUSY, and is dropped.
        if self.nodes[p as usize].blobs[b].watchers.len() >= self.sc.max_watchers_per_blob {
            return;
        }
        let nb = &self.nodes[n as usize].blobs[b];
        if nb.peers.len() >= self.sc.max_peers_per_blob {
            // The oldest peer goes; what it offered, others now offer too.
            let nb = &mut self.nodes[n as usize].blobs[b];
            let old = nb.peers.remove(0);
            if let Some(picker) = nb.picker.as_mut() {
                picker.remove_peer(&old.node);
            }
            self.unwatch(n, b, old.node);
        }
        self.add_peer(n, b, p);
    }

    /// `n` knows `p` as a peer of blob `b`, and watches it.
    fn add_peer(&mut self, n: u32, b: usize, p: u32) {
        self.nodes[p as usize].blobs[b].watchers.push(n);
        let nb = &mut self.nodes[n as usize].blobs[b];
        nb.peers.push(KnownPeer {
            node: p,
            looked: false,
        });
        nb.unlooked = true;
    }

    /// `n` no longer watches `p` (a peer it has just forgotten) for blob `b`.
    /// A watcher list holds at most `max_watchers_per_blob`, a few cache lines to search.
    fn unwatch(&mut self, n: u32, b: usize, p: u32) {
        let watchers = &mut self.nodes[p as usize].blobs[b].watchers;
        if let Some(at) = watchers.iter().position(|&x| x == n) {
            watchers.swap_remove(at);
        }
    }

    /// Stops a run: the chunk in flight and the claimed rest become pickable again.
    fn release_run(&mut self, n: u32, run: RunState) {
        if let Some(id) = run.flow {
            self.net.remove(id);
            remove_item(&mut self.nodes[n as usize].in_flows, id);
        }
        let nb = &mut self.nodes[n as usize].blobs[run.blob as usize];
        if let Some(p) = nb.picker.as_mut() {
            for &c in &run.chunks[run.next.min(run.chunks.len())..] {
                p.failed(c);
            }
        }
    }

    /// Fetches the run's next chunk, or finishes the run and announces.
    fn advance_run(&mut self, n: u32, k: usize) {
        let run = &self.nodes[n as usize].runs[k];
        if let Some(&c) = run.chunks.get(run.next) {
            let b = run.blob;
            let id = self.registry_chunk(n, b, c, Purpose::RunChunk);
            self.nodes[n as usize].runs[k].flow = Some(id);
        } else {
            let run = self.nodes[n as usize].runs.swap_remove(k);
            // Only a run that fetched something has news for the tracker; an
            // empty one (its chunks already arriving from peers) announcing at
            // once would be handed the same run again at the same instant.
            if !run.chunks.is_empty() {
                // The agent announces as it publishes the last hash; the
                // answer (the next run) comes a round trip later.
                self.schedule_announce(n, self.sc.rtt_s);
            }
        }
    }

    fn poll(&mut self, n: u32) {
        let nu = n as usize;
        self.nodes[nu].poll_at = None;
        if !self.nodes[nu].alive || self.nodes[nu].done_at.is_some() {
            return;
        }
        if self.strategy == Strategy::Dray {
            let at = self.instant();
            let node = &mut self.nodes[nu];
            if node.downloads > 0
                || node.runs.iter().any(|r| r.flow.is_some())
                || !node.fallback_flows.is_empty()
            {
                node.fallback.busy(at);
            }
            node.fallback.escalate(at);
            self.continue_fallback(n);
        }
        self.try_fill(n);
    }

    /// Keeps `registry_parallel` registry fetches going for the chunks the
    /// fallback wants: every unclaimed one after a stall, those no known peer
    /// holds while the tracker is silent.
    fn continue_fallback(&mut self, n: u32) {
        let nu = n as usize;
        let why = self.nodes[nu].fallback.mode();
        if why == Fallback::Off || !self.nodes[nu].alive {
            return;
        }
        for b in 0..self.blobs.len() {
            self.look_all(n, b);
            let chunks = self.blobs[b].chunks;
            while self.nodes[nu].fallback_flows.len() < self.sc.registry_parallel {
                let Some(p) = self.nodes[nu].blobs[b].picker.as_mut() else {
                    break;
                };
                let candidate = match why {
                    Fallback::All => (p.cursor()..chunks).find(|&c| p.is_unclaimed(c)),
                    _ => p.unavailable().find(|&c| p.is_unclaimed(c)),
                };
                let Some(c) = candidate else {
                    break;
                };
                p.claim(c);
                let id = self.registry_chunk(n, b as u16, c, Purpose::FallbackChunk);
                self.nodes[nu].fallback_flows.push(id);
            }
        }
    }

    /// The tracker answered: its runs take over from the fallback's registry
    /// fetches, whose chunks become pickable again.
    fn end_tracker_fallback(&mut self, n: u32) {
        let nu = n as usize;
        for id in std::mem::take(&mut self.nodes[nu].fallback_flows) {
            let (p, _) = self.net.remove(id);
            remove_item(&mut self.nodes[nu].in_flows, id);
            if let Some(picker) = self.nodes[nu].blobs[p.blob as usize].picker.as_mut() {
                picker.failed(p.chunk);
            }
        }
    }

    /// Gives the picker a view of every live known peer it has not looked at.
    fn look_all(&mut self, n: u32, b: usize) {
        let nu = n as usize;
        if !std::mem::take(&mut self.nodes[nu].blobs[b].unlooked) {
            return;
        }
        for slot in 0..self.nodes[nu].blobs[b].peers.len() {
            let p = self.nodes[nu].blobs[b].peers[slot].node;
            if self.nodes[p as usize].alive {
                self.look(n, b, slot);
            }
        }
    }

    // ---- disturbances --------------------------------------------------------

    fn leave(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive {
            return;
        }
        self.nodes[nu].alive = false;
        // Its uploads end below; a zero count lets askers see it is gone.
        self.uploads[nu] = 0;
        if self.nodes[nu].done_at.is_none() {
            self.pending -= 1;
        }
        if self.strategy == Strategy::Dray && self.tracker_up {
            self.sched.leave(&self.names[nu]);
        }
        for id in std::mem::take(&mut self.nodes[nu].in_flows) {
            let (p, _) = self.net.remove(id);
            if let Source::Peer(s) = p.from {
                let sender = &mut self.nodes[s as usize];
                remove_item(&mut sender.out_flows, id);
                self.uploads[s as usize] = self.uploads[s as usize].saturating_sub(1);
            }
        }
        self.nodes[nu].runs.clear();
        self.nodes[nu].fallback_flows.clear();
        let mut receivers = Vec::new();
        for id in std::mem::take(&mut self.nodes[nu].out_flows) {
            let (p, left) = self.net.remove(id);
            let r = p.to;
            remove_item(&mut self.nodes[r as usize].in_flows, id);
            match p.purpose {
                Purpose::PeerChunk => {
                    let rn = &mut self.nodes[r as usize];
                    rn.downloads = rn.downloads.saturating_sub(1);
                    if let Some(picker) = rn.blobs[p.blob as usize].picker.as_mut() {
                        picker.failed(p.chunk);
                        picker.remove_peer(&n);
                    }
                    receivers.push(r);
                }
                // A whole-blob download resumes elsewhere for the bytes it lacks.
                _ => self.fetch_whole(r, p.blob, left),
            }
        }
        for r in receivers {
            self.try_fill(r);
        }
    }

    fn churn(&mut self) {
        let Some(c) = &self.sc.churn else {
            return;
        };
        let mut order: Vec<u32> = (0..self.pullers).collect();
        self.rng.shuffle(&mut order);
        let count = (c.fraction * f64::from(self.pullers)).round() as usize;
        for n in order.into_iter().take(count) {
            self.leave(n);
        }
    }

    fn sample(&mut self) {
        let bytes = self.net.registry_bytes_now();
        let dt = self.samples.push(self.net.now(), bytes);
        self.net.after(dt, Ev::Sample);
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Flow(id, v) => {
                if self.net.finishes(id, v) {
                    self.flow_done(id);
                }
            }
            Ev::Begin(id, v) => self.net.begin(id, v),
            Ev::Start(n) => self.start_node(n),
            Ev::Announce(n, generation) => {
                if self.nodes[n as usize].announce_gen == generation {
                    self.announce(n);
                }
            }
            Ev::Poll(n) => {
                if self.nodes[n as usize].poll_at == Some(self.net.now_ns()) {
                    self.poll(n);
                }
            }
            Ev::Answer(n, full) => self.answered(n, full),
            Ev::Tick => {
                if self.tracker_up {
                    let now = self.instant();
                    self.sched.tick(now);
                }
                self.net.after(tick_s(), Ev::Tick);
            }
            Ev::Sample => self.sample(),
            Ev::Churn => self.churn(),
            Ev::OutageStart => self.tracker_up = false,
            Ev::OutageEnd => {
                // Modelled as a restart: the tracker comes back empty and
                // rebuilds from the full announces its resend_full asks for.
                self.tracker_up = true;
                self.sched.restart();
                for published in &mut self.published {
                    *published = Bitfield::new(published.len());
                }
            }
        }
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
    let uses_pickers = matches!(strategy, Strategy::Dray | Strategy::KrakenLike);
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
                    peers: Vec::new(),
                    unlooked: false,
                    watchers: Vec::new(),
                    added: Vec::new(),
                    complete: false,
                })
                .collect(),
            downloads: 0,
            in_flows: Vec::new(),
            out_flows: Vec::new(),
            announce_gen: 0,
            poll_at: None,
            fallback: fallback_rule(sc, base),
            need_full: true,
            runs: Vec::new(),
            fallback_flows: Vec::new(),
            rotor: 0,
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
        tracker_up: true,
        base,
        names: (0..total).map(|n| format!("n{n}")).collect(),
        seeds: vec![Vec::new(); layers],
        published: vec![Bitfield::new(chunks); layers],
        pending: pullers,
        uploads: vec![0; total as usize],
        samples: Samples::new(lower / 64.0),
        registry_link,
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
    if strategy == Strategy::KrakenLike {
        build_kraken_graph(&mut w, origins);
    }
    if strategy == Strategy::Dray {
        w.net.at_secs(tick_s(), Ev::Tick);
        if let Some(o) = &sc.outage {
            w.net.at_secs(o.at_s, Ev::OutageStart);
            w.net.at_secs(o.at_s + o.for_s, Ev::OutageEnd);
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
        Strategy::Dray | Strategy::KrakenLike => lower * 100.0 + 600.0,
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
    for n in &w.nodes[..pullers as usize] {
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
            samples: w.samples,
            wall_s: wall.elapsed().as_secs_f64(),
        },
    )
}

/// Each node links to `degree / 2` random others (undirected, so about
/// `degree` neighbours each); each blob's origin links to `degree` random
/// nodes and starts pulling its blob from the registry.
fn build_kraken_graph(w: &mut World, origins: u32) {
    let n = w.pullers as usize;
    let half = (w.sc.kraken_degree / 2).max(1) as usize;
    for b in 0..w.blobs.len() {
        if n > 1 {
            for i in 0..n {
                for _ in 0..half {
                    let j = w.rng.below(n);
                    if j == i
                        || w.nodes[i].blobs[b]
                            .peers
                            .iter()
                            .any(|q| q.node as usize == j)
                    {
                        continue;
                    }
                    w.add_peer(i as u32, b, j as u32);
                    w.add_peer(j as u32, b, i as u32);
                }
            }
        }
        if (b as u32) < origins {
            let origin = w.pullers + b as u32;
            for _ in 0..w.sc.kraken_degree {
                let j = w.rng.below(n);
                if !w.nodes[j].blobs[b].peers.iter().any(|q| q.node == origin) {
                    w.add_peer(j as u32, b, origin);
                }
            }
            // The origin holds only its own blob; the others count as done so it never pulls them.
            let o = origin as usize;
            for (k, nb) in w.nodes[o].blobs.iter_mut().enumerate() {
                nb.picker = None;
                nb.complete = k != b;
            }
            w.nodes[o].started = true;
            // Not a puller: never polls, never counts as pending.
            w.nodes[o].done_at = Some(0.0);
            let bytes = w.blobs[b].bytes as f64;
            let payload = Payload {
                to: origin,
                from: Source::Registry,
                blob: b as u16,
                chunk: 0,
                purpose: Purpose::Whole,
            };
            w.start_flow(payload, bytes);
        }
    }
}
