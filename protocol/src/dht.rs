//! Registry coordination without a tracker: the rules a pull follows when
//! the DHT, not the tracker, tells it who else holds or pulls its blob. The
//! agent's swarm engine and the simulator's `dray-dht` nodes both run them,
//! so a simulated storm without a tracker splits the registry's work as the
//! agents would.
//!
//! - [`registry_fetcher`]: each block of a blob belongs to one member, the
//!   winner of a rendezvous hash; every node that sees the same members
//!   picks the same one.
//! - [`counts_itself`]: whether the DHT lists this node among the members.
//!   A store keeps at most `dht_max_providers` per blob (the first to
//!   come); a node past that is seen by nobody, and must not take blocks
//!   the others give to someone else.
//! - [`overflow_list`]: where a node the blob's list left out provides the
//!   blob instead, so that such nodes find each other (and not only the
//!   listed few, who could not serve them all).
//! - [`fetcher_rank`], [`FETCHERS`], [`fetcher_candidates`],
//!   [`counted_fetchers`]: which few members fetch a blob's blocks from the
//!   registry, in an order no member's list can skew.
//! - [`dht_runs`]: the runs a member fetches from the registry.
//! - [`watch_order`]: which of the members a pull watches as its peers.
//! - [`lookup_after`]: how often a pull asks the DHT again.

use crate::{Bitfield, BlobDigest};
use std::time::Duration;

/// Overflow lists per blob: with up to `dht_max_providers` (256) each,
/// room for 65,536 pullers of a blob past its own list.
pub const OVERFLOW_LISTS: u32 = 256;

/// The overflow list of a blob a node provides it in, and looks up besides
/// the blob's own, once the blob's own list is full without it: one of
/// [`OVERFLOW_LISTS`], by a BLAKE3 hash of its id. The nodes of one list
/// find each other there and swarm among themselves and with the listed
/// members they watch; without them, every node past the first 256 could
/// only watch those 256 (what that cost a simulated storm is in
/// `docs/results.md`).
pub fn overflow_list(peer_id: &str) -> u32 {
    let h = blake3::hash(peer_id.as_bytes());
    u32::from_be_bytes(h.as_bytes()[..4].try_into().expect("4 bytes")) % OVERFLOW_LISTS
}

/// Members of a blob that fetch its blocks from the registry, at most:
/// the first by [`fetcher_rank`] among those the DHT lists. The registry
/// sends each block once however many share them; eight fetchers with
/// `swarm.registry_parallel` runs each keep a registry busy, and leave half
/// of a pull's `peer.max_peers_per_blob` watched peers to its own picks.
/// A pull counts a member a fetcher only once it answered the pull's
/// bitfield request (the agent's `Swarm::coordinate`): a forged list costs
/// a dial per name, never a block left waiting for `swarm.stall`.
pub const FETCHERS: usize = 8;

/// The order in which a blob's members are candidates for fetching it
/// ([`FETCHERS`]): a BLAKE3 hash of the blob and the member's id, the same
/// at every node whatever list it was given, so a member naming others
/// cannot place them first.
pub fn fetcher_rank(digest: &BlobDigest, id: &[u8]) -> [u8; 32] {
    *blake3::Hasher::new()
        .update(digest.to_string().as_bytes())
        .update(id)
        .finalize()
        .as_bytes()
}

/// Which of a blob's members are its fetcher candidates, as `mine` (this
/// node's [`fetcher_rank`]) sees them: `ranked` holds the other members it
/// could reach, first by [`fetcher_rank`] (`rank`), those failed in this
/// pull or without a node record left out by the caller (the agent's
/// lookups skip them, so the next ones move up). The first [`FETCHERS`] of
/// them are candidates; this node is one too if the DHT lists it
/// ([`counts_itself`]: nobody else counts it otherwise) and fewer than
/// `FETCHERS` rank above it, and then it takes the last place. Returns the
/// other candidates, in rank order, and whether this node is one: the same
/// set at every node that reached the same members.
pub fn fetcher_candidates<T>(
    mine: &[u8; 32],
    listed: bool,
    mut ranked: Vec<T>,
    rank: impl Fn(&T) -> [u8; 32],
) -> (Vec<T>, bool) {
    ranked.truncate(FETCHERS);
    let above = ranked.iter().filter(|m| rank(m) < *mine).count();
    let me = listed && above < FETCHERS;
    if me {
        ranked.truncate(FETCHERS - 1);
    }
    (ranked, me)
}

