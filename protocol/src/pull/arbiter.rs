//! Who decides a chunk's hash when no tracker vouches for it: the registry,
//! asked about one chunk at a time, never one member alone.
//!
//! Without a tracker (the DHT's mode, or while every replica is down) a pull
//! takes the hashes of the chunks it fetches from its peers' answers. A
//! member may lie: claim chunks with hashes of bytes of its own. The
//! [`Arbiter`] keeps, for each chunk, the claim the pull took and who made
//! it, and turns a lie into evidence the pull acts on:
//!
//! - **Disputes.** Two members claiming different hashes for one chunk, or a
//!   member sending bytes that fail the claim taken, are a dispute: one of
//!   them lies. The pull fetches that one chunk from the registry
//!   ([`Arbiter::next_check`]); every member whose claim the registry's
//!   bytes contradict is a liar ([`Arbiter::registry_says`]).
//! - **A failed digest.** Every chunk matched a claim and the blob failed
//!   its digest: some claimant lied where nobody contradicted it. The pull
//!   checks one chunk of the claimant with the most unchecked claims, then
//!   of the next ([`Arbiter::digest_failed`]), one chunk per claimant at
//!   most; a claimant whose checked chunk holds is cleared for this blob.
//! - **Agreeing claims.** Every member that claimed the hash taken is kept
//!   beside the first: liars that agree with each other (the same forged
//!   bytes) are ruled by one check, not one check each.
//! - **Rulings.** A liar's claims are all dropped (the chunks held under
//!   them are fetched again, from others), it is banned from the pull, and
//!   later claims of its are ignored. A claim that contradicts a hash the
//!   registry already gave is a lie at once, with no fetch.
//!
//! Members claim only what they checked first-hand (chunks fetched from the
//! registry, vouched by a tracker, or of a blob whose digest they verified:
//! the agent's store never offers a chunk it holds on another member's
//! word), so a contradicted claim is the claimant's own lie, not a relayed
//! one, and no honest member is ever ruled a liar. Each check costs one
//! chunk of registry egress and bans at least one member (a dispute has a
//! liar on one side), or clears one claimant (a failed digest): the checks
//! a pull makes are bounded by its members.

use crate::chunkmap::ChunkHash;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::Hash;

/// What became of a member's claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The first claim for the chunk: the pull takes it (unvouched).
    Taken,
    /// The same hash as the claim taken, or as the registry's.
    Agrees,
    /// It differs from the claim taken: the chunk waits for a check.
    Disputed,
    /// It contradicts the registry's hash: the claimant lied.
    Lied,
    /// The claimant was ruled a liar before: ignored.
    Ignored,
}

/// What a check at the registry found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruling<P> {
    /// Members whose claims the registry contradicted, newly ruled liars.
    pub liars: Vec<P>,
    /// Chunks whose taken claim was a liar's: their hash and bytes go.
    pub dropped: Vec<u32>,
}

impl<P> Default for Ruling<P> {
    fn default() -> Self {
        Self {
            liars: Vec::new(),
            dropped: Vec::new(),
        }
    }
}

/// One pull's claims, disputes and checks (see the module's doc).
#[derive(Debug)]
pub struct Arbiter<P> {
    /// Per chunk: the hash taken and every member that claimed it; none
    /// for the registry's (or a tracker's) word.
    taken: Vec<Option<(ChunkHash, Vec<P>)>>,
    /// Disputed chunks, with the claims against the one taken.
    disputes: BTreeMap<u32, Vec<(ChunkHash, P)>>,
    /// Chunks handed out for a check and not ruled on yet.
    checking: BTreeSet<u32>,
    liars: HashSet<P>,
    /// Claimants a check after a failed digest found right.
    cleared: HashSet<P>,
}

