//! The `dray-dht` node model: dray with no tracker, as the agent runs it
//! when none is configured. A node provides its blobs in the DHT, then
//! every `dht.lookup` asks the DHT for each blob's members and, from
//! `dht.settle` after its records landed, takes its registry runs and its
//! peers by the rules of [`dray_protocol::dht`], the agent's own code:
//! [`counts_itself`], [`fetcher_candidates`] and [`counted_fetchers`] (at
//! most `FETCHERS` members fetch from the registry), `dht_runs` (as its
//! halves [`dht_blocks`], kept while the members stay the same, and
//! [`runs_in`]; truncated to `registry_parallel`, as the agent does) and
//! [`pick_peers`] (the candidates watched first, then its own picks). Chunk hashes come from peers (the
//! blob's digest judges at the end), so a node can fetch any chunk a peer
//! holds; with no tracker, only the stall rule sends it to the registry.
//!
//! The DHT itself is [`Kademlia`]: lookups take its rounds of round trips,
//! and its traffic is counted, not sent through the links. A blob's
//! provider list is one list in the order records landed, cut at
//! `dht_max_providers` as libp2p's store cuts it (the first to come): the
//! `k` stores of a key all hold the same list here, where in the agent
//! their lists may differ a little.

use super::*;
use crate::kademlia::{ANSWER_BYTES, Join, K, Kademlia, PEER_BYTES, REQUEST_BYTES};
use crate::report::DhtReport;
use dray_protocol::dht::{
    counted_fetchers, counts_itself, dht_blocks, fetcher_candidates, fetcher_rank, lookup_after,
    overflow_list, pick_peers, runs_in,
};

/// A node's DHT state.
#[derive(Default)]
pub(super) struct DhtNode {
    /// Per blob: the rounds and bytes of this node's lookup of its key.
    costs: Vec<(u32, u64)>,
    /// When its provider records landed.
    provided_at: Option<f64>,
    /// Per blob: the provider list's length when its last lookup went out,
    /// and its overflow list's, if it joined one: the members whose node
    /// records it has looked up.
    asked: Vec<usize>,
    asked_more: Vec<Option<usize>>,
    /// When its last lookup went out, and how many answers in a row named
    /// the same members.
    asked_at: Option<f64>,
    unchanged: u32,
    /// Watched members that turned out gone: no longer counted as fetchers.
    gone: Vec<u32>,
    /// Per blob: members that refused to be watched (their watcher cap):
    /// fetchers still, but it watches others instead.
    refused: Vec<Vec<u32>>,
    /// Per blob: what the members last seen give this node.
    views: Vec<View>,
}

/// What one list of members gives a node: kept until the list changes
/// (they only grow, to the cap) or a watched member is found gone.
#[derive(Default)]
struct View {
    members: usize,
    more: Option<usize>,
    gone: usize,
    refused: usize,
    /// Whether the DHT lists this node.
    listed: bool,
    /// The blocks that fall to this node.
    blocks: Vec<u32>,
    /// The members it watches.
    watch: Vec<u32>,
}

/// The DHT of a `dray-dht` run.
pub(super) struct DhtWorld {
    kad: Kademlia,
    /// Each blob's key.
    keys: Vec<u64>,
    /// Each blob's providers, in the order their records landed.
    providers: Vec<Vec<u32>>,
    /// Each blob's overflow lists, by `overflow_list`.
    overflow: Vec<HashMap<u32, Vec<u32>>>,
    nodes: Vec<DhtNode>,
    /// Per blob: lookups answered by its stores, their answers' bytes, and
    /// the first and last lookup's time.
    store_load: Vec<(u64, f64, f64, f64)>,
    lookups: u64,
    bytes: f64,
    joins: Vec<Join>,
    /// Per blob: the nodes its runs were handed to.
    fetchers: Vec<Vec<u32>>,
}

/// Joins sampled to report a join's cost.
const JOINS: usize = 64;
/// A node record's answer (peer id, addresses) besides its lookup.
const RECORD_BYTES: u64 = 200;

impl DhtWorld {
    pub fn new(nodes: u32, blobs: usize, rng: &mut Rng) -> Self {
        let kad = Kademlia::new(nodes, rng);
        let joins = (0..JOINS).map(|_| kad.join(rng)).collect();
        Self {
            keys: (0..blobs).map(|_| rng.next_u64()).collect(),
            providers: vec![Vec::new(); blobs],
            overflow: vec![HashMap::new(); blobs],
            nodes: (0..nodes).map(|_| DhtNode::default()).collect(),
            store_load: vec![(0, 0.0, f64::INFINITY, 0.0); blobs],
            lookups: 0,
            bytes: 0.0,
            joins,
            fetchers: vec![Vec::new(); blobs],
            kad,
        }
    }

