//! The tracker's scheduling core: which peers a node should pull a blob from,
//! and which chunks it should fetch from the registry itself.
//!
//! When N nodes pull the same blob at once, each chunk should leave the registry
//! about once. The scheduler stripes the chunks that nobody holds into short
//! contiguous runs and hands each run to one node, takes a run back when its node
//! stalls or disappears, and points every node at the peers holding what it
//! lacks. Like the rest of this crate it does no I/O and reads no clock: the
//! time arrives as an `Instant` argument, so the tracker service and the
//! discrete-event simulator drive the same code.
//!
//! All state is soft. A tracker that restarts answers the first delta announce
//! of each peer with `resend_full` and rebuilds from the full announces that
//! follow.
//!
//! Cost: an announce costs O(chunks it changes + runs it is handed + a bounded
//! sample of candidate peers x bitfield bytes), never O(nodes x chunks); a tick
//! costs O(peers + outstanding runs).

use crate::planted::{self, Bug};
use crate::{Bitfield, BlobDigest};
use rustc_hash::{FxHashMap, FxHashSet};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Tunables. The defaults suit 4 MiB chunks and a registry reachable at a few
/// MiB/s per node.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// How often peers are told to announce.
    pub announce_interval: Duration,
    /// A peer silent for more than this many intervals is dropped.
    pub expiry_intervals: u32,
    /// Peers handed out per wanted blob (K).
    pub peers_per_blob: usize,
    /// Holders scored per answer; bounds the work of an announce in big swarms.
    pub peer_sample: usize,
    /// Chunks per registry assignment. One chunk per node spreads the first
    /// copies over as many uplinks as possible (measured in `simulations`).
    pub stripe_chunks: u32,
    /// Registry assignments a node may hold at once, over all blobs, in a
    /// crowd; a swarm of few members gets more each (`min_blob_runs`).
    pub max_outstanding: usize,
    /// Registry assignments a blob's swarm of few members keeps going at
    /// once: each member that holds a chunk of it may hold up to
    /// `min_blob_runs` divided by the members (rounded up), if that is more
    /// than `max_outstanding`. One run per node spreads a storm's first
    /// copies over many uplinks, but a node pulling alone fetched an image
    /// one 4 MiB chunk at a time, at what one request moves
    /// (`docs/results.md`, "A node pulling alone"). Only past its first
    /// chunk: at a storm's start every swarm has one member for a moment.
    /// Within the origin's budget (`max_runs_per_origin`) like every run.
    pub min_blob_runs: usize,
    /// Live registry assignments per origin (the registry its pullers fetch a
    /// blob from), over all its blobs and nodes (0: no limit). Few concurrent
    /// registry fetches finish (and can be forwarded) soon; many share the
    /// registry and all finish late. The budget is the registry's, not a
    /// blob's: an image of ten layers pulled at once must not bring ten times
    /// the fetches (24: `docs/results.md`). A sharded tracker budgets per shard.
    pub max_runs_per_origin: usize,
    /// The slowest registry fetch rate (bytes/s) tolerated before a run is taken back.
    pub min_fetch_rate: u64,
    /// Floor on an assignment's deadline, for small runs and slow starts.
    pub min_fetch_timeout: Duration,
    /// Ceiling on an assignment's deadline, so a bogus blob size cannot park chunks.
    pub max_fetch_timeout: Duration,
    /// How long a bad-chunk report counts (a report counts only from a
    /// peer the tracker named the offender to, for that blob).
    pub report_window: Duration,
    /// Distinct peers one reporter may accuse within `report_window`; one
    /// more and the reporter is banned instead (a report storm is the
    /// liar's sign: an honest node meets few bad peers).
    pub max_accused_per_reporter: usize,
    /// Distinct nodes, each having assembled the blob, whose digest-failure
    /// reports start a recheck of its chunks against the registry (each node
    /// counts once per `report_window`). A recheck costs the swarm up to one
    /// more copy of the blob: one liar claiming a failure must not be enough,
    /// while a real failure is met by every node that assembles the blob,
    /// moments apart.
    pub digest_failure_quorum: usize,
    /// How long a silent-peer report counts, for its reporter's cap and
    /// its offender's tally (see [`Scheduler::report_silent`]).
    pub silent_window: Duration,
    /// Distinct peers one reporter may report silent within
    /// `silent_window`; its further reports are not taken.
    pub max_silent_per_reporter: usize,
    /// A first ban's length; each later ban of the same peer lasts twice the
    /// one before, up to `max_ban`.
    pub ban: Duration,
    pub max_ban: Duration,
    /// Largest chunk count accepted, so an announce cannot make us allocate without bound.
    pub max_chunks: u32,
    /// Blobs tracked at once; an announce of one more is refused.
    pub max_blobs: usize,
    /// Chunks over all tracked blobs (each costs a holder count and an
    /// assignment bit), so many huge blobs cannot exhaust memory.
    pub max_total_chunks: u64,
    /// Blobs one peer may hold or want at once.
    pub max_blobs_per_peer: usize,
    /// Chunks over one peer's blobs (each costs a bit of its holdings).
    pub max_chunks_per_peer: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            announce_interval: Duration::from_secs(10),
            expiry_intervals: 3,
            peers_per_blob: 8,
            peer_sample: 64,
            stripe_chunks: 1,
            max_outstanding: 1,
            min_blob_runs: 4,
            max_runs_per_origin: 24,
            min_fetch_rate: 1 << 20,
            min_fetch_timeout: Duration::from_secs(5),
            max_fetch_timeout: Duration::from_secs(600),
            report_window: Duration::from_secs(3600),
            max_accused_per_reporter: 16,
            digest_failure_quorum: 2,
            silent_window: Duration::from_secs(60),
            max_silent_per_reporter: 16,
            ban: Duration::from_secs(600),
            max_ban: Duration::from_secs(24 * 3600),
            // 1 TiB in 4 MiB chunks; 16 GiB in the smallest (64 KiB).
            max_chunks: 1 << 18,
            max_blobs: 100_000,
            // 16 TiB of blobs in 4 MiB chunks: 16 MiB of holder counts.
            max_total_chunks: 1 << 22,
            max_blobs_per_peer: 4096,
            max_chunks_per_peer: 1 << 20,
        }
    }
}

/// What a peer says it holds of one blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// Every chunk held: replaces what the tracker knew.
    Bits(Bitfield),
    /// Chunks verified since the last announce (the whole set in a full announce).
    Added(Vec<u32>),
}

/// One blob in an announce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobAnnounce {
    pub digest: BlobDigest,
    /// Chunks in the blob, from its chunk map.
    pub chunk_count: u32,
    /// Blob size in bytes; 0 if unknown (deadlines then assume default-size chunks).
    pub size: u64,
    /// Chunk size in bytes; 0 if unknown. With `size` and `chunk_count` it is
    /// the blob's geometry, which every announce and chunk map must agree on.
    pub chunk_size: u32,
    pub held: Held,
    /// The peer is pulling this blob and wants peers and assignments for it.
    pub wanted: bool,
    /// Where the peer pulls the blob from (its registry's base URL), so that
    /// blobs of one registry share its run budget; empty: unknown, and the
    /// blob has a budget of its own.
    pub origin: String,
    /// The peer's registry answered a `Range` request for the blob with
    /// the whole blob: see [`Scheduler::announce`]'s runs.
    pub ranges_ignored: bool,
}

/// The longest peer address an announce may carry (the tracker refuses a
/// longer one): a few addresses of a dual-stack node fit.
pub const MAX_ADDRESS_BYTES: usize = 256;

/// A peer's periodic report, as in the `Announce` message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announce {
    pub peer: String,
    /// host:port of the peer's QUIC endpoint (several, comma-separated, on a
    /// dual-stack node): handed out as it is.
    pub address: String,
    pub upload_bytes_per_s: u64,
    /// Uploads in progress right now.
    pub active_uploads: u32,
    /// Topology labels such as zone and rack.
    pub labels: BTreeMap<String, String>,
    pub blobs: Vec<BlobAnnounce>,
    /// `blobs` is the peer's complete state: blobs not listed are dropped.
    pub full: bool,
}

/// A peer worth asking for chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerContact {
    pub peer: String,
    pub address: String,
}

/// Fetch chunks `[first, first + count)` of `digest` from the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub digest: BlobDigest,
    pub first: u32,
    pub count: u32,
    /// After this the run may be taken back if its chunks are still unheld:
    /// once it also lags three times behind the blob's finished runs (see
    /// `LATE_FACTOR`).
    pub deadline: Instant,
}

/// The answer to an announce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnounceDecision {
    /// Up to K peers per wanted blob, best first.
    pub peers: BTreeMap<BlobDigest, Vec<PeerContact>>,
    /// Every registry run the peer holds now (not only the new ones), so a lost
    /// response costs nothing and a run missing here was taken back.
    pub assignments: Vec<Assignment>,
    /// Announce again within this.
    pub interval: Duration,
    /// The tracker has no state for this peer: send a full announce.
    pub resend_full: bool,
    /// Wanted blobs with registry runs live (this peer's or others'), or
    /// owed (a published chunk left without a holder): the swarm is waiting
    /// on the registry, not stalled, however long a chunk takes.
    pub fetching: Vec<BlobDigest>,
    /// Blob entries of the announce that were ignored, and why.
    pub rejected: Vec<ScheduleError>,
    /// For every blob the peer holds complete: how many members hold it
    /// complete, and this peer's place among them (see [`CompleteHolders`]).
    pub holders: Vec<CompleteHolders>,
}

/// A blob's complete copies in the cluster, as one holder is told them.
///
/// `rank` orders the complete holders by a hash of (blob, peer id), the same
/// for every node: the `k` lowest ranks are the blob's keepers when a node
/// garbage-collects with `keep_cluster_copies = k`, so nodes that evict at
/// the same time never all drop one blob (each knows whether it is one of
/// the `k` that keep it without asking the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompleteHolders {
    pub digest: BlobDigest,
    /// Members (not banned) holding every chunk.
    pub complete: u32,
    /// Complete holders ranked before this peer.
    pub rank: u32,
}

/// The keeper order of `peer` for `digest` (see [`CompleteHolders`]).
fn keeper_hash(digest: &BlobDigest, peer: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = rustc_hash::FxHasher::default();
    digest.as_bytes().hash(&mut h);
    peer.hash(&mut h);
    h.finish()
}

/// A peer sent a chunk that failed its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadChunk {
    pub reporter: String,
    pub offender: String,
    pub digest: BlobDigest,
    pub index: u32,
    /// The tracker verified the claim itself: one such report is enough.
    pub confirmed: bool,
}

/// What a silence report did ([`Scheduler::report_silent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Doubt {
    /// Chunks it made owed a registry run.
    pub owed: u32,
    /// The reporter had reported the offender in this blob already (within
    /// `silent_window`): it only keeps the offender doubted.
    pub repeat: bool,
}

/// A peer left a request for one of its chunks unanswered past the
/// request's deadline: not a byte of it came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Silent {
    pub reporter: String,
    pub offender: String,
    pub digest: BlobDigest,
    pub index: u32,
}

/// How much a peer is trusted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Standing {
    /// Distinct peers whose reports of it count now.
    pub reporters: usize,
    /// No longer handed out, its holdings ignored, no registry runs, its
    /// reports not taken.
    pub banned: bool,
    /// Bans it has had (the current one included).
    pub bans: u32,
    /// Distinct peers whose reports of its silence count now.
    pub silent_reporters: usize,
}

/// A blob's geometry as the tracker knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub size: u64,
    /// 0 while no announce said.
    pub chunk_size: u32,
    pub chunk_count: u32,
}

/// What a tick changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Peers dropped for silence.
    pub expired: Vec<String>,
    /// Peers whose ban ended.
    pub unbanned: Vec<String>,
    /// Runs taken back from stalled peers, with the peer that held them.
    pub reclaimed: Vec<(String, Assignment)>,
}

/// Why an input was refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("blob {digest}: chunk count {got} is outside 1..={max}")]
    ChunkCountOutOfRange {
        digest: BlobDigest,
        got: u32,
        max: u32,
    },
    #[error("blob {digest} has {expected} chunks at the tracker but the announce says {got}")]
    ChunkCountMismatch {
        digest: BlobDigest,
        expected: u32,
        got: u32,
    },
    #[error(
        "blob {digest} is {expected_size} bytes in {expected_chunk_size}-byte chunks at the tracker, but the announce says {got_size} bytes in {got_chunk_size}-byte chunks"
    )]
    GeometryMismatch {
        digest: BlobDigest,
        expected_size: u64,
        expected_chunk_size: u32,
        got_size: u64,
        got_chunk_size: u32,
    },
    #[error(
        "blob {digest} would be blob number {limit} plus one, or take the tracker past {max_total_chunks} chunks over all blobs (it has {chunk_count}); refused"
    )]
    TooManyBlobs {
        digest: BlobDigest,
        limit: usize,
        max_total_chunks: u64,
        chunk_count: u32,
    },
    #[error(
        "peer {peer:?} already holds or wants {blobs} blobs ({chunks} chunks); blob {digest} would pass the limit of {max_blobs} blobs or {max_chunks} chunks per peer"
    )]
    TooManyBlobsForPeer {
        peer: String,
        digest: BlobDigest,
        blobs: usize,
        chunks: u64,
        max_blobs: usize,
        max_chunks: u64,
    },
    #[error(
        "peer {reporter:?} reports chunk {index} of {digest} from {offender:?}, but the tracker never named {offender:?} to it for that blob"
    )]
    NotNamed {
        reporter: String,
        offender: String,
        digest: BlobDigest,
        index: u32,
    },
    #[error("peer {0:?} is banned: its reports are not taken")]
    ReporterBanned(String),
    #[error(
        "peer {reporter:?} reported {reported} peers for corrupt chunks within {window:?}: its reports of others are not taken until some lapse"
    )]
    BadChunkReportLimit {
        reporter: String,
        reported: usize,
        window: Duration,
    },
    #[error(
        "peer {reporter:?} reported {reported} peers silent within {window:?}: its silence reports are not taken until some lapse"
    )]
    SilenceReportLimit {
        reporter: String,
        reported: usize,
        window: Duration,
    },
    #[error(
        "peer {peer:?} holds {held} of the {chunk_count} chunks of {digest}: only a node that assembled every chunk can report that the blob failed its digest"
    )]
    NotAHolder {
        peer: String,
        digest: BlobDigest,
        held: u32,
        chunk_count: u32,
    },
    #[error(
        "peer {peer:?} reported that {digest} failed its digest, but it reported a failure {ago:?} ago: a node is believed once per {window:?}"
    )]
    FailureReportLimit {
        peer: String,
        digest: BlobDigest,
        ago: Duration,
        window: Duration,
    },
    #[error("blob {digest}: bitfield of {got} chunks for a blob of {expected}")]
    BitfieldLength {
        digest: BlobDigest,
        expected: u32,
        got: u32,
    },
    #[error("blob {digest}: chunk {index} is past the last chunk ({chunk_count} chunks)")]
    ChunkOutOfRange {
        digest: BlobDigest,
        index: u32,
        chunk_count: u32,
    },
    #[error("peer {0:?} is not known to the tracker (it must announce first)")]
    UnknownPeer(String),
    #[error("blob {0} is not known to the tracker")]
    UnknownBlob(BlobDigest),
    #[error("peer {0:?} reported itself")]
    SelfReport(String),
}

/// Index into the peer slab: peer ids are strings, but the hot sets hold these.
type PeerKey = u32;

#[derive(Debug)]
struct Peer {
    id: String,
    address: String,
    capacity: u64,
    active_uploads: u32,
    /// Times handed out since its last announce: load the peer has not reported yet.
    handed_out: u32,
    labels: BTreeMap<String, String>,
    last_announce: Instant,
    blobs: BTreeSet<BlobDigest>,
    /// Its runs, as (blob, first chunk).
    runs: BTreeSet<(BlobDigest, u32)>,
    /// A peer that stalled gets no runs before this, so the run goes elsewhere.
    no_runs_before: Option<Instant>,
    /// Its record says banned (kept here: every answer checks each
    /// candidate): named to nobody, its holdings ignored, no runs.
    banned: bool,
    /// Its ban ended: its next announce must be a full one, as the
    /// holdings it announced while banned were not taken.
    resend_full: bool,
}

/// The peers a member was last named for a blob (its candidates for
/// bad-chunk reports), newest last.
const NAMED_KEPT: usize = 64;

#[derive(Debug)]
struct Member {
    held: Bitfield,
    /// Peers the tracker named to it for this blob, at most `NAMED_KEPT`.
    named: Vec<PeerKey>,
    wants: bool,
    /// When it joined: a node's runs go to its blobs oldest first.
    joined: u64,
    /// Position in `Swarm::sources` while it holds anything.
    source_slot: Option<usize>,
    /// Position in `Swarm::roster`.
    roster_slot: usize,
    /// Its [`keeper_hash`] for the blob, taken as it joins (its place in
    /// `Swarm::complete`).
    keeper: u64,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    peer: PeerKey,
    count: u32,
    assigned: Instant,
    /// When the run is judged late unless more of it came: its window's
    /// timeout after it was assigned or after its last progress.
    deadline: Instant,
    /// The whole run's time at the minimum rate (how long its fetcher gets
    /// no other run once it stalled, how long its chunks await their hash).
    timeout: Duration,
    /// The time allowed for its window: as much of it as a run of the
    /// config's stripe is (the whole run, unless it runs to the blob's end).
    window: Duration,
    /// Its chunks served at the last tick, and since when: a run that
    /// runs to a blob's end is judged by its progress, window by window, so
    /// a fetcher that sits on it loses it as soon as one that sits on a
    /// short run would, not after the whole blob's timeout.
    progress: (u32, Instant),
}

/// At most this share (1/n) of a swarm's members are doubted (reported
/// silent or corrupt) at once.
const DOUBTED_SHARE: usize = 4;

