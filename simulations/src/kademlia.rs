//! A model of the DHT the agents join without a tracker (libp2p-kad with its
//! defaults: k = 20, α = 3), for its cost at sizes one machine cannot run:
//! the rounds and messages of a lookup, what a node joining a cluster of N
//! sends, and the load on the k nodes that store a blob's provider list.
//!
//! The network is at rest: each node's routing table holds, per bucket, up
//! to k nodes drawn at random from those the bucket covers (a refreshed
//! table). Ids are 64-bit and uniform (libp2p ranks nodes by the SHA-256 of
//! their id), enough to order 100,000 nodes. A lookup runs in rounds, as
//! libp2p's `ClosestPeersIter` does on equal round trips: each round asks
//! the α closest not yet asked of the k closest known; after α answers in a
//! row that bring no closer node it stalls and asks all the rest of those k
//! at once; it ends when those k were all asked.
//!
//! Sizes are those of libp2p-kad's protobuf messages inside TLS (the bytes
//! the agent's `dray_agent_dht_bytes_total` counts); the simulation counts
//! them, it does not send them through its links, and it leaves out TCP
//! and TLS handshakes.

use crate::net::Rng;
use std::ops::Range;

/// Nodes per bucket, nodes a lookup converges on, and the stores of a key.
pub(crate) const K: usize = 20;
/// Requests a lookup keeps in flight.
pub(crate) const ALPHA: usize = 3;
/// Bootstrap addresses a joining agent dials at first (the agent's `DIALS_PER_ROUND`).
const BOOTSTRAP: usize = 16;
/// One request: the message (type, a 34-byte key) and a new substream's
/// yamux frames and protocol negotiation.
pub(crate) const REQUEST_BYTES: u64 = 200;
/// One peer in an answer: framing, a 34-byte id, an IPv4 address, the
/// connection type.
pub(crate) const PEER_BYTES: u64 = 50;
/// An answer besides its peers: type, key, framing.
pub(crate) const ANSWER_BYTES: u64 = 100;

/// What one lookup took.
#[derive(Clone, Debug, Default)]
pub(crate) struct Lookup {
    pub rounds: u32,
    /// The nodes asked, in order.
    pub asked: Vec<u32>,
    /// Its requests and their answers (closer peers, no providers).
    pub bytes: u64,
}

/// What one node joining the DHT sends and receives, and how long it takes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Join {
    /// Rounds of the lookup of its own id, after which the nodes closest
    /// to it know it and it has found them.
    pub rounds: u32,
    /// Bytes of the whole bootstrap (its own id, then a random id per
    /// bucket farther than its closest neighbour, as libp2p's bootstrap does).
    pub bytes: u64,
}

pub(crate) struct Kademlia {
    ids: Vec<u64>,
    /// Every id with its node, ascending.
    sorted: Vec<(u64, u32)>,
    tables: Vec<Vec<u32>>,
}

impl Kademlia {
    /// `n` nodes with refreshed routing tables.
    pub fn new(n: u32, rng: &mut Rng) -> Self {
        let ids: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
        let mut sorted: Vec<(u64, u32)> = ids.iter().copied().zip(0..n).collect();
        sorted.sort_unstable();
        let mut k = Self {
            ids,
            sorted,
            tables: Vec::new(),
        };
        k.tables = (0..n)
            .map(|i| k.table_for(k.ids[i as usize], rng))
            .collect();
        k
    }

    /// Positions in `sorted` of the ids whose first `bits` bits are `prefix`'s.
    fn range(&self, prefix: u64, bits: u32) -> Range<usize> {
        let mask = if bits == 0 {
            0
        } else {
            u64::MAX << (64 - bits)
        };
        let (lo, hi) = (prefix & mask, (prefix & mask) | !mask);
        self.sorted.partition_point(|&(id, _)| id < lo)
            ..self.sorted.partition_point(|&(id, _)| id <= hi)
    }

    /// A refreshed table for `id`: per bucket (the ids sharing its first
    /// `c` bits and not the next), up to K drawn at random.
    fn table_for(&self, id: u64, rng: &mut Rng) -> Vec<u32> {
        let mut table = Vec::new();
        for c in 0..64 {
            let r = self.range(id ^ (1 << (63 - c)), c + 1);
            let mut slots: Vec<usize> = r.clone().collect();
            if slots.len() > K {
                for i in 0..K {
                    let j = i + rng.below(slots.len() - i);
                    slots.swap(i, j);
                }
                slots.truncate(K);
            }
            table.extend(slots.into_iter().map(|s| self.sorted[s].1));
            // Nobody else shares the next bit: the farther buckets are empty.
            let near = self.range(id, c + 1);
            if near.is_empty() || (near.len() == 1 && self.sorted[near.start].0 == id) {
                break;
            }
        }
        table
    }