impl<P: Clone + Eq + Hash + Ord> Arbiter<P> {
    /// An arbiter for a blob of `chunks` chunks, none claimed.
    pub fn new(chunks: u32) -> Self {
        Self {
            taken: vec![None; chunks as usize],
            disputes: BTreeMap::new(),
            checking: BTreeSet::new(),
            liars: HashSet::new(),
            cleared: HashSet::new(),
        }
    }

    /// Whether `member` was ruled a liar.
    pub fn is_liar(&self, member: &P) -> bool {
        self.liars.contains(member)
    }

    /// The registry's (or a tracker's) hash for chunk `index`: vouched. A
    /// claim taken before that differs is the claimant's lie.
    pub fn vouched(&mut self, index: u32, hash: ChunkHash) -> Ruling<P> {
        self.registry_says(index, hash)
    }

    /// `member` says chunk `index` hashes to `hash`.
    pub fn claim(&mut self, index: u32, hash: ChunkHash, member: &P) -> (Claim, Ruling<P>) {
        if self.liars.contains(member) {
            return (Claim::Ignored, Ruling::default());
        }
        let Some(slot) = self.taken.get_mut(index as usize) else {
            return (Claim::Ignored, Ruling::default());
        };
        match slot {
            None => {
                *slot = Some((hash, vec![member.clone()]));
                (Claim::Taken, Ruling::default())
            }
            Some((h, by)) if *h == hash => {
                // Kept beside the first: a check against the hash rules
                // every member that claimed it.
                if !by.is_empty() && !by.contains(member) {
                    by.push(member.clone());
                }
                (Claim::Agrees, Ruling::default())
            }
            Some((_, by)) if by.is_empty() => (Claim::Lied, self.rule_liars(vec![member.clone()])),
            Some(_) => {
                // A member's first claim against the taken one stands: a
                // liar naming fresh hashes for one chunk at every answer
                // adds nothing, so a dispute holds one claim per member.
                let claims = self.disputes.entry(index).or_default();
                if !claims.iter().any(|(_, m)| m == member) {
                    claims.push((hash, member.clone()));
                }
                (Claim::Disputed, Ruling::default())
            }
        }
    }

    /// `member` sent bytes for chunk `index` that hash to `hash`, not to the
    /// claim taken: its bytes are its claim.
    pub fn sent(&mut self, index: u32, hash: ChunkHash, member: &P) -> (Claim, Ruling<P>) {
        self.claim(index, hash, member)
    }

    /// The next disputed chunk to fetch from the registry, if any is not
    /// under a check already.
    pub fn next_check(&mut self) -> Option<u32> {
        let index = *self.disputes.keys().find(|i| !self.checking.contains(i))?;
        self.checking.insert(index);
        Some(index)
    }