/// Members that must say their registry ignores `Range` (a majority of a
/// swarm's, and at least this many) before its runs go out one at a time:
/// the first member of a swarm alone must not decide it.
const WHOLE_READERS: usize = 3;

/// A recheck fetches at most this share (1/n) of a blob's chunks at once.
const RECHECK_SHARE: u32 = 8;

/// A run past its deadline is taken back only once it has also taken this
/// many times as long per chunk as the blob's finished runs do.
const LATE_FACTOR: f64 = 3.0;
/// Weight of the newest finished run in a blob's moving average of run pace.
const PACE_WEIGHT: f64 = 0.25;

/// One blob's swarm.
#[derive(Debug)]
struct Swarm {
    chunk_count: u32,
    /// Exact size and chunk size, 0 until an announce says.
    size: u64,
    chunk_size: u32,
    /// Who the registry run covering each chunk went to, while its hash is
    /// unpublished: a registry chunk's hash is taken from that node.
    fetchers: FxHashMap<u32, Arc<str>>,
    /// Chunks whose hash the tracker holds. A holder of a chunk without one
    /// is of no use to anybody (nobody can check what it sends), so only
    /// hashed chunks with a holder are spared a registry run: a node that
    /// claims every chunk cannot stop the registry fetches.
    hashed: Bitfield,
    /// Approximate bytes per chunk, for deadlines.
    chunk_bytes: u64,
    /// Members (not banned) holding each chunk.
    holders: Vec<u32>,
    held_chunks: u32,
    /// Members holding every chunk (so not banned: a banned peer's holdings
    /// are cleared and its claims not taken), as (`Member::keeper`, key)
    /// sorted by keeper order: an answer to a complete holder reads its
    /// rank here, where a pass over every member took most of the tracker's
    /// time at the end of the simulator's `storm-10k`.
    complete: Vec<(u64, PeerKey)>,
    /// Chunks covered by a live run, or awaiting their fetcher's hash.
    assigned: Bitfield,
    /// Members an asker reported silent, with when (for `silent_window`):
    /// a chunk all of whose holders are among them is owed a registry run
    /// as if nobody held it.
    doubted: FxHashMap<PeerKey, Instant>,
    /// Holders of each chunk that are in `doubted`.
    doubted_holders: Vec<u32>,
    /// Chunks whose run ended when its fetcher held them, before their hash
    /// arrived, with the time they are given up on: the fetcher takes its
    /// next run at once (its hash publication is under way), while nobody
    /// else is sent for the chunk unless the hash never comes. With the
    /// fetcher: one awaiting chunk each, so a fetcher that claims its runs
    /// and publishes nothing holds back two chunks at a time, not one per
    /// announce.
    awaiting_hash: BTreeMap<u32, (Instant, PeerKey)>,
    /// Members that held every chunk at once since the last recheck
    /// started: they may report that the blob failed its digest, also after
    /// they dropped chunks (a member that drops the blob leaves this too).
    assembled: FxHashSet<PeerKey>,
    /// Peers that reported a digest failure since the last recheck started
    /// (fewer than `digest_failure_quorum`).
    failure_reporters: Vec<PeerKey>,
    /// After a digest failure: chunks still to be fetched again from the
    /// registry and compared with their published hash, next last, in an
    /// order no node chooses. Empty once a chunk's hash was replaced.
    recheck: Vec<u32>,
    /// Chunks being rechecked: their hash counts as unsettled (a registry
    /// run goes out for each) until their new fetcher publishes it again.
    rechecking: BTreeSet<u32>,
    /// Every chunk below this is held or assigned; whatever frees a chunk pulls it back.
    cursor: u32,
    /// Fx hashing: keys are our own slab indices, not input a peer chooses.
    members: FxHashMap<PeerKey, Member>,
    /// Members holding at least one chunk, for sampling without a full scan.
    sources: Vec<PeerKey>,
    rotation: usize,
    /// Every member, for sampling neighbours that hold nothing yet.
    roster: Vec<PeerKey>,
    roster_rotation: usize,
    /// Live runs by first chunk; they never overlap.
    runs: BTreeMap<u32, Run>,
    /// The origin its pullers named last (empty: none yet).
    origin: String,
    /// Live runs of every swarm of that origin (this swarm's alone until one
    /// is named), kept by `add_run`, `remove_run` and drop.
    origin_runs: Arc<AtomicUsize>,
    /// Seconds per chunk the blob's finished runs took (moving average; None
    /// until one finishes). A deadline alone cannot tell a stalled fetcher
    /// from a registry too slow for the runs sharing it: taking those back
    /// has another node fetch the same chunks while the first still does,
    /// which slows the registry further, until every chunk is fetched many
    /// times over (a stampede: `docs/results.md`). Only a run slower than its
    /// peers is taken back.
    run_pace: Option<f64>,
    /// Members whose registry answered a `Range` request with the whole
    /// blob. Once they are a majority of the members and at least
    /// [`WHOLE_READERS`], the swarm's runs go out one at a time, each to the
    /// blob's end (`top_up`): a few members' word (liars') changes nothing.
    whole_readers: FxHashSet<PeerKey>,
}

impl Drop for Swarm {
    fn drop(&mut self) {
        self.origin_runs
            .fetch_sub(self.runs.len(), Ordering::Relaxed);
    }
}

impl Swarm {
    fn new(chunk_count: u32, chunk_bytes: u64) -> Self {
        Self {
            chunk_count,
            size: 0,
            chunk_size: 0,
            fetchers: FxHashMap::default(),
            hashed: Bitfield::new(chunk_count),
            chunk_bytes,
            holders: vec![0; chunk_count as usize],
            held_chunks: 0,
            complete: Vec::new(),
            assigned: Bitfield::new(chunk_count),
            doubted: FxHashMap::default(),
            doubted_holders: vec![0; chunk_count as usize],
            awaiting_hash: BTreeMap::new(),
            assembled: FxHashSet::default(),
            failure_reporters: Vec::new(),
            recheck: Vec::new(),
            rechecking: BTreeSet::new(),
            cursor: 0,
            members: FxHashMap::default(),
            sources: Vec::new(),
            rotation: 0,
            roster: Vec::new(),
            roster_rotation: 0,
            runs: BTreeMap::new(),
            origin: String::new(),
            origin_runs: Arc::default(),
            run_pace: None,
            whole_readers: FxHashSet::default(),
        }
    }

    /// Counts this swarm's runs against `origin`'s budget from now on.
    fn set_origin(&mut self, origin: &str, runs: Arc<AtomicUsize>) {
        let live = self.runs.len();
        runs.fetch_add(live, Ordering::Relaxed);
        self.origin_runs.fetch_sub(live, Ordering::Relaxed);
        self.origin = origin.to_owned();
        self.origin_runs = runs;
    }

    /// Makes `key` a member (holding nothing) if it is not one yet, joined
    /// at `now` (a count of the scheduler's joins), of keeper order `keeper`.
    fn join(&mut self, key: PeerKey, now: u64, keeper: impl FnOnce() -> u64) -> &mut Member {
        let roster = &mut self.roster;
        let chunk_count = self.chunk_count;
        self.members.entry(key).or_insert_with(|| {
            roster.push(key);
            Member {
                held: Bitfield::new(chunk_count),
                named: Vec::new(),
                wants: false,
                joined: now,
                source_slot: None,
                roster_slot: roster.len() - 1,
                keeper: keeper(),
            }
        })
    }

    /// Forgets member `key` and its holdings.
    fn remove_member(&mut self, key: PeerKey) {
        self.clear_holdings(key);
        self.doubted.remove(&key);
        self.assembled.remove(&key);
        self.failure_reporters.retain(|&k| k != key);
        self.whole_readers.remove(&key);
        let Some(m) = self.members.remove(&key) else {
            return;
        };
        self.roster.swap_remove(m.roster_slot);
        if let Some(&moved) = self.roster.get(m.roster_slot)
            && let Some(m2) = self.members.get_mut(&moved)
        {
            m2.roster_slot = m.roster_slot;
        }
    }

    /// Chunk `i` needs a registry run: nobody fetches it, and nobody holds
    /// it under a hash the swarm can check.
    fn is_free(&self, i: u32) -> bool {
        i < self.chunk_count
            && !self.assigned.get(i)
            && (self.holders[i as usize] == 0 || !self.hashed.get(i) || self.owed(i))
    }

    /// Chunk `i` is held, and every holder was reported silent.
    fn owed(&self, i: u32) -> bool {
        let held = self.holders[i as usize];
        held > 0 && self.doubted_holders[i as usize] == held
    }

    /// An asker reported member `key` silent at `now`: the chunks it holds
    /// that only doubted members hold are owed runs. Returns how many
    /// became so.
    fn doubt(&mut self, key: PeerKey, now: Instant) -> u32 {
        if let Some(at) = self.doubted.get_mut(&key) {
            *at = now;
            return 0;
        }
        // At most a quarter of the members at once: members reporting every
        // peer named to them as silent doubt no more than that.
        if self.doubted.len() >= (self.members.len() / DOUBTED_SHARE).max(1) {
            return 0;
        }
        self.doubted.insert(key, now);
        let held: Vec<u32> = self
            .members
            .get(&key)
            .map_or_else(Vec::new, |m| m.held.ones().collect());
        let mut owed = 0;
        for i in held {
            self.doubted_holders[i as usize] += 1;
            if self.owed(i) && self.hashed.get(i) {
                owed += 1;
                self.note_maybe_free(i);
            }
        }
        owed
    }

    /// Forgets the reports of silence older than `window`.
    fn lapse_doubts(&mut self, now: Instant, window: Duration) {
        let old: Vec<PeerKey> = self
            .doubted
            .iter()
            .filter(|&(_, &t)| now.saturating_duration_since(t) > window)
            .map(|(&k, _)| k)
            .collect();
        for key in old {
            self.undoubt(key);
        }
    }

    fn undoubt(&mut self, key: PeerKey) {
        if self.doubted.remove(&key).is_none() {
            return;
        }
        if let Some(m) = self.members.get(&key) {
            for i in m.held.ones() {
                self.doubted_holders[i as usize] -= 1;
            }
        }
    }

    /// Whether a published chunk is owed a run it has not got: its holders
    /// were dropped (banned, gone), or its only holder was reported silent,
    /// and a run will fetch it again as the registry budget allows. A pull
    /// lacking it is waiting on the tracker, not starving.
    fn owes_run(&self) -> bool {
        // Asked at every announce of a swarm without runs: a blob nothing
        // of which is hashed yet (a layer waiting for the registry budget)
        // is not scanned.
        self.hashed.count() > 0
            && (self.cursor..self.chunk_count).any(|i| self.hashed.get(i) && self.is_free(i))
    }

    /// Whether `m` takes registry runs: it wants the blob and lacks chunks,
    /// or holds them all while they are rechecked (a node whose blob failed
    /// its digest keeps its chunks and helps find the wrong one).
    fn runs_for(&self, m: &Member) -> bool {
        m.wants && (!m.held.is_full() || !self.rechecking.is_empty())
    }

    /// Unsettles the next chunks of the recheck, up to an eighth of the blob
    /// at once: each goes to a registry run, and the search for a wrong
    /// chunk fetches at most an eighth of a copy more than it needs.
    fn start_rechecks(&mut self) {
        let parallel = (self.chunk_count / RECHECK_SHARE).max(1) as usize;
        while self.rechecking.len() < parallel {
            let Some(i) = self.recheck.pop() else {
                return;
            };
            if self.hashed.clear(i) {
                self.rechecking.insert(i);
                self.note_maybe_free(i);
            }
        }
    }

    /// Chunk `i` has a hash now: its holders serve it, and a run it was the
    /// last unserved chunk of is dropped into `dropped`. False if it had one.
    fn settle(&mut self, i: u32, dropped: &mut Vec<(u32, Run)>) -> bool {
        self.fetchers.remove(&i);
        if i >= self.chunk_count || !self.hashed.set(i) {
            return false;
        }
        if self.awaiting_hash.remove(&i).is_some() {
            self.assigned.clear(i);
            self.note_maybe_free(i);
        }
        if self.holders[i as usize] > 0 {
            self.drop_run_if_served(i, dropped);
        }
        true
    }

    /// Chunk `i` can be had from a peer and checked: held, and hashed, and
    /// not held only by a peer reported silent.
    fn is_served(&self, i: u32) -> bool {
        self.holders[i as usize] > 0 && self.hashed.get(i) && !self.owed(i)
    }

    /// The run covering chunk `i`, once each of its chunks is served or
    /// held by the run's own fetcher, is dropped and returned so the caller
    /// can update its peer. Its chunks still without a hash await it until
    /// the run's deadline plus its timeout.
    fn drop_run_if_served(&mut self, i: u32, dropped: &mut Vec<(u32, Run)>) {
        let Some((&first, run)) = self.runs.range(..=i).next_back() else {
            return;
        };
        if i >= first + run.count {
            return;
        }
        let range = first..first + run.count;
        if !range.clone().all(|c| self.is_served(c)) {
            let fetcher = self.members.get(&run.peer).map(|m| &m.held);
            let awaiting = self.awaiting_hash.values().any(|&(_, k)| k == run.peer);
            if awaiting
                || !range
                    .into_iter()
                    .all(|c| self.is_served(c) || fetcher.is_some_and(|h| h.get(c)))
            {
                return;
            }
        }
        let Some(run) = self.remove_run(first) else {
            return;
        };
        let until = run
            .deadline
            .checked_add(run.timeout)
            .unwrap_or(run.deadline);
        for c in first..first + run.count {
            if !self.hashed.get(c) {
                self.assigned.set(c);
                self.awaiting_hash.insert(c, (until, run.peer));
            }
        }
        dropped.push((first, run));
    }

    fn note_maybe_free(&mut self, i: u32) {
        if self.is_free(i) {
            self.cursor = self.cursor.min(i);
        }
    }

    /// Marks chunk `i` held by `key`; a run whose chunks are now all served is
    /// dropped and returned so the caller can update its peer.
    fn add_chunk(&mut self, key: PeerKey, i: u32, dropped: &mut Vec<(u32, Run)>) {
        let Some(m) = self.members.get_mut(&key) else {
            return;
        };
        if !m.held.set(i) {
            return;
        }
        if m.held.is_full() {
            self.assembled.insert(key);
            let at = self.complete.partition_point(|&(h, _)| h <= m.keeper);
            self.complete.insert(at, (m.keeper, key));
        }
        if m.source_slot.is_none() {
            m.source_slot = Some(self.sources.len());
            self.sources.push(key);
        }
        let count = &mut self.holders[i as usize];
        *count += 1;
        if *count == 1 {
            self.held_chunks += 1;
        }
        if !self.doubted.is_empty() && self.doubted.contains_key(&key) {
            self.doubted_holders[i as usize] += 1;
            self.note_maybe_free(i);
        }
        self.drop_run_if_served(i, dropped);
    }

    fn remove_chunk(&mut self, key: PeerKey, i: u32) {
        let Some(m) = self.members.get_mut(&key) else {
            return;
        };
        let was_full = m.held.is_full();
        if !m.held.clear(i) {
            return;
        }
        if was_full {
            let from = self.complete.partition_point(|&(h, _)| h < m.keeper);
            if let Some(k) = self.complete[from..].iter().position(|&(_, k)| k == key) {
                self.complete.remove(from + k);
            }
        }
        let empty = m.held.count() == 0;
        let count = &mut self.holders[i as usize];
        *count -= 1;
        if *count == 0 {
            self.held_chunks -= 1;
        }
        if !self.doubted.is_empty() && self.doubted.contains_key(&key) {
            self.doubted_holders[i as usize] -= 1;
        }
        // Its last holder gone, or its last one not reported silent.
        self.note_maybe_free(i);
        if empty {
            self.remove_source(key);
        }
    }

    fn remove_source(&mut self, key: PeerKey) {
        let Some(slot) = self
            .members
            .get_mut(&key)
            .and_then(|m| m.source_slot.take())
        else {
            return;
        };
        self.sources.swap_remove(slot);
        if let Some(&moved) = self.sources.get(slot)
            && let Some(m) = self.members.get_mut(&moved)
        {
            m.source_slot = Some(slot);
        }
    }

    /// Makes `key`'s holdings equal `bits` (same length, checked by the caller),
    /// touching only the bytes that differ.
    fn replace_holdings(&mut self, key: PeerKey, bits: &Bitfield, dropped: &mut Vec<(u32, Run)>) {
        for (j, &new) in bits.as_bytes().iter().enumerate() {
            let Some(old) = self.members.get(&key).map(|m| m.held.as_bytes()[j]) else {
                return;
            };
            if old == new {
                continue;
            }
            for b in 0..8u32 {
                let mask = 0x80u8 >> b;
                let i = j as u32 * 8 + b;
                match (old & mask != 0, new & mask != 0) {
                    (false, true) => self.add_chunk(key, i, dropped),
                    (true, false) => self.remove_chunk(key, i),
                    _ => {}
                }
            }
        }
    }

    fn clear_holdings(&mut self, key: PeerKey) {
        let held: Vec<u32> = match self.members.get(&key) {
            Some(m) => m.held.ones().collect(),
            None => return,
        };
        for i in held {
            self.remove_chunk(key, i);
        }
        self.remove_source(key);
    }

    /// Renews the deadline of each run more of whose chunks are served
    /// than at the last tick (its next window starts now), and drops into
    /// `dropped` those each of whose chunks is served (a doubt lapsed).
    fn note_progress(&mut self, now: Instant, dropped: &mut Vec<(u32, Run)>) {
        let served: Vec<(u32, u32)> = self
            .runs
            .iter()
            .filter_map(|(&first, run)| {
                let done = (first..first + run.count)
                    .filter(|&c| self.is_served(c))
                    .count() as u32;
                (done > run.progress.0).then_some((first, done))
            })
            .collect();
        for (first, done) in served {
            if let Some(run) = self.runs.get_mut(&first) {
                run.progress = (done, now);
                run.deadline = now.checked_add(run.window).unwrap_or(now);
                if done == run.count {
                    self.drop_run_if_served(first, dropped);
                }
            }
        }
    }