    /// The K nodes closest to `target`: a key's stores.
    #[cfg(test)]
    fn closest(&self, target: u64) -> Vec<u32> {
        let mut all: Vec<(u64, u32)> = self
            .sorted
            .iter()
            .map(|&(id, n)| (id ^ target, n))
            .collect();
        let k = K.min(all.len());
        if k == 0 {
            return Vec::new();
        }
        all.select_nth_unstable(k - 1);
        all.truncate(k);
        all.sort_unstable();
        all.into_iter().map(|(_, n)| n).collect()
    }

    /// A lookup of `target` from a node that knows `start` (itself left
    /// out of the answers as `me`).
    pub fn lookup(&self, me: Option<u32>, start: &[u32], target: u64) -> Lookup {
        // (distance, node, asked), the closest first.
        let mut known: Vec<(u64, u32, bool)> = Vec::new();
        let learn = |known: &mut Vec<(u64, u32, bool)>, nodes: &[u32]| {
            for &n in nodes {
                if Some(n) == me {
                    continue;
                }
                let d = self.ids[n as usize] ^ target;
                if let Err(at) = known.binary_search_by_key(&(d, n), |&(d, n, _)| (d, n)) {
                    known.insert(at, (d, n, false));
                }
            }
            known.truncate(4 * K);
        };
        learn(&mut known, start);
        let mut out = Lookup::default();
        let mut no_progress = 0;
        loop {
            let width = if no_progress >= ALPHA { K } else { ALPHA };
            let batch: Vec<u32> = known
                .iter_mut()
                .take(K)
                .filter(|k| !k.2)
                .take(width)
                .map(|k| {
                    k.2 = true;
                    k.1
                })
                .collect();
            if batch.is_empty() {
                return out;
            }
            out.rounds += 1;
            for n in batch {
                out.asked.push(n);
                let closer = self.closest_in(n, target);
                out.bytes += REQUEST_BYTES + ANSWER_BYTES + closer.len() as u64 * PEER_BYTES;
                let (nearest, count) = (known.first().map(|k| k.0), known.len());
                learn(&mut known, &closer);
                let progress = count < K || known.first().map(|k| k.0) != nearest;
                no_progress = if progress { 0 } else { no_progress + 1 };
            }
        }
    }

    /// The K nodes of `node`'s table closest to `target`: its answer.
    fn closest_in(&self, node: u32, target: u64) -> Vec<u32> {
        let mut t: Vec<(u64, u32)> = self.tables[node as usize]
            .iter()
            .map(|&n| (self.ids[n as usize] ^ target, n))
            .collect();
        t.sort_unstable();
        t.into_iter().take(K).map(|(_, n)| n).collect()
    }

    /// `node`'s lookup of `target` from its own table.
    pub fn lookup_from(&self, node: u32, target: u64) -> Lookup {
        self.lookup(Some(node), &self.tables[node as usize], target)
    }

    /// A new node joining through `BOOTSTRAP` random members.
    pub fn join(&self, rng: &mut Rng) -> Join {
        let n = self.sorted.len();
        if n == 0 {
            return Join::default();
        }
        let id = rng.next_u64();
        let start: Vec<u32> = (0..BOOTSTRAP.min(n)).map(|_| rng.below(n) as u32).collect();
        let own = self.lookup(None, &start, id);
        let mut bytes = own.bytes;
        // Then a random id in each bucket up to its closest neighbour's.
        let closest = own
            .asked
            .iter()
            .map(|&m| (self.ids[m as usize] ^ id).leading_zeros())
            .max()
            .unwrap_or(0);
        let table = self.table_for(id, rng);
        for c in 0..closest.min(63) {
            let target =
                ((id ^ (1 << (63 - c))) & (u64::MAX << (63 - c))) | (rng.next_u64() >> (c + 1));
            bytes += self.lookup(None, &table, target).bytes;
        }
        Join {
            rounds: own.rounds,
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_find_the_closest_nodes_in_about_log_n_rounds() {
        let mut rng = Rng::new(7);
        for n in [16u32, 1_000, 10_000] {
            let k = Kademlia::new(n, &mut rng);
            let target = rng.next_u64();
            let truth = k.closest(target);
            let mut rounds = Vec::new();
            for from in (0..n).step_by((n as usize / 20).max(1)) {
                let l = k.lookup_from(from, target);
                // It asked every store of the key (itself aside).
                for s in &truth {
                    assert!(*s == from || l.asked.contains(s), "n={n}: missed {s}");
                }
                rounds.push(l.rounds);
            }
            let max = *rounds.iter().max().unwrap();
            assert!(max <= 4 + (n as f64).log2() as u32, "n={n}: {rounds:?}");
        }
    }

    #[test]
    fn a_join_costs_more_with_more_nodes_but_little() {
        let mut rng = Rng::new(3);
        let small = Kademlia::new(16, &mut rng).join(&mut rng);
        let big = Kademlia::new(10_000, &mut rng).join(&mut rng);
        // Fewer than k nodes: every one is asked, α at a time.
        assert!((5..=6).contains(&small.rounds), "{small:?}");
        assert!((2..=8).contains(&big.rounds), "{big:?}");
        assert!(
            big.bytes > small.bytes && big.bytes < 2 << 20,
            "{small:?} {big:?}"
        );
    }
}