/// The fetchers among which [`dht_runs`] splits the blocks, as `me` counts
/// them now: of its candidates ([`fetcher_candidates`]), `live` are those
/// not failed in this pull, each with whether it answered this pull's
/// bitfield request (every puller asks them, so every puller learns the
/// same). None while one is still to answer: a member a forged list names,
/// that neither holds nor pulls the blob, is never given blocks to wait
/// `swarm.stall` for. This node counts if it is a `candidate`, or alone if
/// every candidate failed here (a list of made-up ids then leaves the pull
/// fetching alone, not waiting).
pub fn counted_fetchers<'a>(
    me: &'a str,
    candidate: bool,
    live: &[(&'a str, bool)],
) -> Vec<&'a str> {
    if live.iter().any(|&(_, shown)| !shown) {
        return Vec::new();
    }
    (candidate || live.is_empty())
        .then_some(me)
        .into_iter()
        .chain(live.iter().map(|&(id, _)| id))
        .collect()
}

/// Doublings of `dht.lookup` at most: 6.4 s between lookups at the default.
const MAX_LOOKUP_DOUBLINGS: u32 = 5;

/// How long a pull without a tracker waits before it asks the DHT for a
/// blob's members again, after `unchanged` answers in a row that named the
/// same members: `lookup`, doubled for each, at most 32 times. The `k`
/// nodes that store a blob's provider list answer every puller's lookups
/// (their load in a simulated storm is in `docs/results.md`). Between
/// lookups the pull keeps the
/// members it has, and its runs still follow the chunks that arrive.
pub fn lookup_after(lookup: Duration, unchanged: u32) -> Duration {
    lookup * (1 << unchanged.min(MAX_LOOKUP_DOUBLINGS))
}

/// Without a tracker, who fetches a block of a blob from the registry: the
/// member that wins a rendezvous hash of (blob, block, member). Every node
/// that sees the same members picks the same one, so each block leaves the
/// registry once; a member joining or leaving moves only the blocks it
/// wins or held. None for no members.
pub fn registry_fetcher<'a>(
    digest: &BlobDigest,
    block: u32,
    members: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let mut prefix = blake3::Hasher::new();
    prefix.update(digest.to_string().as_bytes());
    prefix.update(&block.to_be_bytes());
    members.into_iter().max_by_key(|m| {
        let out = prefix.clone().update(m.as_bytes()).finalize();
        (
            u64::from_be_bytes(out.as_bytes()[..8].try_into().expect("8 bytes")),
            *m,
        )
    })
}

/// Whether the DHT lists the asking node among a blob's members, from the
/// sizes of the provider lists other nodes' stores answered with. A store
/// leaves the asker out of its answer, and keeps no more than
/// `max_providers` (the first to come): an answer of `max_providers` is a
/// full list without the asker. Listed unless every non-empty answer is
/// such a list (no answer: nobody can be full yet). The asker's own store
/// is no witness: it takes the asker's record whenever it has room, so the
/// caller leaves out an answer that names the asker.
pub fn counts_itself(answers: impl IntoIterator<Item = usize>, max_providers: usize) -> bool {
    answers
        .into_iter()
        .filter(|&others| others > 0)
        .map(|others| others < max_providers)
        .reduce(|a, b| a || b)
        .unwrap_or(true)
}

/// The registry runs that fall to `me`: the blocks of `block` chunks that
/// [`registry_fetcher`] gives it among `fetchers` (it, if it
/// [`counts_itself`], and the members still reachable), less the chunks
/// `held` here or by a peer, in index order.
pub fn dht_runs<'a>(
    digest: &BlobDigest,
    me: &str,
    fetchers: impl Iterator<Item = &'a str>,
    held: &Bitfield,
    block: u32,
) -> Vec<(u32, u32)> {
    let mine = dht_blocks(digest, me, fetchers, held.len(), block);
    runs_in(&mine, held, block)
}

/// The blocks of `block` chunks, of a blob of `chunks`, that
/// [`registry_fetcher`] gives `me` among `fetchers`: the first half of
/// [`dht_runs`], which changes only when the members do.
pub fn dht_blocks<'a>(
    digest: &BlobDigest,
    me: &str,
    fetchers: impl Iterator<Item = &'a str>,
    chunks: u32,
    block: u32,
) -> Vec<u32> {
    let fetchers: Vec<&str> = fetchers.collect();
    if !fetchers.contains(&me) {
        return Vec::new();
    }
    (0..chunks.div_ceil(block.max(1)))
        .filter(|&b| registry_fetcher(digest, b, fetchers.iter().copied()) == Some(me))
        .collect()
}