    fn add_run(&mut self, first: u32, run: Run) {
        if self.runs.insert(first, run).is_none() {
            self.origin_runs.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remove_run(&mut self, first: u32) -> Option<Run> {
        let run = self.runs.remove(&first)?;
        self.origin_runs.fetch_sub(1, Ordering::Relaxed);
        for i in first..first + run.count {
            self.assigned.clear(i);
            self.note_maybe_free(i);
        }
        Some(run)
    }

    /// The next run of up to `max` contiguous chunks nobody holds or fetches,
    /// marked assigned.
    fn take_free_run(&mut self, max: u32) -> Option<(u32, u32)> {
        while self.cursor < self.chunk_count && !self.is_free(self.cursor) {
            self.cursor += 1;
        }
        if self.cursor >= self.chunk_count {
            return None;
        }
        let first = self.cursor;
        let mut count = 0;
        while count < max.max(1) && self.is_free(first + count) {
            self.assigned.set(first + count);
            count += 1;
        }
        Some((first, count))
    }
}

/// What the tracker remembers of a peer's conduct; outlives the peer.
#[derive(Debug, Default)]
struct Record {
    /// Who reported it, and when: reports lapse after `report_window`.
    reporters: BTreeMap<String, Instant>,
    /// Whom it accused, and when.
    accused: BTreeMap<String, Instant>,
    banned: bool,
    banned_until: Option<Instant>,
    bans: u32,
    /// Who reported its requests unanswered, and when: these lapse after
    /// `silent_window`.
    silent_reporters: BTreeMap<String, Instant>,
    /// Whom it reported silent, in which blobs, and when (lapsing after
    /// `silent_window`). Per blob: a peer that withholds one layer of an
    /// image withholds the next, and its reporters' first report must not
    /// stand for every layer (each swarm doubts it on its own).
    reported_silent: BTreeMap<String, BTreeMap<BlobDigest, Instant>>,
    /// When it last reported a digest failure that counted: one per
    /// `report_window`, so that a few liars claiming failures cost the swarm
    /// at most a copy of a blob per window.
    reported_failure: Option<Instant>,
}

impl Record {
    fn standing(&self) -> Standing {
        Standing {
            reporters: self.reporters.len(),
            banned: self.banned,
            bans: self.bans,
            silent_reporters: self.silent_reporters.len(),
        }
    }

    /// Bans for `base` doubled per earlier ban, at most `max`.
    fn ban(&mut self, now: Instant, base: Duration, max: Duration) {
        let length = base.saturating_mul(1u32 << self.bans.min(16)).min(max);
        self.banned = true;
        self.banned_until = now.checked_add(length);
        self.bans = self.bans.saturating_add(1);
        self.reporters.clear();
        self.accused.clear();
    }

    /// Drops bad-chunk reports older than `window` and silent-peer reports
    /// older than `silence`.
    fn lapse(&mut self, now: Instant, window: Duration, silence: Duration) {
        let fresh = |t: &mut Instant| now.saturating_duration_since(*t) <= window;
        self.reporters.retain(|_, t| fresh(t));
        self.accused.retain(|_, t| fresh(t));
        let recent = |t: &mut Instant| now.saturating_duration_since(*t) <= silence;
        self.silent_reporters.retain(|_, t| recent(t));
        self.reported_silent.retain(|_, blobs| {
            blobs.retain(|_, t| recent(t));
            !blobs.is_empty()
        });
        if self
            .reported_failure
            .is_some_and(|t| now.saturating_duration_since(t) > window)
        {
            self.reported_failure = None;
        }
    }

    fn is_idle(&self) -> bool {
        !self.banned
            && self.reporters.is_empty()
            && self.accused.is_empty()
            && self.silent_reporters.is_empty()
            && self.reported_silent.is_empty()
            && self.reported_failure.is_none()
    }
}

/// The tracker's scheduler: all swarms, all peers, driven by announces,
/// reports and ticks.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    slots: Vec<Option<Peer>>,
    free_slots: Vec<PeerKey>,
    index: HashMap<String, PeerKey>,
    swarms: HashMap<BlobDigest, Swarm>,
    /// The live-run count of each origin's swarms, while any swarm has it.
    origins: HashMap<String, Weak<AtomicUsize>>,
    /// Outlives the peer itself, so leaving and rejoining clears nothing.
    records: HashMap<String, Record>,
    /// Registry runs handed out since start (a monotonic count for metrics).
    runs_assigned: u64,
    /// Chunks over all swarms, against `max_total_chunks`.
    total_chunks: u64,
    /// Members that joined a swarm so far: each member's join time.
    joins: u64,
    /// The last tick: a longer gap than [`STOPPED_GAP`] since then is time
    /// the tracker was stopped.
    last_tick: Option<Instant>,
}

/// A gap between ticks past this means the tracker itself was stopped
/// (SIGSTOP, a paused VM): the time it missed is not held against its
/// peers' announces nor its fetchers' runs. Without this, a tracker stopped
/// past its runs' deadlines took back, on its first tick, every run that
/// was being fetched all along, and barred those fetchers from runs for as
/// long; stopped past the expiry, it dropped every peer at once.
const STOPPED_GAP: Duration = Duration::from_secs(2);

/// The run count shared by the swarms of `origin`; forgets origins no swarm has.
fn origin_budget(
    origins: &mut HashMap<String, Weak<AtomicUsize>>,
    origin: &str,
) -> Arc<AtomicUsize> {
    if let Some(runs) = origins.get(origin).and_then(Weak::upgrade) {
        return runs;
    }
    origins.retain(|_, runs| runs.strong_count() > 0);
    let runs = Arc::new(AtomicUsize::new(0));
    origins.insert(origin.to_owned(), Arc::downgrade(&runs));
    runs
}

fn peer_mut(slots: &mut [Option<Peer>], key: PeerKey) -> Option<&mut Peer> {
    slots.get_mut(key as usize).and_then(Option::as_mut)
}

fn peer_ref(slots: &[Option<Peer>], key: PeerKey) -> Option<&Peer> {
    slots.get(key as usize).and_then(Option::as_ref)
}

impl Scheduler {
    /// An empty scheduler, as after a (re)start.
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            swarms: HashMap::new(),
            origins: HashMap::new(),
            records: HashMap::new(),
            runs_assigned: 0,
            total_chunks: 0,
            joins: 0,
            last_tick: None,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Peers currently known.
    pub fn peer_count(&self) -> usize {
        self.index.len()
    }

    /// Blobs with at least one member now.
    pub fn blob_count(&self) -> usize {
        self.swarms.len()
    }

    /// Registry runs handed out since start, reclaimed ones included.
    pub fn runs_assigned(&self) -> u64 {
        self.runs_assigned
    }

    /// Usable peers holding chunk `index` of `digest` (0 if unknown).
    pub fn holders(&self, digest: &BlobDigest, index: u32) -> u32 {
        self.swarms
            .get(digest)
            .and_then(|s| s.holders.get(index as usize).copied())
            .unwrap_or(0)
    }

    /// Chunks of `digest` that no usable peer holds; `None` if the blob is unknown.
    pub fn unheld_chunks(&self, digest: &BlobDigest) -> Option<u32> {
        self.swarms
            .get(digest)
            .map(|s| s.chunk_count - s.held_chunks)
    }

    /// Live registry runs of `digest`, with the peer holding each, by first chunk.
    pub fn assignments(&self, digest: &BlobDigest) -> Vec<(String, Assignment)> {
        let Some(swarm) = self.swarms.get(digest) else {
            return Vec::new();
        };
        swarm
            .runs
            .iter()
            .filter_map(|(&first, run)| {
                let peer = peer_ref(&self.slots, run.peer)?;
                Some((peer.id.clone(), assignment(*digest, first, run)))
            })
            .collect()
    }

    /// The peers known now and not banned, with their topology labels.
    pub fn members(&self) -> impl Iterator<Item = (&str, &BTreeMap<String, String>)> {
        self.slots
            .iter()
            .flatten()
            .filter(|p| !p.banned)
            .map(|p| (p.id.as_str(), &p.labels))
    }

    /// Whether `peer` is known now (it announced and did not expire).
    pub fn knows(&self, peer: &str) -> bool {
        self.index.contains_key(peer)
    }

    /// The geometry of `digest`'s swarm, if the blob is tracked.
    pub fn geometry(&self, digest: &BlobDigest) -> Option<Geometry> {
        self.swarms.get(digest).map(|s| Geometry {
            size: s.size,
            chunk_size: s.chunk_size,
            chunk_count: s.chunk_count,
        })
    }

    /// The peer the registry run covering chunk `index` of `digest` went to,
    /// while that chunk's hash is not settled.
    pub fn registry_fetcher(&self, digest: &BlobDigest, index: u32) -> Option<&str> {
        self.swarms.get(digest)?.fetchers.get(&index).map(|p| &**p)
    }

    /// Chunk `index` of `digest` has a hash now: nobody need vouch for it,
    /// its holders can serve it, and a run it was the last unserved chunk
    /// of is done.
    pub fn hash_settled(&mut self, digest: &BlobDigest, index: u32, now: Instant) {
        let Some(swarm) = self.swarms.get_mut(digest) else {
            return;
        };
        let mut dropped = Vec::new();
        if swarm.settle(index, &mut dropped) && swarm.rechecking.remove(&index) {
            swarm.start_rechecks();
        }
        self.finish_runs(*digest, dropped, now);
    }

    /// Whether chunk `index` of `digest` is being fetched again from the
    /// registry after a digest failure: its new fetcher's hash may differ
    /// from the published one (see [`Scheduler::chunk_replaced`]).
    pub fn rechecking(&self, digest: &BlobDigest, index: u32) -> bool {
        self.swarms
            .get(digest)
            .is_some_and(|s| s.rechecking.contains(&index))
    }

    /// The recheck of `digest` found chunk `index` wrong, and its hash was
    /// replaced by the new fetcher's: the search ends (the rest of the blob
    /// is taken to be right until nodes report the digest failing again).
    pub fn chunk_replaced(&mut self, digest: &BlobDigest, index: u32, now: Instant) {
        let Some(swarm) = self.swarms.get_mut(digest) else {
            return;
        };
        swarm.recheck.clear();
        let mut dropped = Vec::new();
        for i in std::mem::take(&mut swarm.rechecking)
            .into_iter()
            .chain([index])
        {
            swarm.settle(i, &mut dropped);
        }
        self.finish_runs(*digest, dropped, now);
    }

    /// Runs of `digest` dropped because each of their chunks is served: their
    /// peers may take new ones, and their pace joins the blob's average.
    fn finish_runs(&mut self, digest: BlobDigest, dropped: Vec<(u32, Run)>, now: Instant) {
        for (first, run) in dropped {
            if let Some(peer) = peer_mut(&mut self.slots, run.peer) {
                peer.runs.remove(&(digest, first));
            }
            let Some(swarm) = self.swarms.get_mut(&digest) else {
                continue;
            };
            let pace = now.saturating_duration_since(run.assigned).as_secs_f64()
                / f64::from(run.count.max(1));
            swarm.run_pace = Some(match swarm.run_pace {
                Some(avg) => avg + (pace - avg) * PACE_WEIGHT,
                None => pace,
            });
        }
    }

    pub fn standing(&self, peer: &str) -> Standing {
        self.records
            .get(peer)
            .map(Record::standing)
            .unwrap_or_default()
    }

    /// Takes in an announce and answers it.
    pub fn announce(&mut self, announce: Announce, now: Instant) -> AnnounceDecision {
        let mut decision = AnnounceDecision {
            peers: BTreeMap::new(),
            assignments: Vec::new(),
            interval: self.config.announce_interval,
            resend_full: false,
            fetching: Vec::new(),
            rejected: Vec::new(),
            holders: Vec::new(),
        };
        let key = match self.index.get(&announce.peer) {
            Some(&key) => key,
            None if !announce.full => {
                // A delta means nothing without the base it applies to.
                decision.resend_full = true;
                return decision;
            }
            None => self.insert_peer(&announce.peer, now),
        };
        let Some(peer) = peer_mut(&mut self.slots, key) else {
            return decision;
        };
        let banned = peer.banned;
        if std::mem::take(&mut peer.resend_full) && !announce.full {
            // Its holdings are not known: a delta cannot say them.
            peer.resend_full = true;
            decision.resend_full = true;
        }
        peer.address = announce.address;
        peer.capacity = announce.upload_bytes_per_s;
        peer.active_uploads = announce.active_uploads;
        peer.handed_out = 0;
        peer.labels = announce.labels;
        peer.last_announce = now;
        if announce.full {
            let listed: BTreeSet<BlobDigest> = announce.blobs.iter().map(|b| b.digest).collect();
            let gone: Vec<BlobDigest> = peer.blobs.difference(&listed).copied().collect();
            for digest in gone {
                self.leave_swarm(key, digest);
            }
        }
        for blob in announce.blobs {
            // Banned peers' claims are not trusted.
            if let Err(e) = self.apply_blob(key, blob, announce.full, banned, now) {
                decision.rejected.push(e);
            }
        }
        let cooling = peer_ref(&self.slots, key)
            .and_then(|p| p.no_runs_before)
            .is_some_and(|t| now < t);
        if !banned && !cooling {
            self.top_up(key, now);
        }
        let wanted: Vec<BlobDigest> = peer_ref(&self.slots, key)
            .map(|p| p.blobs.iter().copied().collect())
            .unwrap_or_default();
        for digest in wanted {
            let Some(swarm) = self.swarms.get(&digest) else {
                continue;
            };
            let pulling = swarm.members.get(&key).is_some_and(|m| swarm.runs_for(m));
            if pulling && (!swarm.runs.is_empty() || swarm.owes_run()) {
                decision.fetching.push(digest);
            }
            if pulling {
                decision
                    .peers
                    .insert(digest, self.select_peers(key, digest));
            }
        }
        decision.holders = self.complete_holders(key);
        if let Some(peer) = peer_ref(&self.slots, key) {
            decision.assignments = peer
                .runs
                .iter()
                .filter_map(|&(digest, first)| {
                    let run = self.swarms.get(&digest)?.runs.get(&first)?;
                    Some(assignment(digest, first, run))
                })
                .collect();
        }
        decision
    }

    /// [`CompleteHolders`] of every blob `key` holds complete, read from
    /// each swarm's complete members in keeper order.
    fn complete_holders(&self, key: PeerKey) -> Vec<CompleteHolders> {
        let Some(peer) = peer_ref(&self.slots, key) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for digest in &peer.blobs {
            let Some(swarm) = self.swarms.get(digest) else {
                continue;
            };
            let Some(mine) = swarm.members.get(&key).filter(|m| m.held.is_full()) else {
                continue;
            };
            // Ranked before it: a lower keeper order, or the same and a
            // lower id.
            let below = swarm.complete.partition_point(|&(h, _)| h < mine.keeper);
            let ties = swarm.complete[below..]
                .iter()
                .take_while(|&&(h, _)| h == mine.keeper)
                .filter(|&&(_, k)| peer_ref(&self.slots, k).is_some_and(|o| o.id < peer.id))
                .count();
            out.push(CompleteHolders {
                digest: *digest,
                complete: swarm.complete.len() as u32,
                rank: (below + ties) as u32,
            });
        }
        out
    }

    fn insert_peer(&mut self, id: &str, now: Instant) -> PeerKey {
        let peer = Peer {
            id: id.to_owned(),
            address: String::new(),
            capacity: 0,
            active_uploads: 0,
            handed_out: 0,
            labels: BTreeMap::new(),
            last_announce: now,
            blobs: BTreeSet::new(),
            runs: BTreeSet::new(),
            no_runs_before: None,
            banned: self.records.get(id).is_some_and(|r| r.banned),
            resend_full: false,
        };
        let key = match self.free_slots.pop() {
            Some(key) => {
                self.slots[key as usize] = Some(peer);
                key
            }
            None => {
                self.slots.push(Some(peer));
                (self.slots.len() - 1) as PeerKey
            }
        };
        self.index.insert(id.to_owned(), key);
        key
    }

