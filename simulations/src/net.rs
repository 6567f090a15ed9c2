//! The fluid-flow network, and the clock that its events (in [`Queue`]) drive.
//!
//! Every transfer is a flow of bytes over up to four links (sender uplink,
//! sender rack uplink, receiver rack downlink, receiver downlink; the registry
//! is one more link). A link splits its capacity among its flows in proportion
//! to their weights (all 1, an equal split, unless the scenario draws them:
//! congestion control over a drop-tail queue shares unevenly) and a flow moves
//! at the smallest share along its path. Rates are constant between
//! events, so a flow's finish time is exact until some link on its path gains
//! or loses a flow; then the flow's progress is banked and a new finish event
//! is queued (older events for it carry a stale version and are skipped).
//!
//! Recomputing is batched: events mark links and flows dirty and [`Net::settle`]
//! recomputes each once before time advances. A link whose flow count shrinks
//! by less than 3% keeps its old (smaller) share until the next rebalance, so
//! a registry serving 100,000 whole-blob downloads is not rebalanced on every
//! completion; it never oversubscribes and, with equal weights, idles at most
//! 3% of its capacity.

use crate::queue::Queue;

pub(crate) type FlowId = u32;
pub(crate) type LinkId = u32;

/// What happens at a point in simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Ev {
    /// A flow finishes, if its version is still current.
    Flow(FlowId, u32),
    /// A requested flow's first byte: it starts moving, if its version is still current.
    Begin(FlowId, u32),
    /// A node starts pulling.
    Start(u32),
    /// A node's periodic announce, if its generation is still current.
    Announce(u32, u32),
    /// An idle node looks at its peers again (and checks its fallbacks).
    Poll(u32),
    /// The tracker's answer to a node's announce (full or not) arrives.
    Answer(u32, bool),
    /// The tracker's ticker.
    Tick,
    /// Registry egress is sampled for the time series.
    Sample,
    Churn,
    OutageStart,
    OutageEnd,
    HangStart,
    HangEnd,
    /// A scenario's partition starts (true) or heals (false).
    Partition(bool),
    /// A `dray-dht` node's provider records land.
    Provided(u32),
    /// A `dray-dht` node asks the DHT for its blobs' members.
    Lookup(u32),
    /// The DHT's answers to a `dray-dht` node's lookups arrive.
    Found(u32),
    /// Requests a node sent to frozen peers may be past their deadlines.
    Deadline(u32),
    /// A node sends again the registry request of its run (blob, run id)
    /// that a server error failed.
    Retry(u32, u16, u64),
    /// The scenario's peers freeze.
    Freeze,
}

/// Where a flow's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Registry,
    Peer(u32),
}

/// Why a flow exists, so its completion goes to the right bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// One chunk picked from a peer by the receiver's ChunkPicker.
    PeerChunk,
    /// One chunk of a registry run a node's pull machine started.
    RunChunk,
    /// The same, its body cut short by the registry.
    RunChunkCut,
    /// A whole blob (direct and spegel-like baselines, kraken-like origins).
    Whole,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Payload {
    pub to: u32,
    pub from: Source,
    pub blob: u16,
    pub chunk: u32,
    pub purpose: Purpose,
    /// When the request was sent.
    pub asked_ns: u64,
    /// A peer chunk request's deadline (`dray_protocol::pull::deadline`),
    /// taken as the request is sent; `u64::MAX` where no peer can freeze.
    pub deadline_ns: u64,
}

impl Payload {
    /// A request sent now (the flow's start stamps `asked_ns`), with no deadline.
    pub fn new(to: u32, from: Source, blob: u16, chunk: u32, purpose: Purpose) -> Self {
        Self {
            to,
            from,
            blob,
            chunk,
            purpose,
            asked_ns: 0,
            deadline_ns: u64::MAX,
        }
    }
}

/// A flow's state, the fields every settle reads first: they share one
/// cache line (a settle touches thousands of flows scattered in memory).
#[derive(Debug)]
#[repr(C)]
struct Flow {
    left: f64,
    rate: f64,
    updated: f64,
    /// When its queued finish event fires; a slower rate leaves that event in
    /// place (it re-queues itself on firing early) rather than queueing another.
    due: u64,
    /// Its claim on each link's capacity, relative to the other flows'.
    weight: f64,
    version: u32,
    links: [LinkId; 4],
    nlinks: u8,
    live: bool,
    /// Requested, its first byte not yet due: on no link yet.
    waiting: bool,
    fresh: bool,
    pos: [u32; 4],
    payload: Payload,
}