/// The runs of `blocks` (of `block` chunks) less the chunks `held`: the
/// second half of [`dht_runs`].
pub fn runs_in(blocks: &[u32], held: &Bitfield, block: u32) -> Vec<(u32, u32)> {
    let (block, count) = (block.max(1), held.len());
    let mut runs = Vec::new();
    for &b in blocks {
        let end = ((b + 1) * block).min(count);
        let mut i = b * block;
        while i < end {
            if held.get(i) {
                i += 1;
                continue;
            }
            let first = i;
            while i < end && !held.get(i) {
                i += 1;
            }
            runs.push((first, i - first));
        }
    }
    runs
}

/// The members a pull watches: at most `max`, half of them (if it has so
/// many) from its overflow list, `more`, the rest from the blob's own list,
/// `own`, each in [`watch_order`]. Without its overflow list's members a
/// node left out would watch only listed ones, whose uploads all the
/// others share; with only those, its list would have no way to the first
/// chunks.
pub fn pick_peers<T>(
    me: &str,
    mut own: Vec<T>,
    mut more: Vec<T>,
    id: impl Fn(&T) -> &str,
    max: usize,
) -> Vec<T> {
    let max = max.max(1);
    watch_order(me, &mut own, &id, max);
    watch_order(me, &mut more, &id, max);
    let from_more = more.len().min(max / 2).max(max.saturating_sub(own.len()));
    more.truncate(from_more);
    own.truncate(max - more.len());
    more.extend(own);
    more
}