    /// The blob failed its digest with every chunk matching a claim: the
    /// chunk to check next, one of the claimant's with the most claims not
    /// yet checked (ties to the smallest id), its first, or `None` when
    /// every claimant's check held (a lie only the whole blob shows: the
    /// pull cannot tell whose, and goes to the registry alone).
    pub fn digest_failed(&mut self) -> Option<u32> {
        let mut claims: HashMap<&P, Vec<u32>> = HashMap::new();
        for (i, t) in self.taken.iter().enumerate() {
            let Some((_, by)) = t else { continue };
            if self.checking.contains(&(i as u32)) {
                continue;
            }
            for m in by.iter().filter(|m| !self.cleared.contains(*m)) {
                claims.entry(m).or_default().push(i as u32);
            }
        }
        let (_, chunks) = claims
            .into_iter()
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| b.0.cmp(a.0)))?;
        let index = chunks[0];
        self.checking.insert(index);
        Some(index)
    }

    /// A check of chunk `index` could not be made (the registry failed it):
    /// the chunk may be handed out again.
    pub fn check_failed(&mut self, index: u32) {
        self.checking.remove(&index);
    }

    /// The registry's bytes of chunk `index` hash to `hash`: every claimant
    /// of another hash for it is a liar, the others are cleared.
    pub fn registry_says(&mut self, index: u32, hash: ChunkHash) -> Ruling<P> {
        self.checking.remove(&index);
        let mut wrong = Vec::new();
        let mut right = Vec::new();
        let disputed = self.disputes.remove(&index).unwrap_or_default();
        let taken = self.taken.get_mut(index as usize).and_then(Option::take);
        let taken = taken
            .into_iter()
            .flat_map(|(h, by)| by.into_iter().map(move |m| (h, m)));
        for (h, m) in disputed.into_iter().chain(taken) {
            if h == hash { &mut right } else { &mut wrong }.push(m);
        }
        if let Some(slot) = self.taken.get_mut(index as usize) {
            *slot = Some((hash, Vec::new()));
        }
        self.cleared.extend(right);
        self.rule_liars(wrong)
    }

    /// Rules `members` liars: drops every claim of theirs still taken (a
    /// chunk goes when no member but liars claimed its hash) and their side
    /// of every dispute.
    fn rule_liars(&mut self, members: Vec<P>) -> Ruling<P> {
        let mut ruling = Ruling::default();
        for m in members {
            if self.liars.insert(m.clone()) {
                self.cleared.remove(&m);
                ruling.liars.push(m);
            }
        }
        if ruling.liars.is_empty() {
            return ruling;
        }
        for (i, slot) in self.taken.iter_mut().enumerate() {
            let Some((_, by)) = slot else { continue };
            if by.is_empty() || !by.iter().any(|m| self.liars.contains(m)) {
                continue;
            }
            by.retain(|m| !self.liars.contains(m));
            if by.is_empty() {
                *slot = None;
                ruling.dropped.push(i as u32);
            }
        }
        // A dispute whose other side was the liar's alone is settled: the
        // claims left are taken again when their members repeat them.
        self.disputes.retain(|_, claims| {
            claims.retain(|(_, m)| !self.liars.contains(m));
            !claims.is_empty()
        });
        let dropped: BTreeSet<u32> = ruling.dropped.iter().copied().collect();
        self.disputes.retain(|i, _| !dropped.contains(i));
        ruling.liars.sort();
        ruling
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> ChunkHash {
        [b; 32]
    }

    fn who(s: &str) -> String {
        s.to_string()
    }

    #[test]
    fn a_dispute_is_checked_once_and_the_contradicted_claimant_loses_every_claim() {
        let mut a = Arbiter::new(4);
        let (liar, honest) = (who("liar"), who("honest"));
        for i in 0..4 {
            assert_eq!(a.claim(i, h(100 + i as u8), &liar).0, Claim::Taken);
        }
        assert_eq!(a.claim(2, h(2), &honest).0, Claim::Disputed);
        assert_eq!(a.claim(2, h(2), &honest).0, Claim::Disputed);
        // Fresh hashes from one member do not grow the dispute.
        for b in 200..=255 {
            a.claim(2, h(b), &honest);
        }
        assert_eq!(a.disputes[&2].len(), 1);
        assert_eq!(a.next_check(), Some(2));
        assert_eq!(
            a.next_check(),
            None,
            "a chunk under a check is not handed out twice"
        );
        let ruling = a.registry_says(2, h(2));
        assert_eq!(ruling.liars, vec![liar.clone()]);
        assert_eq!(ruling.dropped, vec![0, 1, 3]);
        assert!(a.is_liar(&liar) && !a.is_liar(&honest));
        assert_eq!(a.claim(0, h(100), &liar).0, Claim::Ignored);
        // The liar's chunks are free for the honest member's word.
        assert_eq!(a.claim(0, h(0), &honest).0, Claim::Taken);
        assert_eq!(a.claim(2, h(2), &honest).0, Claim::Agrees);
    }

    #[test]
    fn the_taken_claim_wins_when_the_registry_agrees_with_it() {
        let mut a = Arbiter::new(2);
        let (first, second) = (who("a"), who("b"));
        a.claim(0, h(0), &first);
        a.claim(1, h(1), &first);
        // Bytes from the second that fail the claim taken are its claim.
        assert_eq!(a.sent(0, h(9), &second).0, Claim::Disputed);
        assert_eq!(a.next_check(), Some(0));
        let ruling = a.registry_says(0, h(0));
        assert_eq!(ruling.liars, vec![second.clone()]);
        assert!(ruling.dropped.is_empty(), "the liar had no claim taken");
        // A claim against the registry's hash is a lie at once.
        let third = who("c");
        let (claim, ruling) = a.claim(0, h(7), &third);
        assert_eq!(claim, Claim::Lied);
        assert_eq!(ruling.liars, vec![third]);
    }

    #[test]
    fn a_failed_digest_checks_one_chunk_per_claimant_most_claims_first_then_gives_up() {
        let mut a = Arbiter::new(6);
        let (big, small) = (who("big"), who("small"));
        for i in 0..4 {
            a.claim(i, h(i as u8), &big);
        }
        for i in 4..6 {
            a.claim(i, h(i as u8), &small);
        }
        assert_eq!(
            a.digest_failed(),
            Some(0),
            "the claimant of most chunks first"
        );
        // Its claim holds: cleared; the next claimant's turn.
        assert!(a.registry_says(0, h(0)).liars.is_empty());
        assert_eq!(a.digest_failed(), Some(4));
        let ruling = a.registry_says(4, h(44));
        assert_eq!(ruling.liars, vec![small]);
        assert_eq!(ruling.dropped, vec![5]);
        // Every claimant left was cleared: nothing more to check.
        assert_eq!(a.digest_failed(), None);
    }

    #[test]
    fn vouched_hashes_rule_out_earlier_claims_that_differ() {
        let mut a = Arbiter::new(3);
        let liar = who("liar");
        a.claim(0, h(50), &liar);
        a.claim(1, h(51), &liar);
        let ruling = a.vouched(0, h(0));
        assert_eq!(ruling.liars, vec![liar]);
        assert_eq!(ruling.dropped, vec![1]);
        assert_eq!(a.digest_failed(), None);
    }

    #[test]
    fn liars_that_agree_are_ruled_by_one_check_and_an_honest_agreement_keeps_the_chunk() {
        let mut a = Arbiter::new(4);
        let (l0, l1, honest) = (who("liar-0"), who("liar-1"), who("honest"));
        for i in 0..4 {
            assert_eq!(a.claim(i, h(100 + i as u8), &l0).0, Claim::Taken);
            assert_eq!(a.claim(i, h(100 + i as u8), &l1).0, Claim::Agrees);
        }
        assert_eq!(a.claim(3, h(3), &honest).0, Claim::Disputed);
        assert_eq!(a.digest_failed(), Some(0));
        let ruling = a.registry_says(0, h(0));
        assert_eq!(
            ruling.liars,
            vec![l0.clone(), l1.clone()],
            "one check, both"
        );
        assert_eq!(ruling.dropped, vec![1, 2, 3]);
        assert_eq!(a.claim(1, h(101), &l1).0, Claim::Ignored);
        // A chunk a liar and an honest member both claimed stays.
        let mut a = Arbiter::new(2);
        a.claim(0, h(0), &honest);
        a.claim(0, h(0), &l0);
        a.claim(1, h(101), &l0);
        assert_eq!(a.vouched(1, h(1)).dropped, Vec::<u32>::new());
        assert!(a.is_liar(&l0));
        assert_eq!(a.claim(0, h(0), &honest).0, Claim::Agrees);
        assert_eq!(
            a.digest_failed(),
            Some(0),
            "the honest claim is still taken"
        );
    }

    #[test]
    fn a_failed_check_hands_the_chunk_out_again() {
        let mut a = Arbiter::new(1);
        a.claim(0, h(1), &who("a"));
        a.claim(0, h(2), &who("b"));
        assert_eq!(a.next_check(), Some(0));
        a.check_failed(0);
        assert_eq!(a.next_check(), Some(0));
    }
}