#[derive(Debug)]
struct Link {
    cap: f64,
    members: Vec<FlowId>,
    /// The members' weights, summed.
    weight: f64,
    /// Member count the share (in `Net::shares`) was computed for (>= members.len()): flows
    /// only left since, so the members' weight is at most what it was.
    sized_for: usize,
    dirty: bool,
}

pub(crate) struct Net {
    links: Vec<Link>,
    /// Per link: capacity per unit of weight. Apart from the links, so that
    /// a settle's rates read one dense array (a link is a cache line).
    shares: Vec<f64>,
    flows: Vec<Flow>,
    /// Per flow: queued in `dirty_flows`. Apart from the flows, so that
    /// marking a busy link's members reads one dense array.
    flow_dirty: Vec<bool>,
    free: Vec<FlowId>,
    queue: Queue<Ev>,
    dirty_flows: Vec<FlowId>,
    dirty_links: Vec<LinkId>,
    /// The dirty lists being settled, kept so that settling never allocates.
    settling_flows: Vec<FlowId>,
    settling_links: Vec<LinkId>,
    registry_bytes: f64,
    registry_link: LinkId,
    pub events: u64,
}

pub(crate) fn to_ns(secs: f64) -> u64 {
    // Saturates for absurd values instead of wrapping.
    (secs * 1e9).ceil().clamp(0.0, u64::MAX as f64) as u64
}

impl Net {
    /// A network of links with these capacities; `registry_link` is the registry's egress.
    pub fn new(caps: Vec<f64>, registry_link: LinkId) -> Self {
        Self {
            shares: caps.clone(),
            links: caps
                .into_iter()
                .map(|cap| Link {
                    cap,
                    members: Vec::new(),
                    weight: 0.0,
                    sized_for: 0,
                    dirty: false,
                })
                .collect(),
            flows: Vec::new(),
            flow_dirty: Vec::new(),
            free: Vec::new(),
            queue: Queue::new(),
            dirty_flows: Vec::new(),
            dirty_links: Vec::new(),
            settling_flows: Vec::new(),
            settling_links: Vec::new(),
            registry_bytes: 0.0,
            registry_link,
            events: 0,
        }
    }

    pub fn now(&self) -> f64 {
        self.now_ns() as f64 / 1e9
    }