/// Of a blob's members, those a pull watches: at most `max`, in an order of
/// `me`'s own (a BLAKE3 hash of both ids), so that each node watches a
/// different few of a large swarm, and the same few at every lookup.
pub fn watch_order<T>(me: &str, members: &mut Vec<T>, id: impl Fn(&T) -> &str, max: usize) {
    members.sort_by_cached_key(|m| {
        *blake3::Hasher::new()
            .update(me.as_bytes())
            .update(id(m).as_bytes())
            .finalize()
            .as_bytes()
    });
    members.truncate(max.max(1));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_fetchers_spread_blocks_and_move_few_when_a_member_joins() {
        let d = BlobDigest::of(b"blob");
        let four = ["a", "b", "c", "d"];
        let five = ["a", "b", "c", "d", "e"];
        let mut per = std::collections::HashMap::new();
        let mut moved = 0;
        for block in 0..1000 {
            let f = registry_fetcher(&d, block, four).unwrap();
            *per.entry(f).or_insert(0) += 1;
            // The order members are listed in does not matter.
            assert_eq!(
                registry_fetcher(&d, block, four.iter().rev().copied()),
                Some(f)
            );
            let g = registry_fetcher(&d, block, five).unwrap();
            if g != f {
                assert_eq!(g, "e", "a block moved to an old member");
                moved += 1;
            }
        }
        assert!(per.values().all(|&n| (180..320).contains(&n)), "{per:?}");
        assert!((130..280).contains(&moved), "{moved}");
        assert_eq!(registry_fetcher(&d, 0, []), None);
    }

    #[test]
    fn fetcher_candidates_are_the_first_by_rank_with_this_node_if_listed() {
        let d = BlobDigest::of(b"blob");
        let rank = |m: &String| fetcher_rank(&d, m.as_bytes());
        let mut all: Vec<String> = (0..40).map(|i| format!("n{i}")).collect();
        all.sort_by_cached_key(rank);
        // For every place this node could rank at, whatever list it heard.
        for (place, me) in all.iter().enumerate() {
            let others: Vec<String> = all.iter().filter(|m| *m != me).cloned().collect();
            let (cands, is) = fetcher_candidates(&rank(me), true, others.clone(), rank);
            assert_eq!(is, place < FETCHERS, "{me} at {place}");
            let mut set = cands.clone();
            if is {
                set.push(me.clone());
            }
            set.sort_by_cached_key(rank);
            assert_eq!(
                set,
                all[..FETCHERS],
                "the first FETCHERS by rank, at {place}"
            );
            // Not listed: never a candidate, and the others fill every place.
            let (cands, is) = fetcher_candidates(&rank(me), false, others.clone(), rank);
            assert!(!is);
            assert_eq!(cands, others[..FETCHERS]);
        }
        // Fewer members than places: all of them, and this node.
        let few: Vec<String> = all[..3].to_vec();
        let (cands, is) = fetcher_candidates(&rank(&all[39]), true, few.clone(), rank);
        assert!(is);
        assert_eq!(cands, few);
    }

    #[test]
    fn fetchers_are_counted_once_every_candidate_answered() {
        // A candidate still to answer: no blocks for anyone yet.
        assert!(counted_fetchers("me", true, &[("a", true), ("b", false)]).is_empty());
        assert_eq!(
            counted_fetchers("me", true, &[("a", true), ("b", true)]),
            ["me", "a", "b"]
        );
        // Not a candidate: the others only.
        assert_eq!(counted_fetchers("me", false, &[("a", true)]), ["a"]);
        // Every candidate failed here: this node fetches alone.
        assert_eq!(counted_fetchers("me", false, &[]), ["me"]);
    }

    #[test]
    fn a_node_counts_itself_unless_every_list_is_full_without_it() {
        // Nobody stored anything yet, or only empty answers.
        assert!(counts_itself([], 4));
        assert!(counts_itself([0, 0], 4));
        // Lists with room: this node's record went in (stores leave the asker out).
        assert!(counts_itself([3, 0], 4));
        // Full lists without it: nobody sees it.
        assert!(!counts_itself([4, 0, 4], 4));
        // One store has room.
        assert!(counts_itself([4, 3], 4));
    }

    #[test]
    fn dht_runs_split_the_blocks_among_members_and_skip_held_chunks() {
        let d = BlobDigest::of(b"blob");
        let members = ["a", "b", "c"];
        let none = Bitfield::new(40);
        let mut all = Vec::new();
        for m in members {
            let runs = dht_runs(&d, m, members.iter().copied(), &none, 4);
            for (first, count) in runs {
                // Whole blocks of 4, the last one short only at the end.
                assert_eq!(first % 4, 0);
                assert_eq!(count, 4);
                all.extend(first..first + count);
            }
        }
        all.sort();
        assert_eq!(
            all,
            (0..40).collect::<Vec<_>>(),
            "each chunk falls to one member"
        );
        // Held chunks split a run; a member alone takes everything unheld.
        let mut held = Bitfield::new(10);
        for i in [1, 2, 9] {
            held.set(i);
        }
        assert_eq!(
            dht_runs(&d, "a", ["a"].into_iter(), &held, 4),
            [(0, 1), (3, 1), (4, 4), (8, 1)]
        );
        // A node that does not count itself fetches nothing.
        assert!(dht_runs(&d, "z", members.iter().copied(), &none, 4).is_empty());
    }

    #[test]
    fn overflow_lists_spread_nodes_evenly() {
        let mut per = vec![0u32; OVERFLOW_LISTS as usize];
        for i in 0..25_600 {
            per[overflow_list(&format!("node-{i}")) as usize] += 1;
        }
        assert!(per.iter().all(|&n| (50..160).contains(&n)), "{per:?}");
        assert_eq!(overflow_list("a"), overflow_list("a"));
    }

    #[test]
    fn lookups_slow_down_while_the_members_stay_the_same() {
        let base = Duration::from_millis(200);
        assert_eq!(lookup_after(base, 0), base);
        assert_eq!(lookup_after(base, 1), base * 2);
        assert_eq!(lookup_after(base, 5), Duration::from_millis(6400));
        assert_eq!(lookup_after(base, 50), Duration::from_millis(6400));
    }

    #[test]
    fn a_node_in_an_overflow_list_watches_half_there_half_in_the_blobs_list() {
        let list = |n: usize, p: &str| (0..n).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
        let count = |v: &[String], p: &str| v.iter().filter(|m| m.starts_with(p)).count();
        let picked = pick_peers("a", list(256, "own"), list(40, "more"), |s| s.as_str(), 16);
        assert_eq!((count(&picked, "own"), count(&picked, "more")), (8, 8));
        // Short of one kind, the other fills the places.
        let picked = pick_peers("a", list(256, "own"), list(3, "more"), |s| s.as_str(), 16);
        assert_eq!((count(&picked, "own"), count(&picked, "more")), (13, 3));
        let picked = pick_peers("a", list(5, "own"), list(40, "more"), |s| s.as_str(), 16);
        assert_eq!((count(&picked, "own"), count(&picked, "more")), (5, 11));
        let picked = pick_peers("a", list(5, "own"), Vec::new(), |s| s.as_str(), 16);
        assert_eq!(picked.len(), 5);
    }

    #[test]
    fn each_node_watches_its_own_few_the_same_at_every_lookup() {
        let members: Vec<String> = (0..100).map(|i| format!("n{i}")).collect();
        let pick = |me: &str, mut m: Vec<String>| {
            watch_order(me, &mut m, |s| s.as_str(), 16);
            m
        };
        let a = pick("a", members.clone());
        assert_eq!(a.len(), 16);
        let mut reversed = members.clone();
        reversed.reverse();
        assert_eq!(pick("a", reversed), a, "the order listed does not matter");
        assert_ne!(pick("b", members), a, "another node watches others");
    }
}