    /// Validates one blob entry completely before changing anything.
    fn apply_blob(
        &mut self,
        key: PeerKey,
        blob: BlobAnnounce,
        full: bool,
        ignore_holdings: bool,
        now: Instant,
    ) -> Result<(), ScheduleError> {
        let digest = blob.digest;
        let n = blob.chunk_count;
        if n == 0 || n > self.config.max_chunks {
            return Err(ScheduleError::ChunkCountOutOfRange {
                digest,
                got: n,
                max: self.config.max_chunks,
            });
        }
        match self.swarms.get(&digest) {
            Some(swarm) if swarm.chunk_count != n => {
                return Err(ScheduleError::ChunkCountMismatch {
                    digest,
                    expected: swarm.chunk_count,
                    got: n,
                });
            }
            Some(swarm)
                if (swarm.size != 0 && blob.size != 0 && swarm.size != blob.size)
                    || (swarm.chunk_size != 0
                        && blob.chunk_size != 0
                        && swarm.chunk_size != blob.chunk_size) =>
            {
                return Err(ScheduleError::GeometryMismatch {
                    digest,
                    expected_size: swarm.size,
                    expected_chunk_size: swarm.chunk_size,
                    got_size: blob.size,
                    got_chunk_size: blob.chunk_size,
                });
            }
            Some(_) => {}
            None if self.swarms.len() >= self.config.max_blobs
                || self.total_chunks + u64::from(n) > self.config.max_total_chunks =>
            {
                return Err(ScheduleError::TooManyBlobs {
                    digest,
                    limit: self.config.max_blobs,
                    max_total_chunks: self.config.max_total_chunks,
                    chunk_count: n,
                });
            }
            None => {}
        }
        if let Some(peer) = peer_ref(&self.slots, key)
            && !peer.blobs.contains(&digest)
        {
            let chunks: u64 = peer
                .blobs
                .iter()
                .filter_map(|d| self.swarms.get(d))
                .map(|s| u64::from(s.chunk_count))
                .sum();
            if peer.blobs.len() >= self.config.max_blobs_per_peer
                || chunks + u64::from(n) > self.config.max_chunks_per_peer
            {
                return Err(ScheduleError::TooManyBlobsForPeer {
                    peer: peer.id.clone(),
                    digest,
                    blobs: peer.blobs.len(),
                    chunks,
                    max_blobs: self.config.max_blobs_per_peer,
                    max_chunks: self.config.max_chunks_per_peer,
                });
            }
        }
        match &blob.held {
            Held::Bits(bits) if bits.len() != n => {
                return Err(ScheduleError::BitfieldLength {
                    digest,
                    expected: n,
                    got: bits.len(),
                });
            }
            Held::Added(added) => {
                if let Some(&index) = added.iter().find(|&&i| i >= n) {
                    return Err(ScheduleError::ChunkOutOfRange {
                        digest,
                        index,
                        chunk_count: n,
                    });
                }
            }
            Held::Bits(_) => {}
        }
        let chunk_bytes = (blob.size > 0).then(|| blob.size.div_ceil(u64::from(n)));
        let total_chunks = &mut self.total_chunks;
        let swarm = self.swarms.entry(digest).or_insert_with(|| {
            *total_chunks += u64::from(n);
            Swarm::new(n, chunk_bytes.unwrap_or(crate::DEFAULT_CHUNK_SIZE.into()))
        });
        if let Some(bytes) = chunk_bytes {
            swarm.chunk_bytes = bytes;
        }
        if swarm.size == 0 {
            swarm.size = blob.size;
        }
        if swarm.chunk_size == 0 {
            swarm.chunk_size = blob.chunk_size;
        }
        let slots = &self.slots;
        let member = swarm.join(key, self.joins, || {
            peer_ref(slots, key).map_or(0, |p| keeper_hash(&digest, &p.id))
        });
        member.wants = blob.wanted;
        if member.joined == self.joins {
            self.joins += 1;
        }
        if blob.wanted && !blob.origin.is_empty() && blob.origin != swarm.origin {
            swarm.set_origin(&blob.origin, origin_budget(&mut self.origins, &blob.origin));
        }
        if blob.wanted && blob.ranges_ignored {
            swarm.whole_readers.insert(key);
        }
        if let Some(peer) = peer_mut(&mut self.slots, key) {
            peer.blobs.insert(digest);
        }
        let mut dropped = Vec::new();
        if !ignore_holdings {
            match blob.held {
                Held::Bits(bits) => swarm.replace_holdings(key, &bits, &mut dropped),
                Held::Added(added) if full => {
                    let mut bits = Bitfield::new(n);
                    for i in added {
                        bits.set(i);
                    }
                    swarm.replace_holdings(key, &bits, &mut dropped);
                }
                Held::Added(added) => {
                    for i in added {
                        swarm.add_chunk(key, i, &mut dropped);
                    }
                }
            }
        }
        self.finish_runs(digest, dropped, now);
        self.prune_member(key, digest);
        Ok(())
    }

    /// A member that neither holds nor wants the blob is of no use to the swarm.
    fn prune_member(&mut self, key: PeerKey, digest: BlobDigest) {
        let idle = self
            .swarms
            .get(&digest)
            .and_then(|s| s.members.get(&key))
            .is_some_and(|m| !m.wants && m.held.count() == 0);
        if idle {
            self.leave_swarm(key, digest);
        }
    }

    fn leave_swarm(&mut self, key: PeerKey, digest: BlobDigest) {
        let Some(peer) = peer_mut(&mut self.slots, key) else {
            return;
        };
        peer.blobs.remove(&digest);
        let firsts: Vec<u32> = peer
            .runs
            .range((digest, 0)..=(digest, u32::MAX))
            .map(|&(_, first)| first)
            .collect();
        for &first in &firsts {
            peer.runs.remove(&(digest, first));
        }
        let Some(swarm) = self.swarms.get_mut(&digest) else {
            return;
        };
        for first in firsts {
            swarm.remove_run(first);
        }
        swarm.remove_member(key);
        if swarm.members.is_empty()
            && let Some(gone) = self.swarms.remove(&digest)
        {
            self.total_chunks -= u64::from(gone.chunk_count);
        }
    }

    /// Gives `key` registry runs up to its outstanding limit, to the blobs it
    /// wants in the order it joined their swarms: a node pulling an image
    /// alone gets its layers in the order it asked for them.
    fn top_up(&mut self, key: PeerKey, now: Instant) {
        let Some(peer) = peer_mut(&mut self.slots, key) else {
            return;
        };
        let mut blobs: Vec<(u64, BlobDigest)> = peer
            .blobs
            .iter()
            .filter_map(|digest| {
                let swarm = self.swarms.get(digest)?;
                let m = swarm.members.get(&key)?;
                swarm.runs_for(m).then_some((m.joined, *digest))
            })
            .collect();
        blobs.sort_unstable();
        for (_, digest) in blobs {
            let Some(swarm) = self.swarms.get_mut(&digest) else {
                continue;
            };
            let fetched = swarm.members.get(&key).is_some_and(|m| m.held.count() > 0);
            let limit = match fetched {
                true => self
                    .config
                    .max_outstanding
                    .max(self.config.min_blob_runs.div_ceil(swarm.members.len())),
                false => self.config.max_outstanding,
            };
            // Where the registry ignores `Range`, every request reads the
            // blob from its first byte: one run at a time, to the blob's
            // end, reads its answer once (the agent's registry client keeps
            // it open from one chunk to the next), where runs spread over
            // many nodes each read the blob's prefix again. Only once a
            // majority of the members, and at least `WHOLE_READERS`, said
            // so: a run to the end that a withholder fetches is a blob's
            // worth of chunks nobody else gets until its holder is doubted.
            let readers = swarm.whole_readers.len();
            let (stripe, limit) =
                match readers >= WHOLE_READERS && readers * 2 > swarm.members.len() {
                    true if !swarm.runs.is_empty() => continue,
                    true => (u32::MAX, peer.runs.len() + 1),
                    false => (self.config.stripe_chunks, limit),
                };
            while peer.runs.len() < limit
                && (self.config.max_runs_per_origin == 0
                    || swarm.origin_runs.load(Ordering::Relaxed) < self.config.max_runs_per_origin)
            {
                let Some((first, count)) = swarm.take_free_run(stripe) else {
                    break;
                };
                let timeout = fetch_timeout(&self.config, u64::from(count) * swarm.chunk_bytes);
                let window = fetch_timeout(
                    &self.config,
                    u64::from(count.min(self.config.stripe_chunks.max(1))) * swarm.chunk_bytes,
                );
                let fetcher: Arc<str> = Arc::from(peer.id.as_str());
                for i in first..first + count {
                    swarm.fetchers.insert(i, fetcher.clone());
                }
                swarm.add_run(
                    first,
                    Run {
                        peer: key,
                        count,
                        assigned: now,
                        deadline: now.checked_add(window).unwrap_or(now),
                        timeout,
                        window,
                        progress: (0, now),
                    },
                );
                peer.runs.insert((digest, first));
                self.runs_assigned += 1;
            }
        }
    }

    /// Up to K peers for `asker`, best first: holding something it lacks, then
    /// sharing more topology labels, then least loaded, then most capacity.
    /// Members that hold nothing useful yet still fill the places holders leave:
    /// in a storm they are the mesh along which the first chunks spread, seen
    /// as soon as the holder gains a chunk (long-polled bitfields), not at the
    /// asker's next announce.
    fn select_peers(&mut self, asker: PeerKey, digest: BlobDigest) -> Vec<PeerContact> {
        let Some(swarm) = self.swarms.get_mut(&digest) else {
            return Vec::new();
        };
        let Some(me) = peer_ref(&self.slots, asker) else {
            return Vec::new();
        };
        let mine = swarm.members.get(&asker).map(|m| &m.held);
        // Rotating the sample windows spreads askers over all holders and
        // members when there are more than we score per answer.
        let holders = rotated_sample(&swarm.sources, &mut swarm.rotation, self.config.peer_sample);
        let others = rotated_sample(
            &swarm.roster,
            &mut swarm.roster_rotation,
            self.config.peers_per_blob,
        );
        let mut candidates: Vec<PeerKey> = holders.chain(others).collect();
        let mut seen = FxHashSet::default();
        candidates.retain(|&k| k != asker && seen.insert(k));
        let mut scored: Vec<_> = candidates
            .into_iter()
            .filter_map(|k| {
                let p = peer_ref(&self.slots, k)?;
                if p.banned {
                    return None;
                }
                let theirs = &swarm.members.get(&k)?.held;
                let useful = mine.is_none_or(|mine| theirs.has_any_missing_from(mine));
                let locality = me
                    .labels
                    .iter()
                    .filter(|(key, v)| p.labels.get(*key) == Some(*v))
                    .count();
                let load = p.active_uploads.saturating_add(p.handed_out);
                Some((
                    (
                        Reverse(useful),
                        Reverse(locality),
                        load,
                        Reverse(p.capacity),
                    ),
                    k,
                ))
            })
            .collect();
        // Stable: ties keep the rotated order.
        scored.sort_by_key(|&(score, _)| score);
        scored.truncate(self.config.peers_per_blob);
        if let Some(m) = swarm.members.get_mut(&asker) {
            for &(_, k) in &scored {
                if !m.named.contains(&k) {
                    if m.named.len() >= NAMED_KEPT {
                        m.named.remove(0);
                    }
                    m.named.push(k);
                }
            }
        }
        scored
            .into_iter()
            .filter_map(|(_, k)| {
                let p = peer_mut(&mut self.slots, k)?;
                p.handed_out = p.handed_out.saturating_add(1);
                Some(PeerContact {
                    peer: p.id.clone(),
                    address: p.address.clone(),
                })
            })
            .collect()
    }

    /// The peer left: forget it and take back its runs. Returns whether it was known.
    pub fn leave(&mut self, peer: &str) -> bool {
        match self.index.get(peer) {
            Some(&key) => {
                self.remove_peer(key);
                true
            }
            None => false,
        }
    }

    fn remove_peer(&mut self, key: PeerKey) {
        let Some(peer) = peer_ref(&self.slots, key) else {
            return;
        };
        let blobs: Vec<BlobDigest> = peer.blobs.iter().copied().collect();
        for digest in blobs {
            self.leave_swarm(key, digest);
        }
        if let Some(peer) = self.slots.get_mut(key as usize).and_then(Option::take) {
            self.index.remove(&peer.id);
            self.free_slots.push(key);
        }
    }

    /// A peer sent a chunk that failed its hash. Members' word is doubt, as
    /// a silence report is, however many say it: the offender keeps its
    /// holdings and stays named, and what only doubted members hold is
    /// owed a registry run (every node it lies to bans it from its own
    /// pull at once). Only a report the tracker confirmed itself bans it for
    /// a while (`ban`, doubling on each repeat): its holdings and runs go.
    /// Banning on three members' word let a quarter of colluding accusers
    /// ban honest members between them, and counting members did not
    /// help: accusers pick the swarms they join, and after a restart the
    /// first to announce (`docs/results.md`, "False corruption reports").
    /// Distinct reporters are counted within `report_window` (the
    /// offender's standing, for the log). A reporter's reports of more than
    /// `max_accused_per_reporter` peers in that window are refused, and it
    /// is not punished: banning it let that many liars, each sending it a
    /// bad chunk, ban an honest node between them.
    pub fn report_bad_chunk(
        &mut self,
        report: &BadChunk,
        now: Instant,
    ) -> Result<Standing, ScheduleError> {
        let (_, offender) = self.check_report(
            &report.reporter,
            &report.offender,
            report.digest,
            report.index,
            report.confirmed,
        )?;
        let (window, base, max) = (
            self.config.report_window,
            self.config.ban,
            self.config.max_ban,
        );
        let accuser = self.records.entry(report.reporter.clone()).or_default();
        accuser.lapse(now, window, self.config.silent_window);
        let cap = self.config.max_accused_per_reporter;
        if !accuser.accused.contains_key(&report.offender) && accuser.accused.len() >= cap {
            return Err(ScheduleError::BadChunkReportLimit {
                reporter: report.reporter.clone(),
                reported: accuser.accused.len(),
                window,
            });
        }
        accuser.accused.insert(report.offender.clone(), now);
        let record = self.records.entry(report.offender.clone()).or_default();
        record.lapse(now, window, self.config.silent_window);
        let was_banned = record.banned;
        if !record.banned {
            record.reporters.insert(report.reporter.clone(), now);
            if report.confirmed {
                record.ban(now, base, max);
            }
        }
        let standing = record.standing();
        if let Some(key) = offender {
            if let Some(swarm) = self.swarms.get_mut(&report.digest) {
                match report.confirmed {
                    true => swarm.remove_chunk(key, report.index),
                    false => {
                        swarm.doubt(key, now);
                    }
                }
            }
            if standing.banned && !was_banned {
                self.ban(key);
            }
            self.prune_member(key, report.digest);
        }
        Ok(standing)
    }

    /// The reporter's and the offender's keys, if `reporter` may report
    /// `offender` for chunk `index` of `digest`: both differ, the reporter
    /// is known and not banned, the chunk exists, and the tracker named
    /// the offender to the reporter for that blob (unless `confirmed`).
    fn check_report(
        &self,
        reporter_id: &str,
        offender_id: &str,
        digest: BlobDigest,
        index: u32,
        confirmed: bool,
    ) -> Result<(PeerKey, Option<PeerKey>), ScheduleError> {
        if reporter_id == offender_id {
            return Err(ScheduleError::SelfReport(reporter_id.to_owned()));
        }
        let Some(&reporter) = self.index.get(reporter_id) else {
            return Err(ScheduleError::UnknownPeer(reporter_id.to_owned()));
        };
        if peer_ref(&self.slots, reporter).is_some_and(|p| p.banned) {
            return Err(ScheduleError::ReporterBanned(reporter_id.to_owned()));
        }
        let Some(swarm) = self.swarms.get(&digest) else {
            return Err(ScheduleError::UnknownBlob(digest));
        };
        if index >= swarm.chunk_count {
            return Err(ScheduleError::ChunkOutOfRange {
                digest,
                index,
                chunk_count: swarm.chunk_count,
            });
        }
        let offender = self.index.get(offender_id).copied();
        let named = offender.is_some_and(|o| {
            swarm
                .members
                .get(&reporter)
                .is_some_and(|m| m.named.contains(&o))
        });
        if !named && !confirmed {
            return Err(ScheduleError::NotNamed {
                reporter: reporter_id.to_owned(),
                offender: offender_id.to_owned(),
                digest,
                index,
            });
        }
        Ok((reporter, offender))
    }

    /// A peer's request to `offender`, a peer the tracker named to it for
    /// the blob, went unanswered past its deadline: a withholder (it
    /// announces chunks and serves none), or a frozen or crashed node.
    /// Askers drop such a peer from their pulls at once, but while the
    /// tracker counts it as the holder of chunks nobody else holds it hands
    /// nobody a registry run of them, and every pull starves for them and
    /// fetches them from the registry alone (`docs/results.md`,
    /// "Withholders"). So the chunks only the offender holds are owed a
    /// run, as if nobody held them, until a second member holds them (and
    /// pulls hear the blob is being fetched). Nothing else changes: the
    /// offender stays named, keeps its holdings and takes runs, because one
    /// asker's word is all this takes, and any member can say it (tried and
    /// dropped, each worse under members reporting every peer named to
    /// them: a quorum of three silencing the offender, ranking it last, or
    /// giving it no runs; `docs/results.md`, "Withholders"). What a false
    /// report costs is bounded: each reporter's first report of an
    /// offender in a blob within `silent_window` counts (a repeat only
    /// keeps the offender doubted: a pull repeats its reports while it
    /// runs, `pull::silence`), of at most `max_silent_per_reporter`
    /// offenders (further reports are refused, and the reporter is not
    /// punished: a node cut off from many peers is not lying), and each costs at most one more
    /// registry copy of the chunks only that offender held of that blob
    /// then. Says how many chunks the report made owed, and whether it
    /// repeated one already counted.
    pub fn report_silent(&mut self, report: &Silent, now: Instant) -> Result<Doubt, ScheduleError> {
        let (_, offender) = self.check_report(
            &report.reporter,
            &report.offender,
            report.digest,
            report.index,
            false,
        )?;
        let (window, silence, cap) = (
            self.config.report_window,
            self.config.silent_window,
            self.config.max_silent_per_reporter,
        );
        let reporter = self.records.entry(report.reporter.clone()).or_default();
        reporter.lapse(now, window, silence);
        let blobs = reporter.reported_silent.get(&report.offender);
        if blobs.is_some_and(|b| b.contains_key(&report.digest)) {
            // A repeat keeps the offender doubted (the pull dropped it for
            // good and still lacks what only it claims) and counts for
            // nothing else.
            let owed = match (offender, self.swarms.get_mut(&report.digest)) {
                (Some(key), Some(swarm)) => swarm.doubt(key, now),
                _ => 0,
            };
            return Ok(Doubt { owed, repeat: true });
        }
        if blobs.is_none() && reporter.reported_silent.len() >= cap {
            return Err(ScheduleError::SilenceReportLimit {
                reporter: report.reporter.clone(),
                reported: reporter.reported_silent.len(),
                window: silence,
            });
        }
        reporter
            .reported_silent
            .entry(report.offender.clone())
            .or_default()
            .insert(report.digest, now);
        let record = self.records.entry(report.offender.clone()).or_default();
        record.lapse(now, window, silence);
        record.silent_reporters.insert(report.reporter.clone(), now);
        let owed = match (offender, self.swarms.get_mut(&report.digest)) {
            (Some(key), Some(swarm)) => swarm.doubt(key, now),
            _ => 0,
        };
        Ok(Doubt {
            owed,
            repeat: false,
        })
    }