    /// Simulated time in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.queue.now()
    }

    /// Queues `ev` at `secs` after now.
    pub fn after(&mut self, secs: f64, ev: Ev) -> u64 {
        let at = self.now_ns().saturating_add(to_ns(secs));
        self.queue.push(at, ev);
        at
    }

    /// Queues `ev` at absolute time `ns`.
    pub fn at_ns(&mut self, ns: u64, ev: Ev) {
        self.queue.push(ns, ev);
    }

    /// Queues `ev` at absolute time `secs`.
    pub fn at_secs(&mut self, secs: f64, ev: Ev) {
        self.queue.push(to_ns(secs), ev);
    }

    /// Takes the next event, moving the clock to it; before time moves on,
    /// the links and flows the last instant's events changed are settled.
    pub fn pop(&mut self) -> Option<Ev> {
        loop {
            if let Some(ev) = self.queue.pop_due() {
                self.events += 1;
                return Some(ev);
            }
            self.settle();
            self.queue.advance()?;
        }
    }

    /// Whether flow `id`'s finish event of `version` means it is done now.
    /// An event that fires before the flow is done (its rate dropped after it
    /// was queued) queues the flow's true finish instead.
    pub fn finishes(&mut self, id: FlowId, version: u32) -> bool {
        if !self
            .flows
            .get(id as usize)
            .is_some_and(|f| f.live && f.version == version)
        {
            return false;
        }
        let now = self.now();
        self.advance(id, now);
        let f = &mut self.flows[id as usize];
        // Less than a byte left is rounding: done.
        if f.left < 1.0 {
            return true;
        }
        let secs = if f.rate > 0.0 {
            f.left / f.rate
        } else {
            f64::MAX
        };
        f.version = f.version.wrapping_add(1);
        let ev = Ev::Flow(id, f.version);
        self.flows[id as usize].due = self.after(secs, ev);
        false
    }

    /// Requests a flow of `bytes` over `links` (at most 4) with `weight`,
    /// whose first byte moves after `delay` seconds (a request's round trip);
    /// until then it holds no share of any link.
    pub fn start(
        &mut self,
        payload: Payload,
        bytes: f64,
        links: &[LinkId],
        delay: f64,
        weight: f64,
    ) -> FlowId {
        let now = self.now();
        let mut flow_links = [0; 4];
        let n = links.len().min(4);
        flow_links[..n].copy_from_slice(&links[..n]);
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.flows.push(Flow {
                    payload,
                    left: 0.0,
                    rate: 0.0,
                    updated: now,
                    due: 0,
                    version: 0,
                    weight: 1.0,
                    links: [0; 4],
                    pos: [0; 4],
                    nlinks: 0,
                    live: false,
                    waiting: false,
                    fresh: false,
                });
                self.flow_dirty.push(false);
                (self.flows.len() - 1) as FlowId
            }
        };
        let f = &mut self.flows[id as usize];
        f.payload = payload;
        f.left = bytes.max(0.0);
        f.rate = 0.0;
        f.updated = now;
        f.weight = weight;
        f.links = flow_links;
        f.nlinks = n as u8;
        f.live = true;
        f.waiting = true;
        if delay > 0.0 {
            f.version = f.version.wrapping_add(1);
            let ev = Ev::Begin(id, f.version);
            self.after(delay, ev);
        } else {
            self.join_links(id);
        }
        id
    }

    /// The first byte of requested flow `id` (if `version` is current): it
    /// joins its links and starts moving.
    pub fn begin(&mut self, id: FlowId, version: u32) {
        let current = self
            .flows
            .get(id as usize)
            .is_some_and(|f| f.live && f.waiting && f.version == version);
        if current {
            self.flows[id as usize].updated = self.now();
            self.join_links(id);
        }
    }

    fn join_links(&mut self, id: FlowId) {
        let f = &self.flows[id as usize];
        let (flow_links, n, weight) = (f.links, f.nlinks as usize, f.weight);
        let mut pos = [0u32; 4];
        for (k, &l) in flow_links[..n].iter().enumerate() {
            let link = &mut self.links[l as usize];
            pos[k] = link.members.len() as u32;
            link.members.push(id);
            link.weight += weight;
            if !link.dirty {
                link.dirty = true;
                self.dirty_links.push(l);
            }
        }
        let f = &mut self.flows[id as usize];
        f.pos = pos;
        f.waiting = false;
        f.fresh = true;
        self.mark(id);
    }

    /// Queues flow `id` for the next settle.
    fn mark(&mut self, id: FlowId) {
        let dirty = &mut self.flow_dirty[id as usize];
        if !*dirty {
            *dirty = true;
            self.dirty_flows.push(id);
        }
    }

    /// Banks the bytes a flow moved since its last update.
    fn advance(&mut self, id: FlowId, now: f64) {
        let f = &mut self.flows[id as usize];
        let dt = now - f.updated;
        if dt > 0.0 {
            let moved = (f.rate * dt).min(f.left);
            f.left -= moved;
            if f.payload.from == Source::Registry {
                self.registry_bytes += moved;
            }
        }
        f.updated = now;
    }

    /// Ends a flow (finished or aborted); returns its payload and the bytes it still lacked.
    pub fn remove(&mut self, id: FlowId) -> (Payload, f64) {
        let now = self.now();
        self.advance(id, now);
        let f = &mut self.flows[id as usize];
        f.live = false;
        f.version = f.version.wrapping_add(1);
        // A flow still waiting for its first byte is on no link.
        let n = if f.waiting { 0 } else { f.nlinks as usize };
        let (links, pos, weight) = (f.links, f.pos, f.weight);
        let out = (f.payload, f.left);
        for k in 0..n {
            let l = links[k];
            let link = &mut self.links[l as usize];
            link.members.swap_remove(pos[k] as usize);
            // An empty link drops the rounding its sum gathered.
            link.weight = if link.members.is_empty() {
                0.0
            } else {
                link.weight - weight
            };
            if let Some(&moved) = link.members.get(pos[k] as usize) {
                let m = &mut self.flows[moved as usize];
                if let Some(j) = m.links[..m.nlinks as usize].iter().position(|&x| x == l) {
                    m.pos[j] = pos[k];
                }
            }
            let link = &mut self.links[l as usize];
            if !link.dirty {
                link.dirty = true;
                self.dirty_links.push(l);
            }
        }
        self.free.push(id);
        out
    }

    /// Recomputes shares of changed links and rates of affected flows, and
    /// queues the finish events of flows whose rate changed.
    fn settle(&mut self) {
        let now = self.now();
        let now_ns = self.now_ns();
        let mut links = std::mem::replace(
            &mut self.dirty_links,
            std::mem::take(&mut self.settling_links),
        );
        for l in links.drain(..) {
            let link = &mut self.links[l as usize];
            link.dirty = false;
            let n = link.members.len();
            let shrunk_enough = n + (link.sized_for / 33).max(1) <= link.sized_for;
            if n > link.sized_for || shrunk_enough {
                link.sized_for = n;
                self.shares[l as usize] = if n > 0 {
                    link.cap / link.weight
                } else {
                    link.cap
                };
                for k in 0..n {
                    let id = self.links[l as usize].members[k];
                    self.mark(id);
                }
            }
        }
        self.settling_links = links;
        let mut flows = std::mem::replace(
            &mut self.dirty_flows,
            std::mem::take(&mut self.settling_flows),
        );
        for id in flows.drain(..) {
            self.flow_dirty[id as usize] = false;
            if !self.flows[id as usize].live {
                continue;
            }
            self.advance(id, now);
            let f = &self.flows[id as usize];
            let rate = f.weight
                * f.links[..f.nlinks as usize]
                    .iter()
                    .map(|&l| self.shares[l as usize])
                    .fold(f64::INFINITY, f64::min);
            if f.fresh || rate != f.rate {
                let f = &mut self.flows[id as usize];
                let fresh = std::mem::take(&mut f.fresh);
                f.rate = rate;
                let secs = if rate > 0.0 { f.left / rate } else { f64::MAX };
                let at = now_ns.saturating_add(to_ns(secs));
                if fresh || at < f.due {
                    f.version = f.version.wrapping_add(1);
                    let ev = Ev::Flow(id, f.version);
                    self.flows[id as usize].due = self.after(secs, ev);
                }
            }
        }
        self.settling_flows = flows;
    }

    /// Bytes that have left the registry up to now, including flows in progress.
    pub fn registry_bytes_now(&self) -> f64 {
        let now = self.now();
        let link = &self.links[self.registry_link as usize];
        self.registry_bytes
            + link
                .members
                .iter()
                .map(|&id| {
                    let f = &self.flows[id as usize];
                    (f.rate * (now - f.updated)).clamp(0.0, f.left)
                })
                .sum::<f64>()
    }
}