    /// The stores of a key: its `K` closest nodes.
    fn stores(&self) -> u64 {
        K.min(self.nodes.len().saturating_sub(1)) as u64
    }

    /// What the run's DHT cost.
    pub fn report(&self, sc: &Scenario) -> DhtReport {
        let mut rounds: Vec<u32> = self.joins.iter().map(|j| j.rounds).collect();
        rounds.sort_unstable();
        let mut bytes: Vec<u64> = self.joins.iter().map(|j| j.bytes).collect();
        bytes.sort_unstable();
        let hottest = self
            .store_load
            .iter()
            .map(|&(n, b, first, last)| {
                let span = (last - first).max(sc.rtt_s);
                (n as f64 / span, b / span)
            })
            .fold((0.0, 0.0), |(n, b), (n2, b2)| {
                (f64::max(n, n2), f64::max(b, b2))
            });
        DhtReport {
            join_rounds_p50: rounds.get(rounds.len() / 2).copied().unwrap_or(0),
            join_rounds_max: rounds.last().copied().unwrap_or(0),
            // Each round reaches nodes it has no connection to yet: TCP,
            // then TLS 1.3, then the request.
            join_s_p50: f64::from(rounds.get(rounds.len() / 2).copied().unwrap_or(0))
                * 3.0
                * sc.rtt_s,
            join_bytes_p50: bytes.get(bytes.len() / 2).copied().unwrap_or(0),
            lookups: self.lookups,
            bytes: self.bytes,
            bytes_per_node: self.bytes / f64::from(sc.nodes.max(1)),
            hottest_store_requests_per_s: hottest.0,
            hottest_store_bytes_per_s: hottest.1,
            max_members: self
                .providers
                .iter()
                .map(Vec::len)
                .max()
                .unwrap_or(0)
                .min(DEFAULTS.dht_max_providers),
            max_fetchers: self.fetchers.iter().map(Vec::len).max().unwrap_or(0),
        }
    }
}