    /// Drops a banned peer's holdings and runs; it stays a member where it
    /// wants a blob, so it can still finish pulling from others.
    fn ban(&mut self, key: PeerKey) {
        let Some(peer) = peer_mut(&mut self.slots, key) else {
            return;
        };
        peer.banned = true;
        let runs = std::mem::take(&mut peer.runs);
        let blobs: Vec<BlobDigest> = peer.blobs.iter().copied().collect();
        for (digest, first) in runs {
            if let Some(swarm) = self.swarms.get_mut(&digest) {
                swarm.remove_run(first);
            }
        }
        for digest in blobs {
            if let Some(swarm) = self.swarms.get_mut(&digest) {
                swarm.clear_holdings(key);
            }
            self.prune_member(key, digest);
        }
    }

    /// A blob assembled from verified chunks failed its digest: some chunk's
    /// published hash is wrong. Taken only from a node that assembled the
    /// blob, and from each node once per `report_window`. Once
    /// `digest_failure_quorum` distinct nodes said so, the blob's chunks are
    /// rechecked: fetched again from the registry, an eighth of them at a
    /// time, in an order drawn from the digest, by members that want the
    /// blob, until a fetcher publishes a hash that differs (see
    /// [`Scheduler::chunk_replaced`]). Holders keep their chunks meanwhile:
    /// only the wrong one is fetched again by every node, and the registry
    /// sends about half a copy more on average, not a whole one. Returns
    /// true when this report started a recheck.
    pub fn blob_failed(
        &mut self,
        reporter: &str,
        digest: &BlobDigest,
        now: Instant,
    ) -> Result<bool, ScheduleError> {
        let Some(&key) = self.index.get(reporter) else {
            return Err(ScheduleError::UnknownPeer(reporter.to_owned()));
        };
        let Some(swarm) = self.swarms.get_mut(digest) else {
            return Err(ScheduleError::UnknownBlob(*digest));
        };
        if !swarm.assembled.contains(&key) {
            let held = swarm.members.get(&key).map_or(0, |m| m.held.count());
            return Err(ScheduleError::NotAHolder {
                peer: reporter.to_owned(),
                digest: *digest,
                held,
                chunk_count: swarm.chunk_count,
            });
        }
        let window = self.config.report_window;
        let record = self.records.entry(reporter.to_owned()).or_default();
        record.lapse(now, window, self.config.silent_window);
        if let Some(at) = record.reported_failure {
            return Err(ScheduleError::FailureReportLimit {
                peer: reporter.to_owned(),
                digest: *digest,
                ago: now.saturating_duration_since(at),
                window,
            });
        }
        record.reported_failure = Some(now);
        if !swarm.failure_reporters.contains(&key) {
            swarm.failure_reporters.push(key);
        }
        if swarm.failure_reporters.len() < self.config.digest_failure_quorum
            || !swarm.rechecking.is_empty()
        {
            return Ok(false);
        }
        swarm.failure_reporters.clear();
        swarm.assembled.clear();
        let mut order: Vec<u32> = (0..swarm.chunk_count).collect();
        order.sort_by_key(|&i| keeper_hash(digest, &i.to_string()));
        swarm.recheck = order;
        swarm.start_rechecks();
        Ok(true)
    }

    /// Expires silent peers and takes back runs past their deadline. A peer
    /// whose run stalled gets no new run for as long as that run was given.
    pub fn tick(&mut self, now: Instant) -> TickReport {
        let mut report = TickReport::default();
        if let Some(gap) = self
            .last_tick
            .replace(now)
            .map(|last| now.saturating_duration_since(last))
            .filter(|&gap| gap > STOPPED_GAP)
        {
            self.forgive(gap);
        }
        let limit = self
            .config
            .announce_interval
            .saturating_mul(self.config.expiry_intervals);
        let silent: Vec<PeerKey> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(k, p)| {
                let p = p.as_ref()?;
                (now.saturating_duration_since(p.last_announce) > limit).then_some(k as PeerKey)
            })
            .collect();
        for key in silent {
            if let Some(p) = peer_ref(&self.slots, key) {
                report.expired.push(p.id.clone());
            }
            self.remove_peer(key);
        }
        let (window, silence) = (self.config.report_window, self.config.silent_window);
        for (id, record) in &mut self.records {
            if record.banned && record.banned_until.is_some_and(|t| now >= t) {
                record.banned = false;
                record.banned_until = None;
                if let Some(peer) = self
                    .index
                    .get(id)
                    .and_then(|&k| peer_mut(&mut self.slots, k))
                {
                    peer.banned = false;
                    peer.resend_full = true;
                }
                report.unbanned.push(id.clone());
            }
            record.lapse(now, window, silence);
        }
        // A record with no ban and no live report is dropped unless it
        // counts past bans (which lengthen the next); records are made only
        // for peers the tracker knew, so they stay as few as its peers.
        self.records.retain(|_, r| !r.is_idle() || r.bans > 0);
        for (&digest, swarm) in &mut self.swarms {
            swarm.lapse_doubts(now, silence);
            // A fetcher's hash that never came: the chunk goes to another.
            let unhashed: Vec<u32> = swarm
                .awaiting_hash
                .iter()
                .filter(|&(_, &(until, _))| now >= until)
                .map(|(&c, _)| c)
                .collect();
            for c in unhashed {
                swarm.awaiting_hash.remove(&c);
                swarm.assigned.clear(c);
                swarm.note_maybe_free(c);
            }
            let mut served = Vec::new();
            swarm.note_progress(now, &mut served);
            for (first, run) in served {
                if let Some(peer) = peer_mut(&mut self.slots, run.peer) {
                    peer.runs.remove(&(digest, first));
                }
            }
            let pace = swarm.run_pace;
            let live = swarm.runs.len() as f64;
            let stripe = f64::from(self.config.stripe_chunks.max(1));
            let late: Vec<u32> = swarm
                .runs
                .iter()
                .filter(|(_, run)| {
                    let took = now.saturating_duration_since(run.progress.1).as_secs_f64();
                    // Before any run has finished: as long as the deadline
                    // allows each of the live runs in turn, that is, for a
                    // registry that gives them `min_fetch_rate` together.
                    let expected = match pace {
                        Some(p) => p * f64::from(run.count - run.progress.0).min(stripe),
                        None => run.window.as_secs_f64() * live,
                    };
                    now > run.deadline
                        && took > LATE_FACTOR * expected
                        && !planted::is(Bug::LateRunsKept)
                })
                .map(|(&first, _)| first)
                .collect();
            // Runs taken back are evidence the pace is too quick for the
            // registry as it is now: it doubles, once a tick, as a
            // retransmission timer backs off. Without this, runs that
            // finished at once (their chunks served by others) set a pace
            // no registry run could keep, and every run was taken back
            // before it could finish, for good (the chaos sweep's seed 279:
            // accusers beside a slow registry, no node done, 124.8 copies).
            if !late.is_empty()
                && let Some(p) = &mut swarm.run_pace
            {
                *p *= 2.0;
            }
            for first in late {
                // Live runs always cover an unserved chunk: fully served ones
                // are dropped as their last chunk is announced or hashed.
                let Some(run) = swarm.remove_run(first) else {
                    continue;
                };
                if let Some(peer) = peer_mut(&mut self.slots, run.peer) {
                    peer.runs.remove(&(digest, first));
                    peer.no_runs_before = now.checked_add(run.timeout);
                    report
                        .reclaimed
                        .push((peer.id.clone(), assignment(digest, first, &run)));
                }
            }
        }
        report
    }
}

impl Scheduler {
    /// The tracker was stopped for `gap`: its peers' silence and its runs'
    /// age in that time are its own, so they move on by `gap`.
    fn forgive(&mut self, gap: Duration) {
        let later = |t: &mut Instant| *t = t.checked_add(gap).unwrap_or(*t);
        for peer in self.slots.iter_mut().flatten() {
            later(&mut peer.last_announce);
        }
        for swarm in self.swarms.values_mut() {
            for run in swarm.runs.values_mut() {
                later(&mut run.assigned);
                later(&mut run.deadline);
                later(&mut run.progress.1);
            }
            for (until, _) in swarm.awaiting_hash.values_mut() {
                later(until);
            }
        }
    }
}

fn assignment(digest: BlobDigest, first: u32, run: &Run) -> Assignment {
    Assignment {
        digest,
        first,
        count: run.count,
        deadline: run.deadline,
    }
}

/// Time allowed for `bytes` at the minimum rate, within the floor and ceiling.
fn fetch_timeout(config: &SchedulerConfig, bytes: u64) -> Duration {
    let at_rate = match config.min_fetch_rate {
        0 => config.max_fetch_timeout,
        rate => Duration::from_millis(bytes.saturating_mul(1000) / rate),
    };
    at_rate
        .min(config.max_fetch_timeout)
        .max(config.min_fetch_timeout)
}