/// SplitMix64: a tiny seeded generator, so runs are reproducible without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Lognormal with mean 1: `exp(sigma·Z - sigma²/2)`, Z standard normal
    /// (Box-Muller).
    pub fn lognormal(&mut self, sigma: f64) -> f64 {
        let u = 1.0 - self.unit();
        let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos();
        (sigma * z - sigma * sigma / 2.0).exp()
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(to: u32) -> Payload {
        Payload::new(to, Source::Registry, 0, 0, Purpose::Whole)
    }

    #[test]
    fn two_flows_share_a_link_and_the_survivor_speeds_up() {
        let mut net = Net::new(vec![100.0, 1000.0, 1000.0], 0);
        let a = net.start(payload(1), 100.0, &[0, 1], 0.0, 1.0);
        net.start(payload(2), 300.0, &[0, 2], 0.0, 1.0);
        net.settle();
        // 50 B/s each: a is done at 2 s, then b runs alone at 100 B/s for its last 200 B.
        assert_eq!(net.pop(), Some(Ev::Flow(a, 1)));
        assert!((net.now() - 2.0).abs() < 1e-6);
        net.remove(a);
        net.settle();
        let Some(Ev::Flow(b, v)) = net.pop() else {
            panic!("b must finish");
        };
        assert!(net.finishes(b, v));
        assert!((net.now() - 4.0).abs() < 1e-6);
        net.remove(b);
        assert!((net.registry_bytes_now() - 400.0).abs() < 1e-6);
    }

    #[test]
    fn flows_share_a_link_in_proportion_to_their_weights() {
        let mut net = Net::new(vec![100.0, 1000.0, 1000.0], 0);
        let a = net.start(payload(1), 100.0, &[0, 1], 0.0, 1.0);
        let b = net.start(payload(2), 100.0, &[0, 2], 0.0, 3.0);
        net.settle();
        // b moves at 75 B/s and is done at 4/3 s; a has moved 33 B at 25 B/s,
        // then has the link alone: done at 2 s.
        assert_eq!(net.pop(), Some(Ev::Flow(b, 1)));
        assert!((net.now() - 4.0 / 3.0).abs() < 1e-6, "{}", net.now());
        net.remove(b);
        net.settle();
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("a must finish");
        };
        assert_eq!(id, a);
        assert!(net.finishes(a, v));
        assert!((net.now() - 2.0).abs() < 1e-6, "{}", net.now());
    }

    #[test]
    fn lognormal_weights_average_one() {
        let mut rng = Rng::new(7);
        let n = 20_000;
        let draws: Vec<f64> = (0..n).map(|_| rng.lognormal(0.5)).collect();
        let mean = draws.iter().sum::<f64>() / f64::from(n);
        assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
        assert!(draws.iter().all(|w| w.is_finite() && *w > 0.0));
    }

    #[test]
    fn a_flow_slowed_after_queueing_finishes_at_its_true_time() {
        let mut net = Net::new(vec![100.0, 1000.0, 1000.0], 0);
        let a = net.start(payload(1), 100.0, &[0, 1], 0.0, 1.0);
        net.settle();
        net.at_secs(0.5, Ev::Tick);
        assert_eq!(net.pop(), Some(Ev::Tick));
        // From 0.5 s a shares the link: 50 B left at 50 B/s, done at 1.5 s.
        net.start(payload(2), 1000.0, &[0, 2], 0.0, 1.0);
        net.settle();
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("a's first finish event");
        };
        assert_eq!(id, a);
        assert!((net.now() - 1.0).abs() < 1e-6);
        assert!(!net.finishes(a, v), "fired early: a still lacks 25 B");
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("a's true finish event");
        };
        assert_eq!(id, a);
        assert!(net.finishes(a, v));
        assert!((net.now() - 1.5).abs() < 1e-6);
    }

    #[test]
    fn a_requested_flow_takes_no_share_until_its_first_byte() {
        let mut net = Net::new(vec![100.0, 1000.0, 1000.0], 0);
        let a = net.start(payload(1), 100.0, &[0, 1], 0.0, 1.0);
        // b's first byte is due at 0.5 s: until then a has the link alone.
        let b = net.start(payload(2), 100.0, &[0, 2], 0.5, 1.0);
        let Some(Ev::Begin(id, v)) = net.pop() else {
            panic!("b's first byte");
        };
        assert_eq!(id, b);
        assert!((net.now() - 0.5).abs() < 1e-6);
        net.begin(id, v);
        // a has 50 B left, then both move at 50 B/s: a's event queued for
        // 1.0 s fires early, and a is done at 1.5 s.
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("a's first finish event");
        };
        assert_eq!(id, a);
        assert!(!net.finishes(a, v));
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("a's true finish");
        };
        assert_eq!(id, a);
        assert!(net.finishes(a, v));
        assert!((net.now() - 1.5).abs() < 1e-6);
        net.remove(a);
        // A request given up before its first byte never starts.
        let c = net.start(payload(1), 100.0, &[0, 1], 0.1, 1.0);
        net.remove(c);
        let Some(Ev::Begin(id, v)) = net.pop() else {
            panic!("c's stale first byte");
        };
        net.begin(id, v);
        let Some(Ev::Flow(id, v)) = net.pop() else {
            panic!("b's finish");
        };
        assert_eq!(id, b);
        assert!(net.finishes(b, v));
        // b: 50 B from 0.5 s to 1.5 s, then its last 50 B alone at 100 B/s.
        assert!((net.now() - 2.0).abs() < 1e-6, "{}", net.now());
    }
}