impl World<'_> {
    fn dht(&mut self) -> &mut DhtWorld {
        self.dht.as_mut().expect("a dray-dht run has a DHT")
    }

    /// `n` starts pulling: it looks up each blob's key and stores its
    /// provider record at the key's `k` closest nodes; the records land
    /// when the slowest of its lookups ends, and a round trip later.
    pub(super) fn dht_start(&mut self, n: u32) {
        let blobs = self.blobs.len();
        let rtt = self.sc.rtt_s;
        let dht = self.dht();
        let keys = dht.keys.clone();
        let costs: Vec<(u32, u64)> = keys
            .iter()
            .map(|&key| {
                let l = dht.kad.lookup_from(n, key);
                (l.rounds, l.bytes)
            })
            .collect();
        let slowest = costs.iter().map(|&(r, _)| r).max().unwrap_or(0);
        let stores = dht.stores();
        for &(_, bytes) in &costs {
            dht.bytes += (bytes + stores * (REQUEST_BYTES + PEER_BYTES)) as f64;
        }
        let node = &mut dht.nodes[n as usize];
        node.costs = costs;
        node.asked = vec![0; blobs];
        node.asked_more = vec![None; blobs];
        node.views = (0..blobs).map(|_| View::default()).collect();
        node.refused = vec![Vec::new(); blobs];
        self.net
            .after(f64::from(slowest + 1) * rtt, Ev::Provided(n));
    }

    /// `n`'s provider records landed; its first lookup follows a lookup
    /// period later (the agent's coordinator sleeps first).
    pub(super) fn dht_provided(&mut self, n: u32) {
        if !self.nodes[n as usize].alive {
            return;
        }
        let now = self.net.now();
        let dht = self.dht();
        for providers in &mut dht.providers {
            providers.push(n);
        }
        dht.nodes[n as usize].provided_at = Some(now);
        self.net.after(secs(DEFAULTS.dht_lookup_ms), Ev::Lookup(n));
    }

    /// Every `dht.lookup`, `n` asks the DHT for each blob's members if due
    /// ([`lookup_after`]; else it goes on with those it has); the answers
    /// come after its lookups' rounds, and after one more lookup's if they
    /// name members whose node records it has not looked up yet.
    pub(super) fn dht_lookup(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive || self.nodes[nu].done_at.is_some() {
            return;
        }
        let now = self.net.now();
        let cap = DEFAULTS.dht_max_providers;
        let rtt = self.sc.rtt_s;
        let wanted: Vec<bool> = self.nodes[nu].blobs.iter().map(|b| !b.complete).collect();
        let list = overflow_list(&self.names[nu]);
        let dht = self.dht();
        let node = &dht.nodes[nu];
        let after = lookup_after(
            Duration::from_millis(DEFAULTS.dht_lookup_ms),
            node.unchanged,
        );
        if node
            .asked_at
            .is_some_and(|at| now - at < after.as_secs_f64())
        {
            self.net.after(0.0, Ev::Found(n));
            return;
        }
        dht.nodes[nu].asked_at = Some(now);
        let mut changed = false;
        let mut slowest = 0;
        for (b, wanted) in wanted.into_iter().enumerate() {
            if !wanted {
                continue;
            }
            let listed = dht.providers[b].len().min(cap);
            let (rounds, bytes) = dht.nodes[nu].costs[b];
            let mut wait = rounds;
            // The list only grows: what is past the last answer is new.
            let new = listed.saturating_sub(dht.nodes[nu].asked[b]);
            if new > 0 {
                // One node-record lookup per new member, all at once.
                wait += rounds;
                dht.bytes += (new as u64 * (bytes + RECORD_BYTES)) as f64;
            }
            changed |= new > 0;
            dht.nodes[nu].asked[b] = listed;
            if let Some(was) = dht.nodes[nu].asked_more[b] {
                // Its overflow list too, at about the same cost.
                let more = dht.overflow[b].get(&list).map_or(0, Vec::len).min(cap);
                let new = more.saturating_sub(was);
                dht.bytes += (new as u64 * (bytes + RECORD_BYTES)
                    + bytes
                    + dht.stores() * more as u64 * PEER_BYTES) as f64;
                if new > 0 {
                    wait = wait.max(2 * rounds);
                }
                changed |= new > 0;
                dht.nodes[nu].asked_more[b] = Some(more);
            }
            slowest = slowest.max(wait);
            // Every store of the key answers with the list.
            let answer = listed as u64 * PEER_BYTES;
            dht.bytes += (bytes + dht.stores() * answer) as f64;
            dht.lookups += 1;
            let load = &mut dht.store_load[b];
            load.0 += 1;
            load.1 += (answer + ANSWER_BYTES + K as u64 * PEER_BYTES) as f64;
            load.2 = load.2.min(now);
            load.3 = load.3.max(now);
        }
        let node = &mut dht.nodes[nu];
        node.unchanged = if changed { 0 } else { node.unchanged + 1 };
        self.net.after(f64::from(slowest) * rtt, Ev::Found(n));
    }

    /// What the first `members` providers of blob `b` and the first `more`
    /// of `n`'s overflow list, less those `gone`, give `n`: its blocks of the
    /// registry's work, and the members it watches (not those that refused).
    fn view(&self, n: u32, b: usize, members: usize, more: Option<usize>, gone: &[u32]) -> View {
        let refused =
            &self.dht.as_ref().expect("a dray-dht run has a DHT").nodes[n as usize].refused[b];
        let dht = self.dht.as_ref().expect("a dray-dht run has a DHT");
        let list = &dht.providers[b][..members];
        let extra = more.map_or(&[][..], |more| {
            let list = &dht.overflow[b][&overflow_list(&self.names[n as usize])];
            &list[..more.min(list.len())]
        });
        let mine = list.contains(&n);
        // A store leaves the asker out of its answer.
        let listed = counts_itself([list.len() - usize::from(mine)], DEFAULTS.dht_max_providers);
        let digest = &self.blobs[b].digest;
        let rank = |&m: &u32| fetcher_rank(digest, self.names[m as usize].as_bytes());
        let mut others: Vec<u32> = list
            .iter()
            .copied()
            .filter(|&m| m != n && !gone.contains(&m))
            .collect();
        others.sort_by_cached_key(rank);
        let (candidates, candidate) = fetcher_candidates(&rank(&n), listed, others.clone(), rank);
        let me = self.names[n as usize].as_str();
        // A simulated member answers a pull's bitfield request at once; one
        // that is gone is found so before this view is taken.
        let live: Vec<(&str, bool)> = candidates
            .iter()
            .map(|&m| (self.names[m as usize].as_str(), true))
            .collect();
        let blocks = dht_blocks(
            digest,
            me,
            counted_fetchers(me, candidate, &live).into_iter(),
            self.blobs[b].chunks,
            DEFAULTS.run_chunks,
        );
        // It watches the candidates (as every puller does, so each learns
        // which answer), then its own picks of the rest; its overflow
        // list's members are peers, not fetchers.
        let named = |v: &mut dyn Iterator<Item = &u32>| -> Vec<(u32, &str)> {
            v.filter(|m| !refused.contains(m) && !candidates.contains(m))
                .map(|&m| (m, self.names[m as usize].as_str()))
                .collect()
        };
        let own = named(&mut others.iter());
        let mates = named(&mut extra.iter().filter(|&&m| m != n && !gone.contains(&m)));
        let room = self.sc.max_peers_per_blob.saturating_sub(candidates.len());
        let mut watch = candidates.clone();
        if room > 0 {
            let picked = pick_peers(me, own, mates, |m| m.1, room);
            watch.extend(picked.into_iter().map(|(m, _)| m));
        }
        View {
            members,
            more,
            gone: gone.len(),
            refused: refused.len(),
            listed,
            blocks,
            watch,
        }
    }

    /// The answers to `n`'s lookups arrive: it takes its peers and, once
    /// settled, its registry runs, as the agent's coordinator does; its
    /// next lookup follows a lookup period later.
    pub(super) fn dht_found(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive || self.nodes[nu].done_at.is_some() {
            return;
        }
        let now = self.net.now();
        let settled = self.dht().nodes[nu]
            .provided_at
            .is_some_and(|at| now - at >= secs(DEFAULTS.dht_settle_ms));
        for b in 0..self.blobs.len() {
            if self.nodes[nu].blobs[b].complete {
                continue;
            }
            // Watched members found gone stop counting as fetchers.
            let mut gone = std::mem::take(&mut self.dht().nodes[nu].gone);
            for m in self.nodes[nu].blobs[b].peers.live() {
                if !self.nodes[m.key as usize].alive && !gone.contains(&m.key) {
                    gone.push(m.key);
                }
            }
            let dht = self.dht.as_ref().expect("a dray-dht run has a DHT");
            let (members, more) = (dht.nodes[nu].asked[b], dht.nodes[nu].asked_more[b]);
            let view = &dht.nodes[nu].views[b];
            let now = (members, more, gone.len(), dht.nodes[nu].refused[b].len());
            if (view.members, view.more, view.gone, view.refused) != now {
                let view = self.view(n, b, members, more, &gone);
                self.dht().nodes[nu].views[b] = view;
            }
            if more.is_none() && !self.dht().nodes[nu].views[b].listed {
                // The blob's list is full without it: it provides the blob in
                // its overflow list, and looks that up from its next lookup.
                let list = overflow_list(&self.names[nu]);
                let dht = self.dht();
                dht.overflow[b].entry(list).or_default().push(n);
                dht.nodes[nu].asked_more[b] = Some(0);
                let bytes = dht.nodes[nu].costs[b].1;
                dht.bytes += (bytes + dht.stores() * (REQUEST_BYTES + PEER_BYTES)) as f64;
                dht.nodes[nu].asked_at = None;
            }
            self.dht().nodes[nu].gone = gone;
            let dht = self.dht.as_ref().expect("a dray-dht run has a DHT");
            let view = &dht.nodes[nu].views[b];
            let mut runs = Vec::new();
            if settled && !view.blocks.is_empty() {
                let mut held = self.nodes[nu].blobs[b].held.clone();
                for m in self.nodes[nu].blobs[b].peers.live() {
                    for c in self.nodes[m.key as usize].blobs[b].held.ones() {
                        held.set(c);
                    }
                }
                runs = runs_in(&view.blocks, &held, DEFAULTS.run_chunks);
                runs.truncate(self.sc.registry_parallel.max(1));
            }
            let fetchers = &mut self.dht().fetchers[b];
            if !runs.is_empty() && !fetchers.contains(&n) {
                fetchers.push(n);
            }
            // The coordinator's news, as the agent's: the next few runs, a
            // partial list.
            let news = News {
                fetching: false,
                runs: &runs,
                runs_complete: false,
            };
            self.pull_news(n, b, news);
            let dht = self.dht.as_ref().expect("a dray-dht run has a DHT");
            for p in dht.nodes[nu].views[b].watch.clone() {
                if self.nodes[p as usize].alive {
                    self.learn_peer(n, b, p);
                    let kept = self.nodes[nu].blobs[b].peers.contains(&p);
                    let refused = &mut self.dht().nodes[nu].refused[b];
                    if !kept && !refused.contains(&p) {
                        refused.push(p);
                    }
                }
            }
        }
        self.try_fill(n);
        self.net.after(secs(DEFAULTS.dht_lookup_ms), Ev::Lookup(n));
    }
}