/// Up to `max` consecutive keys starting at `rotation` (wrapping), which
/// moves on past them so the next call starts where this one stopped.
fn rotated_sample<'a>(
    keys: &'a [PeerKey],
    rotation: &mut usize,
    max: usize,
) -> impl Iterator<Item = PeerKey> + 'a {
    let n = keys.len();
    let take = n.min(max);
    let start = if n == 0 { 0 } else { *rotation % n };
    *rotation = rotation.wrapping_add(take);
    (0..take).map(move |j| keys[(start + j) % n])
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 4 << 20;

    /// Runs of 4 chunks, 2 per node however few pull, no run budget: the
    /// layout most tests below spell out.
    fn striped() -> SchedulerConfig {
        SchedulerConfig {
            stripe_chunks: 4,
            max_outstanding: 2,
            min_blob_runs: 0,
            max_runs_per_origin: 0,
            ..SchedulerConfig::default()
        }
    }

    #[test]
    fn a_node_pulling_alone_gets_more_runs_past_its_first_chunk_for_the_blob_it_asked_for_first() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let now = Instant::now();
        // Two layers, asked for in the opposite order to their digests'.
        let mut layers = [BlobDigest::of(b"layer 0"), BlobDigest::of(b"layer 1")];
        layers.sort();
        layers.reverse();
        let layer = |digest: BlobDigest, held: Held| BlobAnnounce {
            digest,
            ..entry(8, held, true)
        };
        let runs = |d: AnnounceDecision| -> Vec<(BlobDigest, u32)> {
            let mut r: Vec<_> = d.assignments.iter().map(|a| (a.digest, a.first)).collect();
            r.sort();
            r
        };
        let first = layers.map(|d| layer(d, Held::Bits(bits(8, []))));
        // Its first announce: one run, as in a storm's first moment.
        let d = s.announce(announce("a", true, first.to_vec()), now);
        assert_eq!(runs(d), vec![(layers[0], 0)]);
        // Its first chunk landed and nobody else pulls: four runs at once,
        // all of the layer it asked for first.
        s.hash_settled(&layers[0], 0, now);
        let got = layer(layers[0], Held::Added(vec![0]));
        let d = s.announce(announce("a", false, vec![got]), now);
        assert_eq!(runs(d), (1..5).map(|i| (layers[0], i)).collect::<Vec<_>>());
        // A second puller gets one run; the first, past its share (two of
        // four each), keeps the three it has and gets no new one as its
        // next chunk lands (an answer lists every run the node holds).
        let d = s.announce(announce("b", true, first.to_vec()), now);
        assert_eq!(runs(d), vec![(layers[0], 5)]);
        s.hash_settled(&layers[0], 1, now);
        let got = layer(layers[0], Held::Added(vec![1]));
        let d = s.announce(announce("a", false, vec![got]), now);
        assert_eq!(runs(d), (2..5).map(|i| (layers[0], i)).collect::<Vec<_>>());
    }

    #[test]
    fn by_default_first_copies_go_one_chunk_each_to_distinct_nodes_at_most_24_at_once() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let now = Instant::now();
        let mut firsts = Vec::new();
        for i in 0..30 {
            let d = s.announce(wants(&format!("n{i}"), 64, &[]), now);
            firsts.push(chunks_of(&d.assignments));
        }
        let expected: Vec<Vec<u32>> = (0..30)
            .map(|i| if i < 24 { vec![i] } else { Vec::new() })
            .collect();
        assert_eq!(firsts, expected);
        // A finished run frees a place in the budget for the next announcer
        // (here the finisher itself, announcing its chunk).
        let d = fetched(&mut s, "n0", 64, vec![0], now);
        assert_eq!(chunks_of(&d.assignments), vec![24]);
        let d = s.announce(added("n24", 64, vec![]), now);
        assert!(d.assignments.is_empty());
    }

    /// A full announce of `peer` wanting `layer` of `n` chunks from `origin`.
    fn wants_from(peer: &str, layer: &[u8], n: u32, origin: &str) -> Announce {
        let mut e = entry(n, Held::Bits(bits(n, [])), true);
        e.digest = BlobDigest::of(layer);
        e.origin = origin.to_owned();
        announce(peer, true, vec![e])
    }

    #[test]
    fn blobs_of_one_origin_share_its_run_budget_and_other_origins_have_their_own() {
        let config = SchedulerConfig {
            max_runs_per_origin: 3,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(config);
        let now = Instant::now();
        let runs = |d: AnnounceDecision| d.assignments.len();
        // Two layers from registry A: three runs between them, not three each.
        let got: Vec<usize> = ["a0", "a1", "a2", "a3"]
            .iter()
            .enumerate()
            .map(|(i, p)| {
                runs(s.announce(wants_from(p, &[b'l', (i % 2) as u8], 8, "https://a"), now))
            })
            .collect();
        assert_eq!(got, [1, 1, 1, 0]);
        // Registry B is another budget; a blob whose origin is unknown is its own.
        assert_eq!(
            runs(s.announce(wants_from("b0", b"other", 8, "https://b"), now)),
            1
        );
        assert_eq!(
            runs(s.announce(wants_from("u0", b"unnamed", 8, ""), now)),
            1
        );
        // A run that ends (its node leaves) frees a place for either layer of A.
        s.leave("a0");
        assert_eq!(
            runs(s.announce(wants_from("a4", &[b'l', 1], 8, "https://a"), now)),
            1
        );
        assert_eq!(
            runs(s.announce(wants_from("a5", &[b'l', 0], 8, "https://a"), now)),
            0
        );
        // Runs end as their nodes leave, whichever layer they were for.
        s.leave("a1");
        s.leave("a3");
        s.leave("a5");
        assert_eq!(
            runs(s.announce(wants_from("a6", &[b'l', 0], 8, "https://a"), now)),
            1
        );
    }

    fn blob() -> BlobDigest {
        BlobDigest::of(b"layer")
    }

    fn bits(n: u32, ones: impl IntoIterator<Item = u32>) -> Bitfield {
        let mut b = Bitfield::new(n);
        for i in ones {
            b.set(i);
        }
        b
    }

    fn entry(n: u32, held: Held, wanted: bool) -> BlobAnnounce {
        BlobAnnounce {
            digest: blob(),
            chunk_count: n,
            size: u64::from(n) * CHUNK,
            chunk_size: CHUNK as u32,
            held,
            wanted,
            origin: String::new(),
            ranges_ignored: false,
        }
    }

    fn announce(peer: &str, full: bool, blobs: Vec<BlobAnnounce>) -> Announce {
        Announce {
            peer: peer.to_owned(),
            address: format!("{peer}:7000"),
            upload_bytes_per_s: 100 << 20,
            active_uploads: 0,
            labels: BTreeMap::new(),
            blobs,
            full,
        }
    }

    /// A full announce of a peer wanting the blob with `held` chunks.
    fn wants(peer: &str, n: u32, held: &[u32]) -> Announce {
        announce(
            peer,
            true,
            vec![entry(n, Held::Bits(bits(n, held.iter().copied())), true)],
        )
    }

    /// `peer`'s announce of chunks it fetched from the registry, once their
    /// hashes reached the tracker (as an agent's registry fetch publishes them).
    fn fetched(
        s: &mut Scheduler,
        peer: &str,
        n: u32,
        chunks: Vec<u32>,
        now: Instant,
    ) -> AnnounceDecision {
        for &c in &chunks {
            s.hash_settled(&blob(), c, now);
        }
        s.announce(added(peer, n, chunks), now)
    }

    fn added(peer: &str, n: u32, chunks: Vec<u32>) -> Announce {
        announce(peer, false, vec![entry(n, Held::Added(chunks), true)])
    }

    #[test]
    fn complete_holders_hear_the_count_and_distinct_ranks_and_partial_ones_nothing() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let now = Instant::now();
        let mut ranks = Vec::new();
        for p in ["a", "b", "c"] {
            s.announce(wants(p, 4, &[0, 1, 2, 3]), now);
        }
        let partial = s.announce(wants("d", 4, &[0]), now);
        assert!(partial.holders.is_empty());
        for p in ["a", "b", "c"] {
            let d = s.announce(wants(p, 4, &[0, 1, 2, 3]), now);
            assert_eq!(d.holders.len(), 1);
            assert_eq!((d.holders[0].digest, d.holders[0].complete), (blob(), 3));
            ranks.push(d.holders[0].rank);
        }
        ranks.sort();
        assert_eq!(ranks, vec![0, 1, 2], "every node knows its own place");
    }

    #[test]
    fn complete_holders_rank_by_keeper_order_as_holders_come_drop_chunks_leave_and_are_banned() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let now = Instant::now();
        let all: Vec<u32> = (0..4).collect();
        let mut complete: Vec<String> = (0..12).map(|n| format!("n{n}")).collect();
        for p in &complete {
            s.announce(wants(p, 4, &all), now);
        }
        s.announce(wants("partial", 4, &[1]), now);
        // What a pass over every complete member gives.
        let check = |s: &mut Scheduler, complete: &[String]| {
            let mut order: Vec<&String> = complete.iter().collect();
            order.sort_by_key(|p| (keeper_hash(&blob(), p), p.to_owned()));
            for (rank, p) in order.iter().enumerate() {
                let d = s.announce(wants(p, 4, &all), now);
                let got = (d.holders[0].complete, d.holders[0].rank);
                assert_eq!(got, (complete.len() as u32, rank as u32), "{p}");
            }
        };
        check(&mut s, &complete);
        // One drops a chunk, one leaves, one is banned.
        s.announce(wants("n3", 4, &[0, 1, 2]), now);
        assert!(s.leave("n7"));
        let report = BadChunk {
            reporter: "n1".into(),
            offender: "n5".into(),
            digest: blob(),
            index: 2,
            confirmed: true,
        };
        assert!(s.report_bad_chunk(&report, now).unwrap().banned);
        complete.retain(|p| !["n3", "n5", "n7"].contains(&p.as_str()));
        check(&mut s, &complete);
        assert!(s.announce(wants("n5", 4, &all), now).holders.is_empty());
        // The chunk back: complete again.
        s.announce(wants("n3", 4, &all), now);
        complete.push("n3".into());
        check(&mut s, &complete);
    }

    fn chunks_of(assignments: &[Assignment]) -> Vec<u32> {
        assignments
            .iter()
            .flat_map(|a| a.first..a.first + a.count)
            .collect()
    }

    fn peer_ids(d: &AnnounceDecision) -> Vec<String> {
        d.peers
            .get(&blob())
            .map(|ps| ps.iter().map(|p| p.peer.clone()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn eight_nodes_wanting_a_64_chunk_blob_get_disjoint_runs_covering_every_chunk_once() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let mut seen = vec![0u32; 64];
        for n in 0..8 {
            let d = s.announce(wants(&format!("n{n}"), 64, &[]), now);
            assert_eq!(d.assignments.len(), 2);
            assert!(d.assignments.iter().all(|a| a.count == 4));
            for c in chunks_of(&d.assignments) {
                seen[c as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        // Nothing is left to hand out.
        let d = s.announce(wants("n8", 64, &[]), now);
        assert!(d.assignments.is_empty());
    }

    #[test]
    fn runs_whose_chunks_are_all_announced_are_dropped_and_the_next_handed_out() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let first = s.announce(wants("a", 16, &[]), now).assignments;
        assert_eq!(chunks_of(&first), (0..8).collect::<Vec<_>>());
        // Partly held: the run stays.
        let d = fetched(&mut s, "a", 16, vec![0, 1], now);
        assert_eq!(d.assignments, first);
        let d = fetched(&mut s, "a", 16, vec![2, 3], now);
        assert_eq!(chunks_of(&d.assignments), vec![4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(s.holders(&blob(), 3), 1);
        assert_eq!(s.unheld_chunks(&blob()), Some(12));
    }

    #[test]
    fn a_stalled_run_is_reassigned_once_it_lags_far_behind_its_deadline() {
        let mut s = Scheduler::new(striped());
        let t0 = Instant::now();
        let a = s.announce(wants("a", 8, &[]), t0).assignments;
        assert_eq!(chunks_of(&a), (0..8).collect::<Vec<_>>());
        let b = s.announce(wants("b", 8, &[]), t0).assignments;
        assert!(b.is_empty());

        // No run of the blob has finished to say how fast the registry is:
        // a run is taken back after three times the time its deadline gives
        // each of the two live runs in turn (16 s each: 4 chunks at 1 MiB/s).
        let timeout = a[0].deadline - t0;
        assert_eq!(timeout, Duration::from_secs(16));
        let before = t0 + timeout * 6 - Duration::from_millis(1);
        s.announce(added("a", 8, vec![]), before);
        s.announce(added("b", 8, vec![]), before);
        assert!(
            s.tick(before).reclaimed.is_empty(),
            "past the deadline, kept"
        );

        let after = t0 + timeout * 6 + Duration::from_millis(1);
        s.announce(added("a", 8, vec![]), after);
        s.announce(added("b", 8, vec![]), after);
        let report = s.tick(after);
        assert_eq!(report.reclaimed.len(), 2);
        assert!(report.reclaimed.iter().all(|(p, _)| p == "a"));
        // The staller is cooling off; the other node gets the chunks.
        assert!(
            s.announce(added("a", 8, vec![]), after)
                .assignments
                .is_empty()
        );
        let b = s.announce(added("b", 8, vec![]), after).assignments;
        assert_eq!(chunks_of(&b), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn pullers_hear_that_the_registry_is_being_fetched_while_runs_are_live() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let t0 = Instant::now();
        // One chunk: a gets the only run; b waits on it.
        assert_eq!(s.announce(wants("a", 1, &[]), t0).fetching, vec![blob()]);
        assert_eq!(s.announce(wants("b", 1, &[]), t0).fetching, vec![blob()]);
        // a's chunk lands: no run is live, and a wants nothing more.
        assert!(fetched(&mut s, "a", 1, vec![0], t0).fetching.is_empty());
        assert!(s.announce(added("b", 1, vec![]), t0).fetching.is_empty());
    }

    #[test]
    fn runs_as_slow_as_the_blobs_finished_ones_are_kept_past_their_deadline() {
        // One chunk per run and per node: a registry that takes 20 s a chunk
        // (5 s deadlines) is slow for everyone, not a stalled fetcher.
        let mut s = Scheduler::new(SchedulerConfig {
            min_blob_runs: 0,
            ..SchedulerConfig::default()
        });
        let t0 = Instant::now();
        let all = |s: &mut Scheduler, at: Instant, a_has: Vec<u32>| {
            let mut got = Vec::new();
            for (peer, held) in [("a", a_has), ("b", vec![]), ("c", vec![])] {
                got.push(chunks_of(&fetched(s, peer, 8, held, at).assignments));
            }
            got
        };
        for peer in ["a", "b", "c"] {
            s.announce(wants(peer, 8, &[]), t0);
        }
        let at20 = t0 + Duration::from_secs(20);
        // a's chunk 0 took 20 s; its next run is chunk 3 (b and c keep theirs).
        assert_eq!(all(&mut s, at20, vec![0]), vec![vec![3], vec![1], vec![2]]);
        let at40 = t0 + Duration::from_secs(40);
        all(&mut s, at40, vec![]);
        assert!(s.tick(at40).reclaimed.is_empty(), "40 s is within 3 x 20 s");
        let at61 = t0 + Duration::from_secs(61);
        all(&mut s, at61, vec![]);
        // Ticking as the tracker does (a gap would be a stopped tracker).
        let mut late: Vec<(String, u32)> = (81..=122)
            .flat_map(|half| s.tick(t0 + Duration::from_millis(500 * half)).reclaimed)
            .map(|(peer, a)| (peer, a.first))
            .collect();
        late.sort();
        // b's and c's runs are past 60 s old; a's (3) only 41 s.
        assert_eq!(late, vec![("b".to_owned(), 1), ("c".to_owned(), 2)]);
    }

    #[test]
    fn runs_taken_back_double_the_pace_so_one_quick_run_cannot_take_back_every_run() {
        let mut s = Scheduler::new(SchedulerConfig {
            min_blob_runs: 0,
            ..SchedulerConfig::default()
        });
        let t0 = Instant::now();
        for peer in ["a", "b", "c"] {
            s.announce(wants(peer, 8, &[]), t0);
        }
        // a's chunk 0 came in 1 s: the pace is 1 s a chunk, and a's next
        // run is chunk 3 (deadline 6 s).
        let at1 = t0 + Duration::from_secs(1);
        let next = fetched(&mut s, "a", 8, vec![0], at1).assignments;
        assert_eq!(chunks_of(&next), vec![3]);
        let mut late = |halves: std::ops::RangeInclusive<u32>| {
            let mut late: Vec<(String, u32)> = halves
                .flat_map(|half| {
                    s.tick(t0 + Duration::from_millis(500 * u64::from(half)))
                        .reclaimed
                })
                .map(|(peer, a)| (peer, a.first))
                .collect();
            late.sort();
            late
        };
        // b's and c's runs are past their 5 s deadlines and three paces.
        assert_eq!(late(1..=11), vec![("b".to_owned(), 1), ("c".to_owned(), 2)]);
        // That doubled the pace: a's run, 5.5 s old and past its deadline,
        // is within three paces now (before, every run of a slow registry
        // was taken back, for good, once a quick one set the pace).
        assert!(late(12..=13).is_empty());
        assert_eq!(late(14..=15), vec![("a".to_owned(), 3)]);
    }

    #[test]
    fn time_the_tracker_was_stopped_is_not_held_against_its_peers_or_runs() {
        let mut s = Scheduler::new(striped());
        let t0 = Instant::now();
        let runs = s.announce(wants("a", 8, &[]), t0).assignments;
        assert!(!runs.is_empty());
        s.tick(t0);
        // Stopped for a minute, past the run's deadline and the peer's
        // expiry: its first tick after takes nothing back, expires nobody.
        let report = s.tick(t0 + Duration::from_secs(60));
        assert!(report.reclaimed.is_empty(), "{report:?}");
        assert!(report.expired.is_empty(), "{report:?}");
        assert_eq!(s.peer_count(), 1);
        // Its ticks carry on: the peer's silence now counts.
        let after: Vec<String> = (121..=200)
            .flat_map(|half| s.tick(t0 + Duration::from_millis(500 * half)).expired)
            .collect();
        assert_eq!(after, ["a"]);
    }

    #[test]
    fn a_deadline_grows_with_the_run_size_above_a_floor() {
        let config = striped();
        let now = Instant::now();
        let mut s = Scheduler::new(config.clone());
        let big = s.announce(wants("a", 8, &[]), now).assignments;
        // 4 chunks x 4 MiB at 1 MiB/s.
        assert_eq!(big[0].deadline - now, Duration::from_secs(16));
        let mut tiny = announce("b", true, vec![entry(8, Held::Added(vec![]), true)]);
        tiny.blobs[0].digest = BlobDigest::of(b"tiny");
        tiny.blobs[0].size = 8;
        let small = s.announce(tiny, now).assignments;
        assert_eq!(small[0].deadline - now, config.min_fetch_timeout);
    }

    #[test]
    fn an_expired_nodes_runs_are_reassigned() {
        let mut s = Scheduler::new(striped());
        let t0 = Instant::now();
        let a = s.announce(wants("a", 8, &[]), t0).assignments;
        assert_eq!(a.len(), 2);
        let interval = s.config().announce_interval;
        // b keeps announcing; a goes silent for more than 3 intervals.
        let later = t0 + interval * 3 + Duration::from_millis(1);
        assert!(
            s.announce(wants("b", 8, &[]), t0 + interval)
                .assignments
                .is_empty()
        );
        s.announce(added("b", 8, vec![]), later);
        let report = s.tick(later);
        assert_eq!(report.expired, vec!["a".to_owned()]);
        assert_eq!(s.peer_count(), 1);
        let b = s.announce(added("b", 8, vec![]), later).assignments;
        assert_eq!(chunks_of(&b), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_leaving_node_loses_its_runs_and_holdings_at_once() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        s.announce(wants("a", 8, &[0]), now);
        assert_eq!(s.holders(&blob(), 0), 1);
        assert!(s.leave("a"));
        assert!(!s.leave("a"));
        assert_eq!(s.unheld_chunks(&blob()), None);
        let b = s.announce(wants("b", 8, &[]), now).assignments;
        assert_eq!(chunks_of(&b), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_restarted_scheduler_asks_for_a_full_resend_on_a_delta() {
        let now = Instant::now();
        let mut s = Scheduler::new(striped());
        s.announce(wants("a", 8, &[0, 1]), now);
        assert!(!s.announce(added("a", 8, vec![2]), now).resend_full);

        let mut restarted = Scheduler::new(striped());
        let d = restarted.announce(added("a", 8, vec![3]), now);
        assert!(d.resend_full);
        assert!(d.assignments.is_empty() && d.peers.is_empty());
        assert_eq!(restarted.peer_count(), 0);
        let d = restarted.announce(wants("a", 8, &[0, 1, 2, 3]), now);
        assert!(!d.resend_full);
        assert_eq!(restarted.unheld_chunks(&blob()), Some(4));
    }

    #[test]
    fn peers_given_prefer_holders_of_missing_chunks_and_exclude_banned_offenders() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        s.announce(wants("asker", 8, &[0, 1]), now);
        s.announce(wants("same", 8, &[0, 1]), now);
        s.announce(wants("useful", 8, &[2]), now);
        s.announce(wants("bad", 8, &(0..8).collect::<Vec<_>>()), now);
        let d = s.announce(added("asker", 8, vec![]), now);
        let ids = peer_ids(&d);
        assert_eq!(ids.len(), 3);
        assert!(ids[..2].contains(&"useful".to_owned()) && ids[..2].contains(&"bad".to_owned()));
        assert_eq!(ids[2], "same");
        assert!(!ids.contains(&"asker".to_owned()));

        let report = |reporter: &str, confirmed| BadChunk {
            reporter: reporter.to_owned(),
            offender: "bad".to_owned(),
            digest: blob(),
            index: 5,
            confirmed,
        };
        let standing = s.report_bad_chunk(&report("asker", false), now).unwrap();
        assert_eq!(
            standing,
            Standing {
                reporters: 1,
                ..Standing::default()
            }
        );
        // The same reporter twice does not count twice.
        assert_eq!(
            s.report_bad_chunk(&report("asker", false), now)
                .unwrap()
                .reporters,
            1
        );
        assert_eq!(s.holders(&blob(), 5), 1, "one reporter's word is doubt");
        assert!(
            s.report_bad_chunk(&report("same", true), now)
                .unwrap()
                .banned
        );
        assert_eq!(s.holders(&blob(), 7), 0);
        let ids = peer_ids(&s.announce(added("asker", 8, vec![]), now));
        assert_eq!(ids, vec!["useful".to_owned(), "same".to_owned()]);
        // Its later claims are not trusted either.
        s.announce(wants("bad", 8, &(0..8).collect::<Vec<_>>()), now);
        assert_eq!(s.holders(&blob(), 7), 0);
        assert!(s.standing("bad").banned);
        // Nor after it leaves and comes back.
        assert!(s.leave("bad"));
        s.announce(wants("bad", 8, &(0..8).collect::<Vec<_>>()), now);
        assert_eq!(s.holders(&blob(), 7), 0);
        let ids = peer_ids(&s.announce(added("asker", 8, vec![]), now));
        assert_eq!(ids, vec!["useful".to_owned(), "same".to_owned()]);
    }

    #[test]
    fn members_holding_nothing_yet_fill_the_places_holders_leave() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        for p in ["asker", "empty1", "empty2", "gone"] {
            s.announce(wants(p, 8, &[]), now);
        }
        s.announce(wants("holder", 8, &[3]), now);
        assert!(s.leave("gone"));
        let ids = peer_ids(&s.announce(added("asker", 8, vec![]), now));
        assert_eq!(ids[0], "holder", "{ids:?}");
        let mut rest = ids[1..].to_vec();
        rest.sort();
        assert_eq!(rest, vec!["empty1".to_owned(), "empty2".to_owned()]);
    }

    /// However many members report a peer's chunks corrupt, their word
    /// bans nobody (colluding accusers would ban honest members); a report
    /// the tracker confirmed does.
    #[test]
    fn members_reports_of_corrupt_chunks_ban_nobody_and_a_confirmed_one_bans() {
        let mut s = Scheduler::new(SchedulerConfig {
            peers_per_blob: 32,
            ..striped()
        });
        let now = Instant::now();
        let reporters: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
        s.announce(wants("bad", 8, &[0]), now);
        for r in &reporters {
            s.announce(wants(r, 8, &[]), now);
        }
        for (i, r) in reporters.iter().enumerate() {
            // Each is told of "bad" before it can report it.
            s.announce(added(r, 8, vec![]), now);
            let st = s.report_bad_chunk(&bad_chunk(r, "bad"), now).unwrap();
            assert_eq!((st.reporters, st.banned), (i + 1, false), "{st:?}");
        }
        assert_eq!(s.holders(&blob(), 0), 1);
        let confirmed = BadChunk {
            confirmed: true,
            ..bad_chunk("r0", "bad")
        };
        assert!(s.report_bad_chunk(&confirmed, now).unwrap().banned);
        assert_eq!(s.holders(&blob(), 0), 0);
    }

    fn bad_chunk(reporter: &str, offender: &str) -> BadChunk {
        BadChunk {
            reporter: reporter.to_owned(),
            offender: offender.to_owned(),
            digest: blob(),
            index: 0,
            confirmed: false,
        }
    }

    #[test]
    fn a_report_counts_only_from_a_peer_the_offender_was_named_to() {
        let mut s = Scheduler::new(SchedulerConfig {
            peers_per_blob: 1,
            ..striped()
        });
        let now = Instant::now();
        s.announce(wants("holder", 8, &[0, 1, 2, 3, 4, 5, 6, 7]), now);
        s.announce(wants("stranger", 8, &[]), now);
        let told = s.announce(wants("asker", 8, &[]), now);
        assert_eq!(peer_ids(&told), vec!["holder"]);
        let err = s
            .report_bad_chunk(&bad_chunk("asker", "stranger"), now)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "peer \"asker\" reports chunk 0 of {} from \"stranger\", but the tracker never named \"stranger\" to it for that blob",
                blob()
            )
        );
        assert_eq!(s.standing("stranger").reporters, 0);
        assert_eq!(
            s.report_bad_chunk(&bad_chunk("asker", "holder"), now)
                .unwrap()
                .reporters,
            1
        );
    }

    /// A report of "bad" the tracker confirmed, at `now`.
    fn banned_on_confirmation(s: &mut Scheduler, now: Instant) -> Standing {
        s.announce(wants("r1", 8, &[]), now);
        let confirmed = BadChunk {
            confirmed: true,
            ..bad_chunk("r1", "bad")
        };
        s.report_bad_chunk(&confirmed, now).unwrap()
    }

    #[test]
    fn a_ban_ends_and_a_repeat_ban_lasts_twice_as_long() {
        let mut s = Scheduler::new(SchedulerConfig {
            ban: Duration::from_secs(600),
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        s.announce(wants("bad", 8, &[0, 1, 2, 3, 4, 5, 6, 7]), t0);
        assert!(banned_on_confirmation(&mut s, t0).banned);
        assert!(s.tick(t0 + Duration::from_secs(599)).unbanned.is_empty());
        let report = s.tick(t0 + Duration::from_secs(600));
        assert_eq!(report.unbanned, vec!["bad".to_owned()]);
        assert!(!s.standing("bad").banned);
        // Handed out again once it announces what it holds.
        s.announce(
            wants("bad", 8, &[0, 1, 2, 3, 4, 5, 6, 7]),
            t0 + Duration::from_secs(601),
        );
        assert_eq!(s.holders(&blob(), 0), 1);

        let t1 = t0 + Duration::from_secs(700);
        let again = banned_on_confirmation(&mut s, t1);
        assert_eq!((again.banned, again.bans), (true, 2));
        assert!(s.tick(t1 + Duration::from_secs(1_199)).unbanned.is_empty());
        assert_eq!(
            s.tick(t1 + Duration::from_secs(1_200)).unbanned,
            vec!["bad".to_owned()]
        );
    }

    #[test]
    fn reports_older_than_the_window_lapse() {
        let mut s = Scheduler::new(SchedulerConfig {
            report_window: Duration::from_secs(60),
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        s.announce(wants("bad", 8, &[0, 1, 2, 3, 4, 5, 6, 7]), t0);
        for (r, at) in [("r1", 0), ("r2", 61), ("r3", 122)] {
            let now = t0 + Duration::from_secs(at);
            s.announce(wants(r, 8, &[]), now);
            let st = s.report_bad_chunk(&bad_chunk(r, "bad"), now).unwrap();
            assert!(!st.banned, "{r}: {st:?}");
        }
    }

    /// Reports of more peers than `max_accused_per_reporter` are refused,
    /// and nobody is banned: neither the accused (members' word is doubt)
    /// nor the reporter (that many liars, each sending an honest node a bad
    /// chunk, would ban it between them).
    #[test]
    fn a_reporter_accusing_many_peers_is_not_heard_past_its_limit_and_nobody_is_banned() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_accused_per_reporter: 3,
            peers_per_blob: 8,
            ..striped()
        });
        let now = Instant::now();
        let honest: Vec<String> = (0..5).map(|i| format!("honest-{i}")).collect();
        for h in &honest {
            s.announce(wants(h, 8, &[0, 1, 2, 3, 4, 5, 6, 7]), now);
        }
        s.announce(wants("liar", 8, &[]), now);
        for h in &honest[..3] {
            s.report_bad_chunk(&bad_chunk("liar", h), now).unwrap();
        }
        let err = s
            .report_bad_chunk(&bad_chunk("liar", &honest[3]), now)
            .unwrap_err();
        assert!(
            matches!(err, ScheduleError::BadChunkReportLimit { reported: 3, .. }),
            "{err:?}"
        );
        // Its reports of the peers it already named are still heard.
        assert!(
            s.report_bad_chunk(&bad_chunk("liar", &honest[0]), now)
                .is_ok()
        );
        assert!(!s.standing("liar").banned);
        assert!(honest.iter().all(|h| !s.standing(h).banned));
        assert_eq!(s.holders(&blob(), 0), 5, "no accused holding forgotten");
        // Past the window, it is heard again.
        let later = now + SchedulerConfig::default().report_window + Duration::from_secs(1);
        s.announce(added("liar", 8, vec![]), later);
        assert!(
            s.report_bad_chunk(&bad_chunk("liar", &honest[3]), later)
                .is_ok()
        );
    }

    #[test]
    fn an_announce_disagreeing_with_the_blobs_size_or_chunk_size_is_refused() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        s.announce(wants("a", 8, &[]), now);
        let mut other = entry(8, Held::Added(vec![]), true);
        other.size += 1;
        let d = s.announce(announce("b", true, vec![other]), now);
        assert_eq!(
            d.rejected[0].to_string(),
            format!(
                "blob {} is 33554432 bytes in 4194304-byte chunks at the tracker, but the announce says 33554433 bytes in 4194304-byte chunks",
                blob()
            )
        );
        let mut other = entry(8, Held::Added(vec![]), true);
        other.chunk_size = 4_194_368;
        let d = s.announce(announce("b", true, vec![other]), now);
        assert!(matches!(
            d.rejected[0],
            ScheduleError::GeometryMismatch { .. }
        ));
        assert_eq!(
            s.geometry(&blob()),
            Some(Geometry {
                size: 8 * CHUNK,
                chunk_size: CHUNK as u32,
                chunk_count: 8
            })
        );
    }

    #[test]
    fn caps_on_blobs_and_chunks_refuse_the_entries_past_them() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_blobs: 2,
            max_total_chunks: 20,
            max_blobs_per_peer: 1,
            ..striped()
        });
        let now = Instant::now();
        let of = |name: &[u8], n: u32| BlobAnnounce {
            digest: BlobDigest::of(name),
            ..entry(n, Held::Added(vec![]), true)
        };
        let d = s.announce(announce("a", true, vec![of(b"x", 8), of(b"y", 8)]), now);
        assert!(
            matches!(
                &d.rejected[..],
                [ScheduleError::TooManyBlobsForPeer {
                    blobs: 1,
                    max_blobs: 1,
                    ..
                }]
            ),
            "{:?}",
            d.rejected
        );
        s.announce(announce("b", true, vec![of(b"y", 8)]), now);
        let d = s.announce(announce("c", true, vec![of(b"z", 1)]), now);
        assert!(
            d.rejected[0]
                .to_string()
                .contains("would be blob number 2 plus one"),
            "{}",
            d.rejected[0]
        );
        s.leave("b");
        let d = s.announce(announce("c", true, vec![of(b"z", 13)]), now);
        assert!(
            matches!(
                d.rejected[..],
                [ScheduleError::TooManyBlobs {
                    chunk_count: 13,
                    ..
                }]
            ),
            "{:?}",
            d.rejected
        );
        let d = s.announce(announce("c", true, vec![of(b"z", 12)]), now);
        assert!(d.rejected.is_empty(), "{:?}", d.rejected);
        assert_eq!(s.blob_count(), 2);
    }

    #[test]
    fn a_registry_run_names_its_fetcher_until_each_hash_settles() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let d = s.announce(wants("a", 8, &[]), now);
        assert_eq!(chunks_of(&d.assignments), (0..8).collect::<Vec<_>>());
        assert_eq!(s.registry_fetcher(&blob(), 3), Some("a"));
        // Announcing the chunk drops the run, not the fetcher: the hash may come later.
        s.announce(added("a", 8, vec![0, 1, 2, 3]), now);
        assert_eq!(s.registry_fetcher(&blob(), 3), Some("a"));
        s.hash_settled(&blob(), 3, now);
        assert_eq!(s.registry_fetcher(&blob(), 3), None);
        assert_eq!(s.registry_fetcher(&blob(), 2), Some("a"));
    }

    #[test]
    fn a_fetcher_holding_its_run_takes_the_next_and_a_hash_that_never_comes_frees_the_chunk() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        let t0 = Instant::now();
        let first = s.announce(wants("a", 2, &[]), t0).assignments;
        assert_eq!(chunks_of(&first), vec![0]);
        // a holds chunk 0; its hash is still on its way.
        let d = s.announce(added("a", 2, vec![0]), t0);
        assert_eq!(chunks_of(&d.assignments), vec![1], "the next run at once");
        // One chunk awaiting its hash at a time: a fetcher that never
        // publishes cannot hold back a chunk per announce.
        let d = s.announce(added("a", 2, vec![1]), t0);
        assert_eq!(chunks_of(&d.assignments), vec![1]);
        // Nobody else is sent for chunk 0 while its hash may come...
        assert!(s.announce(wants("b", 2, &[]), t0).assignments.is_empty());
        // ...until the run's deadline and as long again have passed.
        let late = first[0].deadline + (first[0].deadline - t0) + Duration::from_millis(1);
        s.announce(added("a", 2, vec![]), late);
        s.tick(late);
        let d = s.announce(added("b", 2, vec![]), late);
        assert_eq!(chunks_of(&d.assignments), vec![0]);
    }

    #[test]
    fn a_node_claiming_chunks_nobody_published_a_hash_for_stops_no_registry_run() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        // The liar claims all 16 chunks before anybody fetched one.
        s.announce(
            announce(
                "liar",
                true,
                vec![entry(16, Held::Bits(bits(16, 0..16)), false)],
            ),
            now,
        );
        assert_eq!(s.holders(&blob(), 5), 1);
        let a = s.announce(wants("a", 16, &[]), now).assignments;
        let b = s.announce(wants("b", 16, &[]), now).assignments;
        assert_eq!(chunks_of(&a), (0..8).collect::<Vec<_>>());
        assert_eq!(chunks_of(&b), (8..16).collect::<Vec<_>>());
        // Its claims do not end a run either; the fetcher's holding does,
        // its chunks awaiting its hash (nobody else is sent for them).
        let d = s.announce(added("a", 16, vec![0, 1, 2, 3]), now);
        assert_eq!(chunks_of(&d.assignments), vec![4, 5, 6, 7]);
        for i in 0..4 {
            s.hash_settled(&blob(), i, now);
        }
        for i in 4..8 {
            s.hash_settled(&blob(), i, now);
        }
        let d = s.announce(added("a", 16, vec![4, 5, 6, 7]), now);
        assert!(d.assignments.is_empty(), "every chunk is served or fetched");
        // Once hashed, a chunk held by anyone (the liar too) needs no run:
        // a bad copy costs the liar its standing, not the registry a copy.
        assert_eq!(s.unheld_chunks(&blob()), Some(0));
    }

    #[test]
    fn same_zone_and_lightly_loaded_peers_come_first() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let labelled = |peer: &str, zone: &str, load: u32| {
            let mut a = wants(peer, 4, &[0, 1, 2, 3]);
            a.labels.insert("zone".into(), zone.into());
            a.active_uploads = load;
            a
        };
        s.announce(labelled("far-idle", "b", 0), now);
        s.announce(labelled("near-busy", "a", 5), now);
        s.announce(labelled("near-idle", "a", 1), now);
        let mut asker = labelled("asker", "a", 0);
        asker.blobs[0].held = Held::Bits(Bitfield::new(4));
        let ids = peer_ids(&s.announce(asker, now));
        assert_eq!(ids, vec!["near-idle", "near-busy", "far-idle"]);
    }

    #[test]
    fn a_digest_failure_rechecks_an_eighth_of_the_chunks_at_a_time_until_one_is_replaced() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let every: Vec<u32> = (0..16).collect();
        s.announce(wants("a", 16, &[0, 1, 2, 3]), now);
        s.announce(wants("b", 16, &every), now);
        s.announce(wants("c", 16, &every), now);
        for i in 0..16 {
            s.hash_settled(&blob(), i, now);
        }
        assert!(s.assignments(&blob()).is_empty(), "every chunk is served");
        assert_eq!(
            s.blob_failed("nobody", &blob(), now),
            Err(ScheduleError::UnknownPeer("nobody".into()))
        );
        assert_eq!(
            s.blob_failed("a", &blob(), now).unwrap_err().to_string(),
            format!(
                "peer \"a\" holds 4 of the 16 chunks of {}: only a node that assembled every chunk can report that the blob failed its digest",
                blob()
            )
        );
        // Having held every chunk is what counts, also after dropping them.
        // One node's word is not enough to cost the swarm registry fetches.
        s.announce(wants("b", 16, &[]), now);
        assert_eq!(s.blob_failed("b", &blob(), now), Ok(false));
        assert!(matches!(
            s.blob_failed("b", &blob(), now),
            Err(ScheduleError::FailureReportLimit { .. })
        ));
        s.announce(wants("b", 16, &every), now);
        assert_eq!(s.blob_failed("c", &blob(), now), Ok(true));
        let rechecking =
            |s: &Scheduler| -> Vec<u32> { (0..16).filter(|&i| s.rechecking(&blob(), i)).collect() };
        // Two chunks (an eighth) at a time, not the first ones, and nobody's
        // holdings dropped: the nodes holding every chunk take the runs.
        let first = rechecking(&s);
        assert_eq!(first.len(), 2);
        assert_ne!(first, vec![0, 1], "the order is drawn from the digest");
        assert_eq!(s.holders(&blob(), first[0]), 2);
        let d = s.announce(added("b", 16, vec![]), now);
        let c = s.announce(added("c", 16, vec![]), now);
        let mut runs = chunks_of(&d.assignments);
        runs.extend(chunks_of(&c.assignments));
        runs.sort();
        assert_eq!(runs, first);
        // A hash published again as it was settles its chunk; the next goes out.
        s.hash_settled(&blob(), first[0], now);
        let second = rechecking(&s);
        assert_eq!(second.len(), 2);
        assert!(second.contains(&first[1]) && !second.contains(&first[0]));
        // A hash that differs was the wrong one: the search ends.
        let found = second.into_iter().find(|&i| i != first[1]).unwrap();
        s.chunk_replaced(&blob(), found, now);
        assert!(rechecking(&s).is_empty());
        assert!(s.assignments(&blob()).is_empty());
        assert!(
            s.announce(added("b", 16, vec![]), now)
                .assignments
                .is_empty()
        );
        // Nobody assembled the blob since: no report is taken until then.
        assert!(matches!(
            s.blob_failed("a", &blob(), now),
            Err(ScheduleError::NotAHolder { .. })
        ));
        // A node that drops the replaced chunk and fetches it again has.
        let later = now + s.config().report_window + Duration::from_secs(1);
        let others: Vec<u32> = every.iter().copied().filter(|&i| i != found).collect();
        s.announce(wants("b", 16, &others), later);
        s.announce(wants("b", 16, &every), later);
        assert_eq!(s.blob_failed("b", &blob(), later), Ok(false));
    }

    #[test]
    fn hostile_announces_and_reports_are_refused_without_panicking() {
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        s.announce(wants("a", 8, &[]), now);
        let d = s.announce(
            announce(
                "a",
                false,
                vec![
                    entry(8, Held::Bits(Bitfield::new(9)), true),
                    entry(8, Held::Added(vec![1, 8]), true),
                    entry(9, Held::Added(vec![]), true),
                    entry(0, Held::Added(vec![]), true),
                    entry(u32::MAX, Held::Added(vec![]), true),
                ],
            ),
            now,
        );
        assert_eq!(d.rejected.len(), 5);
        assert!(matches!(
            d.rejected[0],
            ScheduleError::BitfieldLength { .. }
        ));
        assert!(matches!(
            d.rejected[1],
            ScheduleError::ChunkOutOfRange { index: 8, .. }
        ));
        assert!(matches!(
            d.rejected[2],
            ScheduleError::ChunkCountMismatch { .. }
        ));
        assert_eq!(s.holders(&blob(), 1), 0, "a rejected entry changes nothing");

        let mut report = BadChunk {
            reporter: "ghost".into(),
            offender: "a".into(),
            digest: blob(),
            index: 0,
            confirmed: true,
        };
        assert!(matches!(
            s.report_bad_chunk(&report, now),
            Err(ScheduleError::UnknownPeer(_))
        ));
        report.reporter = "a".into();
        assert!(matches!(
            s.report_bad_chunk(&report, now),
            Err(ScheduleError::SelfReport(_))
        ));
        s.announce(wants("b", 8, &[]), now);
        report.reporter = "b".into();
        report.index = 99;
        assert!(matches!(
            s.report_bad_chunk(&report, now),
            Err(ScheduleError::ChunkOutOfRange { .. })
        ));
        assert!(matches!(
            s.blob_failed("a", &BlobDigest::of(b"other"), now),
            Err(ScheduleError::UnknownBlob(_))
        ));
        assert!(!s.leave("ghost"));
        s.tick(now);
    }

    #[test]
    fn a_hundred_nodes_fetching_runs_instantly_see_each_of_256_chunks_assigned_once() {
        const N: u32 = 256;
        const NODES: usize = 100;
        let mut s = Scheduler::new(striped());
        let mut now = Instant::now();
        let names: Vec<String> = (0..NODES).map(|i| format!("node{i}")).collect();
        let mut held: Vec<Bitfield> = vec![Bitfield::new(N); NODES];
        let mut fresh: Vec<Vec<u32>> = vec![Vec::new(); NODES];
        let mut assigned = vec![0u32; N as usize];
        let mut rounds = 0;
        for name in &names {
            s.announce(wants(name, N, &[]), now);
        }
        while held.iter().any(|h| !h.is_full()) {
            rounds += 1;
            assert!(rounds < 100, "the swarm does not converge");
            now += Duration::from_secs(1);
            for i in 0..NODES {
                let d = s.announce(added(&names[i], N, std::mem::take(&mut fresh[i])), now);
                assert!(!d.resend_full);
                // Instant fetches mean every run in an answer is new.
                for c in chunks_of(&d.assignments) {
                    assigned[c as usize] += 1;
                    s.hash_settled(&blob(), c, now);
                    if held[i].set(c) {
                        fresh[i].push(c);
                    }
                }
                // Copy one chunk per peer, as a slow peer-to-peer transfer would.
                for p in d.peers.get(&blob()).into_iter().flatten() {
                    let j: usize = p.peer["node".len()..].parse().unwrap();
                    assert_ne!(i, j);
                    let theirs = held[j].clone();
                    if let Some(c) = theirs.ones().find(|&c| !held[i].get(c)) {
                        held[i].set(c);
                        fresh[i].push(c);
                    }
                }
            }
            assert!(s.tick(now).reclaimed.is_empty());
        }
        assert!(assigned.iter().all(|&a| a == 1), "{assigned:?}");
    }

    #[test]
    fn ten_thousand_nodes_over_2560_chunks_stay_cheap_and_fetch_each_chunk_once() {
        const N: u32 = 2560;
        const NODES: usize = 10_000;
        let mut s = Scheduler::new(striped());
        let now = Instant::now();
        let started = std::time::Instant::now();
        let mut assigned = vec![0u32; N as usize];
        let mut fresh: Vec<Vec<u32>> = vec![Vec::new(); NODES];
        for round in 0..3 {
            for (i, fresh) in fresh.iter_mut().enumerate() {
                let peer = format!("n{i}");
                let d = if round == 0 {
                    s.announce(wants(&peer, N, &[]), now)
                } else {
                    s.announce(added(&peer, N, std::mem::take(fresh)), now)
                };
                for c in chunks_of(&d.assignments) {
                    assigned[c as usize] += 1;
                    s.hash_settled(&blob(), c, now);
                    fresh.push(c);
                }
            }
        }
        assert!(assigned.iter().all(|&a| a == 1));
        assert_eq!(s.unheld_chunks(&blob()), Some(0));
        // Generous: a few hundred milliseconds in release on a small machine.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }

    fn silent(reporter: &str, offender: &str) -> Silent {
        Silent {
            reporter: reporter.to_owned(),
            offender: offender.to_owned(),
            digest: blob(),
            index: 0,
        }
    }

    #[test]
    fn one_member_reporting_corruption_forgets_no_holding_and_what_only_the_offender_holds_goes_out()
     {
        let mut s = Scheduler::new(SchedulerConfig {
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        s.announce(wants("w", 8, &[]), t0);
        fetched(&mut s, "w", 8, (0..8).collect(), t0);
        for h in ["h", "k"] {
            s.announce(wants(h, 8, &[]), t0);
            fetched(&mut s, h, 8, vec![0, 1, 2, 3], t0);
        }
        for r in ["r1", "r2", "r3", "r4", "r5", "r6"] {
            let d = s.announce(wants(r, 8, &[]), t0);
            assert!(d.assignments.is_empty(), "every chunk is held: {d:?}");
        }
        let report = |reporter: &str, offender: &str, index, confirmed| BadChunk {
            reporter: reporter.to_owned(),
            offender: offender.to_owned(),
            digest: blob(),
            index,
            confirmed,
        };
        // A false accuser repeating itself: h keeps chunk 0, which others
        // hold too, so nothing goes out again.
        for _ in 0..3 {
            s.report_bad_chunk(&report("r1", "h", 0, false), t0)
                .unwrap();
        }
        assert_eq!(s.holders(&blob(), 0), 3);
        let d = s.announce(added("r2", 8, vec![]), t0);
        assert!(d.assignments.is_empty() && d.fetching.is_empty(), "{d:?}");
        // Reported, w keeps its holdings and stays named, and the chunks
        // only it holds are sent out (it may be the liar).
        s.report_bad_chunk(&report("r2", "w", 6, false), t0)
            .unwrap();
        assert_eq!(s.holders(&blob(), 6), 1);
        let d = s.announce(added("r3", 8, vec![]), t0);
        assert!(d.peers.values().flatten().any(|p| p.peer == "w"), "{d:?}");
        let runs = chunks_of(&d.assignments);
        assert_eq!(runs, vec![4, 5, 6, 7], "w's own chunks go out: {d:?}");
        // A report the tracker confirmed takes the chunk at once.
        s.report_bad_chunk(&report("r4", "h", 1, true), t0).unwrap();
        assert_eq!(s.holders(&blob(), 1), 2);
    }

    /// Where a member's registry ignored `Range`, runs go out one at a time,
    /// each to the blob's end: every request reads the blob from its first
    /// byte, so a run read as one answer costs a copy, and runs spread over
    /// many nodes would each read the prefix again.
    #[test]
    fn where_the_registry_ignores_ranges_one_run_at_a_time_goes_to_the_blobs_end() {
        let mut s = Scheduler::new(SchedulerConfig {
            min_blob_runs: 0,
            ..SchedulerConfig::default()
        });
        let t0 = Instant::now();
        let spread =
            |s: &mut Scheduler, p: &str| chunks_of(&s.announce(wants(p, 16, &[]), t0).assignments);
        assert_eq!(spread(&mut s, "a"), vec![0]);
        assert_eq!(spread(&mut s, "b"), vec![1]);
        let told = |p: &str, c: u32| {
            let mut told = added(p, 16, vec![c]);
            told.blobs[0].ranges_ignored = true;
            told
        };
        s.hash_settled(&blob(), 0, t0);
        // One of two says so, then two of two: fewer than three, runs as
        // before (the first members alone must not decide it).
        assert_eq!(
            chunks_of(&s.announce(told("a", 0), t0).assignments),
            vec![2]
        );
        s.hash_settled(&blob(), 1, t0);
        assert_eq!(
            chunks_of(&s.announce(told("b", 1), t0).assignments),
            vec![3]
        );
        // c joins saying so: three of three, and the swarm's runs go out one
        // at a time. a's and b's are live: none for c...
        let mut c = wants("c", 16, &[]);
        c.blobs[0].ranges_ignored = true;
        assert!(s.announce(c, t0).assignments.is_empty());
        // ...until they are done: then the first to ask takes every chunk
        // left (its answer, kept open, goes on from one to the next), and
        // it is the only one.
        s.hash_settled(&blob(), 3, t0);
        assert!(
            s.announce(added("b", 16, vec![3]), t0)
                .assignments
                .is_empty()
        );
        let d = fetched(&mut s, "a", 16, vec![2], t0);
        assert_eq!(chunks_of(&d.assignments), (4..16).collect::<Vec<u32>>());
        assert!(
            s.announce(added("b", 16, vec![]), t0)
                .assignments
                .is_empty()
        );
        assert!(
            s.announce(added("c", 16, vec![]), t0)
                .assignments
                .is_empty()
        );
    }

    /// A minority saying the registry ignores `Range` (liars can) changes no
    /// run: a run to the blob's end that a withholder fetched would be a
    /// blob's worth of chunks nobody else gets until it is doubted.
    #[test]
    fn a_minority_saying_the_registry_ignores_ranges_changes_no_run() {
        let mut s = Scheduler::new(SchedulerConfig {
            min_blob_runs: 0,
            ..SchedulerConfig::default()
        });
        let t0 = Instant::now();
        let mut liar = wants("l", 16, &[]);
        liar.blobs[0].ranges_ignored = true;
        for p in ["a", "b", "c"] {
            assert_eq!(s.announce(wants(p, 16, &[]), t0).assignments.len(), 1);
        }
        assert_eq!(
            chunks_of(&s.announce(liar.clone(), t0).assignments),
            vec![3]
        );
        // A second liar: two of five.
        let mut second = liar.clone();
        second.peer = "m".to_owned();
        assert_eq!(chunks_of(&s.announce(second, t0).assignments), vec![4]);
        assert_eq!(s.assignments(&blob()).len(), 5);
        let d = fetched(&mut s, "a", 16, vec![0], t0);
        assert_eq!(chunks_of(&d.assignments), vec![5]);
    }

    /// A run to the blob's end is judged window by window: its fetcher
    /// keeps it while its chunks come, and loses it as soon as one sitting
    /// on a one-stripe run would, not after the whole blob's timeout (a
    /// fetcher that stops must not park a blob's every chunk for ten
    /// minutes).
    #[test]
    fn a_run_to_the_blobs_end_is_taken_back_when_its_chunks_stop_coming() {
        let mut s = Scheduler::new(SchedulerConfig {
            min_blob_runs: 0,
            expiry_intervals: 1_000,
            ..SchedulerConfig::default()
        });
        let t0 = Instant::now();
        let told = |a: Announce| {
            let mut a = a;
            a.blobs[0].ranges_ignored = true;
            a
        };
        // Three say so (a, w and c) as they join; the runs of the first two
        // are done before the swarm's runs go one at a time.
        assert_eq!(
            chunks_of(&s.announce(told(wants("a", 16, &[])), t0).assignments),
            vec![0]
        );
        assert_eq!(
            chunks_of(&s.announce(told(wants("w", 16, &[])), t0).assignments),
            vec![1]
        );
        assert!(
            s.announce(told(wants("c", 16, &[])), t0)
                .assignments
                .is_empty()
        );
        s.hash_settled(&blob(), 1, t0);
        assert!(
            s.announce(added("w", 16, vec![1]), t0)
                .assignments
                .is_empty()
        );
        let whole = fetched(&mut s, "a", 16, vec![0], t0).assignments;
        assert_eq!(chunks_of(&whole), (2..16).collect::<Vec<u32>>());
        // One stripe's window (the floor: 5 s), where the whole run's
        // timeout is 15 chunks at the minimum rate.
        let window = whole[0].deadline - t0;
        assert_eq!(window, SchedulerConfig::default().min_fetch_timeout);
        // The tracker ticks every second (a longer gap is time it was
        // stopped, forgiven).
        let mut now = t0;
        let mut wait = |s: &mut Scheduler, d: Duration| {
            let end = now + d;
            while now < end {
                now = (now + Duration::from_secs(1)).min(end);
                s.announce(added("w", 16, vec![]), now);
                assert!(s.tick(now).reclaimed.is_empty(), "kept");
            }
            now
        };
        // Its chunks come, one a window less a millisecond: kept.
        for c in 2..5 {
            let at = wait(&mut s, window - Duration::from_millis(1));
            fetched(&mut s, "a", 16, vec![c], at);
        }
        // Then nothing: taken back one window after the tick that saw the
        // last, and the rest goes to the other member.
        let tick = Duration::from_secs(1);
        let now = wait(&mut s, window + tick - Duration::from_millis(1)) + Duration::from_millis(2);
        s.announce(added("a", 16, vec![]), now);
        s.announce(added("w", 16, vec![]), now);
        let report = s.tick(now);
        assert_eq!(report.reclaimed.len(), 1, "{report:?}");
        assert_eq!(report.reclaimed[0].0, "a");
        let next = s.announce(added("w", 16, vec![]), now).assignments;
        assert_eq!(chunks_of(&next), (5..16).collect::<Vec<u32>>());
    }

    #[test]
    fn what_only_peers_reported_silent_hold_is_owed_a_run_until_another_member_holds_it() {
        let mut s = Scheduler::new(SchedulerConfig {
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        let all: Vec<u32> = (0..8).collect();
        s.announce(wants("w", 8, &[]), t0);
        fetched(&mut s, "w", 8, all.clone(), t0);
        // "h" holds the first half too: those are not w's alone.
        s.announce(wants("h", 8, &[0, 1, 2, 3]), t0);
        for r in ["r1", "r2"] {
            let d = s.announce(wants(r, 8, &[]), t0);
            assert!(d.assignments.is_empty(), "every chunk is held: {d:?}");
            assert!(d.fetching.is_empty(), "{d:?}");
        }
        assert_eq!(
            s.report_silent(&silent("r1", "w"), t0).map(|d| d.owed),
            Ok(4)
        );
        // Nothing else changes: w stays named and keeps its holdings.
        assert_eq!((s.holders(&blob(), 0), s.holders(&blob(), 7)), (2, 1));
        let st = s.standing("w");
        assert!(!st.banned && st.silent_reporters == 1, "{st:?}");
        let d = s.announce(added("r2", 8, vec![]), t0);
        assert!(d.peers.values().flatten().any(|p| p.peer == "w"), "{d:?}");
        assert_eq!(d.fetching, vec![blob()], "{d:?}");
        let runs = chunks_of(&d.assignments);
        assert_eq!(runs, vec![4, 5, 6, 7], "w's own chunks go out: {d:?}");
        // A repeat of the same report changes nothing.
        assert_eq!(
            s.report_silent(&silent("r1", "w"), t0).map(|d| d.owed),
            Ok(0)
        );
        // Fetched by r2: two holders, nothing is owed any more, and a
        // second report finds nothing only w holds.
        fetched(&mut s, "r2", 8, vec![4, 5, 6, 7], t0);
        assert!(s.announce(added("r1", 8, vec![]), t0).fetching.is_empty());
        assert_eq!(
            s.report_silent(&silent("r2", "w"), t0).map(|d| d.owed),
            Ok(0)
        );
        assert_eq!(s.standing("w").silent_reporters, 2);
        // h reported too: the chunks only w and h hold would be owed, but
        // at most a quarter of the members (one of four) are doubted at once.
        assert_eq!(
            s.report_silent(&silent("r1", "h"), t0).map(|d| d.owed),
            Ok(0)
        );
        for r in ["r3", "r4", "r5", "r6"] {
            s.announce(wants(r, 8, &[]), t0);
        }
        // Eight members: two may be doubted. Reported again, h is, and the
        // chunks only w and h hold are owed now.
        assert_eq!(
            s.report_silent(&silent("r2", "h"), t0).map(|d| d.owed),
            Ok(4)
        );
        assert_eq!(
            s.announce(added("r1", 8, vec![]), t0).fetching,
            vec![blob()]
        );
        // The reports lapse with the window, and nothing is owed.
        s.tick(t0 + Duration::from_secs(61));
        assert_eq!(s.standing("w").silent_reporters, 0);
        let later = t0 + Duration::from_secs(62);
        let d = s.announce(added("r1", 8, vec![]), later);
        assert!(d.fetching.is_empty() && d.assignments.is_empty(), "{d:?}");
    }

    #[test]
    fn a_silence_report_needs_a_named_offender_and_a_reporter_naming_many_is_not_heard_nor_punished()
     {
        let mut s = Scheduler::new(SchedulerConfig {
            max_silent_per_reporter: 2,
            peers_per_blob: 8,
            ..striped()
        });
        let now = Instant::now();
        s.announce(wants("stranger", 8, &[]), now);
        s.leave("stranger");
        let honest: Vec<String> = (0..3).map(|i| format!("honest-{i}")).collect();
        for h in &honest {
            s.announce(wants(h, 8, &[0, 1, 2, 3, 4, 5, 6, 7]), now);
        }
        s.announce(wants("accuser", 8, &[]), now);
        assert!(matches!(
            s.report_silent(&silent("accuser", "stranger"), now)
                .map(|d| d.owed),
            Err(ScheduleError::NotNamed { .. })
        ));
        assert_eq!(
            s.report_silent(&silent("accuser", "accuser"), now)
                .map(|d| d.owed),
            Err(ScheduleError::SelfReport("accuser".into()))
        );
        // Three holders of each chunk: none is one's alone, none owed.
        for h in &honest[..2] {
            assert_eq!(
                s.report_silent(&silent("accuser", h), now).map(|d| d.owed),
                Ok(0)
            );
        }
        assert!(matches!(
            s.report_silent(&silent("accuser", &honest[2]), now)
                .map(|d| d.owed),
            Err(ScheduleError::SilenceReportLimit { reported: 2, .. })
        ));
        // A repeat of a peer already reported is taken, and changes nothing.
        assert_eq!(
            s.report_silent(&silent("accuser", &honest[0]), now)
                .map(|d| d.owed),
            Ok(0)
        );
        assert!(!s.standing("accuser").banned);
        assert_eq!(s.standing(&honest[2]).silent_reporters, 0);
        // The cap lapses with the reports.
        let later = now + Duration::from_secs(61);
        s.announce(wants("accuser", 8, &[]), later);
        assert!(
            s.report_silent(&silent("accuser", &honest[2]), later)
                .map(|d| d.owed)
                .is_ok()
        );
    }

    #[test]
    fn a_repeated_report_keeps_the_offender_doubted_past_the_window() {
        let mut s = Scheduler::new(SchedulerConfig {
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        s.announce(wants("w", 8, &[]), t0);
        fetched(&mut s, "w", 8, (0..8).collect(), t0);
        for r in ["r1", "r2", "r3", "r4"] {
            s.announce(wants(r, 8, &[]), t0);
        }
        assert_eq!(
            s.report_silent(&silent("r1", "w"), t0).map(|d| d.owed),
            Ok(8)
        );
        // r1 dropped w for good and repeats its report while it pulls:
        // counted once, it keeps w doubted.
        assert_eq!(
            s.report_silent(&silent("r1", "w"), at(30)).map(|d| d.owed),
            Ok(0)
        );
        s.tick(at(61));
        assert_eq!(
            s.report_silent(&silent("r2", "w"), at(61)).map(|d| d.owed),
            Ok(0),
            "still doubted: nothing newly owed"
        );
        // Unrepeated, the doubt lapses with the window, and the next report
        // owes w's chunks anew.
        s.tick(at(122));
        assert_eq!(
            s.report_silent(&silent("r3", "w"), at(122)).map(|d| d.owed),
            Ok(8)
        );
    }

    #[test]
    fn a_peer_reported_silent_in_one_blob_is_doubted_in_the_next_one_reported() {
        let mut s = Scheduler::new(SchedulerConfig {
            expiry_intervals: 1_000,
            ..striped()
        });
        let t0 = Instant::now();
        let other = BlobDigest::of(b"another layer");
        let both = |peer: &str, full: bool, held: &dyn Fn() -> Held| {
            let mut second = entry(8, held(), true);
            second.digest = other;
            announce(peer, full, vec![entry(8, held(), true), second])
        };
        let none = || Held::Bits(bits(8, []));
        s.announce(both("w", true, &none), t0);
        for c in 0..8 {
            s.hash_settled(&blob(), c, t0);
            s.hash_settled(&other, c, t0);
        }
        s.announce(both("w", false, &|| Held::Added((0..8).collect())), t0);
        for r in ["r1", "r2", "r3", "r4"] {
            s.announce(both(r, true, &none), t0);
        }
        // w withholds both layers: r1 asks it for the first and then, its
        // first report taken, for the second. Each report makes what only w
        // holds of that layer owed (the reporter's first report of w used to
        // stand for every layer, and the second layer's chunks were owed
        // nothing: every pull starved for them and fetched them alone).
        assert_eq!(
            s.report_silent(&silent("r1", "w"), t0).map(|d| d.owed),
            Ok(8)
        );
        let second = Silent {
            digest: other,
            ..silent("r1", "w")
        };
        assert_eq!(s.report_silent(&second, t0).map(|d| d.owed), Ok(8));
        // Repeats change nothing, and the reporter's cap counts w once.
        assert_eq!(s.report_silent(&second, t0).map(|d| d.owed), Ok(0));
        assert_eq!(s.standing("w").silent_reporters, 1);
        let d = s.announce(both("r2", false, &|| Held::Added(vec![])), t0);
        let mut fetching = d.fetching.clone();
        fetching.sort();
        let mut expected = vec![blob(), other];
        expected.sort();
        assert_eq!(fetching, expected, "{d:?}");
    }
}
