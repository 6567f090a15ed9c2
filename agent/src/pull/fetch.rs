//! Moving one blob's chunks into the store: a [`Transfer`] connects to peers,
//! learns what each holds, and keeps several chunk requests in flight per peer,
//! chosen by the shared [`ChunkPicker`]. Each chunk is verified against the
//! chunk map before it is written; a peer that sends a chunk failing its hash is
//! banned for the rest of the transfer and reported in [`FetchReport::bad_peers`].
//! Completed chunks are made durable in groups while the transfer runs.
//!
//! In a swarm, peers gain chunks while we fetch. One watcher per peer follows
//! its bitfield with long polls ([`PeerNode::bitfield_after`]): the peer
//! answers when it stores a chunk we have not seen, so news of a chunk reaches
//! us when it lands rather than at our next look, at every hop it travels
//! (figures: `docs/results.md`). Idle lanes sleep until a watcher, a released chunk or newly
//! learned hashes wake them; they send nothing.
//!
//! A swarm transfer keeps at most `peer.max_peers_per_blob` peers: the
//! tracker names new ones at every announce, and each costs a connection,
//! lanes and a watcher here plus a long poll to answer there. A peer named
//! past the cap retires the oldest one, cooperatively: the picker forgets it
//! at once, so no new chunk is picked from it; its lanes finish (or fail),
//! store and settle the chunk they are fetching, then stop; its watcher drops
//! its open poll. Until its lanes end it still counts in the transfer's
//! [`Roster`], so the tracker naming it again meanwhile is ignored; named
//! later, it comes back as a new peer. The rotation rule is
//! `dray_protocol::peers`, which the simulator runs too. Rotating peers this way is nearly as good
//! as keeping them all, where keeping the first 16 is not (figures:
//! `docs/results.md`). A fixed list of peers ([`fetch_from_peers`]) is not capped: retiring one
//! there could leave chunks that only it holds with nobody to fetch them from.
//!
//! Every chunk request has a deadline (the rule of
//! [`dray_protocol::pull::deadline`], which the simulator runs too): its
//! length at the median rate of the transfer's last chunks from peers,
//! times `SLOW_FACTOR`, at least `MIN_CHUNK_DEADLINE`; before its first
//! chunk, a transfer waits the length at `peer.min_chunk_bytes_per_s` plus
//! `peer.request_timeout`. The
//! deadline follows the swarm rather than a fixed rate: on a node starved of
//! CPU every chunk is slow, and a fixed 256 KiB/s dropped honest peers by
//! the dozen (16 nodes on 2 busy cores). The only other limit, a request
//! that moves no byte for `peer.request_timeout`, let a peer sending a byte
//! every few seconds keep a chunk forever. A request past its deadline with
//! half its bytes or more is waited for as long again (a busy honest peer
//! serving its `max_uploads`; `pull::deadline::extension`); with less, its
//! chunk goes back to the picker, and a swarm transfer drops the peer that missed it
//! for good (its other requests are cancelled at once). So does a request
//! its peer left silent (no byte of the chunk by the deadline, or none for
//! `peer.request_timeout`: [`Error::PeerSilent`]). The pull reports a peer
//! so dropped, slow or silent, to the tracker at once, and again while it
//! runs ([`Transfer::take_silent_peers`]), so the tracker sends out what
//! only such peers hold as registry runs: a peer trickling a byte now and
//! then is as useless as a silent one, and unreported it starved every
//! pull for what it alone held (the chaos sweep's `tricklers`: up to 9.25
//! copies; reported once, the same once the tracker's doubt lapsed).
//! Rescue and endgame: a lane with nothing left to pick asks its peer for a
//! chunk already requested from another peer, when every missing chunk is in
//! flight or that request has taken [`RESCUE_FACTOR`] times the median chunk
//! time; whichever copy lands first is kept and the other request
//! cancelled. Being overtaken so costs a peer nothing: on a loaded node a
//! request sent later often lands first (a peer serving three others while
//! it fetches its own registry run), and dropping the overtaken peer, as
//! the agent once did, left nodes of a four-node swarm with no peer at all
//! and waiting `swarm.stall` (issue 36's "30 s hole"). Only a missed
//! deadline (8 times the swarm's median chunk time, extended for a
//! request half there) drops a peer.
//!
//! The swarm engine adds registry fetches to a transfer; [`fetch_from_peers`]
//! is the plain case of a known map and a fixed list of peers.

use crate::error::{Error, Result};
use crate::peer::{PeerLink, PeerNode};
use crate::serving::metrics::Source;
use crate::store::{Blob, PutOutcome};
use dray_protocol::chunkmap::ChunkHash;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::peers::{Admit, Roster};
use dray_protocol::picker::{ChunkPicker, DEFAULT_WINDOW};
use dray_protocol::pull::deadline::{Deadline, extension};
use dray_protocol::pull::{Arbiter, ChunkRates, Claim, Ruling, SilenceReports};
use dray_protocol::{Bitfield, ChunkMap, VerifyError};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How often completed chunks are synced and recorded while a transfer runs.
const PERSIST_EVERY: Duration = Duration::from_millis(100);
/// How long a watcher lets a peer hold its bitfield answer when nothing
/// changes; it then asks again at once.
const WATCH_WAIT: Duration = Duration::from_secs(1);
/// Unchanged answers that come back early (a peer that predates long polls,
/// or one that has not opened the blob yet) are spaced this far apart, as the
/// polls before long polls were.
const MIN_ASK_GAP: Duration = Duration::from_millis(100);
/// Longest an idle lane sleeps before looking again. A safety net only: every
/// change that can give it work wakes it.
const IDLE_RECHECK: Duration = Duration::from_secs(1);
/// A request outstanding this many times the median chunk time may be sent
/// to a second peer.
pub const RESCUE_FACTOR: f64 = 2.0;
/// Peers asked for one chunk at once (two in the endgame).
const MAX_SOURCES: usize = 2;

/// A peer to fetch from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAddr {
    pub peer_id: String,
    pub addr: SocketAddr,
}

/// What a transfer did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct FetchReport {
    /// Chunks already held when the transfer began.
    pub resumed_chunks: u32,
    /// Verified chunks received, by peer.
    pub chunks_by_peer: BTreeMap<String, u32>,
    /// Peers that sent a chunk failing its hash, with the chunk index.
    pub bad_peers: BTreeMap<String, u32>,
    /// Peers whose chunk hashes the registry's bytes contradicted (a pull
    /// taking peers' word for hashes: see [`dray_protocol::pull::arbiter`]).
    pub liars: BTreeSet<String>,
    /// Chunks fetched from the registry to settle whose word was true.
    pub checks: u32,
    /// Bytes of verified chunks received from peers.
    pub bytes_received: u64,
    /// Verified chunks and bytes read from the registry (swarm pulls).
    pub chunks_from_registry: u32,
    pub bytes_from_registry: u64,
    /// UDP payload size each peer's path reached (MTU discovery), at the end.
    pub path_mtu_by_peer: BTreeMap<String, u16>,
    /// Peers dropped as too slow (a chunk past its deadline), with that
    /// chunk's index.
    pub slow_peers: BTreeMap<String, u32>,
    /// Chunks requested from a second peer while the first request was
    /// still under way (the endgame).
    pub second_requests: u32,
    /// Chunk requests answered in full after their deadline, half there by
    /// it (`pull::deadline::extension`): each a busy peer kept, not dropped.
    pub extended_requests: u32,
}

struct Shared {
    picker: ChunkPicker<String>,
    report: FetchReport,
    error: Option<Error>,
    /// Peers with lanes running (or starting), retired ones included until
    /// their lanes end; each with the token that retires it.
    roster: Roster<String, CancellationToken>,
    /// Each peer's last bitfield, whatever our known hashes: the picker's view
    /// of the peer is recomputed from it when hashes are learned.
    raw: HashMap<String, Bitfield>,
    /// Peers that failed: unreachable, their bitfield polls failing, or (in a
    /// swarm found through the DHT) not holding the blob at all.
    gone: std::collections::HashSet<String>,
    /// Peers that refused to be watched, at their watcher cap.
    refused: std::collections::HashSet<String>,
    /// Peers that answered a bitfield request for the blob: they hold or
    /// pull it.
    shown: std::collections::HashSet<String>,
    /// Peer requests in flight, by chunk: one, or two in the endgame.
    requests: HashMap<u32, Vec<Request>>,
    /// Bytes per second of the last chunks peers sent.
    rates: ChunkRates,
    stopped: bool,
    /// Chunks that failed their hash, with their senders, not yet taken by
    /// [`Transfer::take_bad_chunks`].
    unreported: Vec<(String, u32, Option<Instant>)>,
    /// Peers dropped for a request they left unanswered or too slow for
    /// its deadline, with its chunk, and when each was last taken by
    /// [`Transfer::take_silent_peers`].
    silence: SilenceReports<String>,
}

/// One chunk request to one peer.
struct Request {
    peer: String,
    started: Instant,
    /// Cancelled when another copy of the chunk lands first, or the peer is
    /// dropped as too slow.
    cancel: CancellationToken,
}

/// How a chunk request ended.
enum Ended {
    /// Its chunk is held now (from this request, or another copy that won);
    /// the rate it came at, if it was this request's copy that was stored.
    Held(Option<f64>),
    /// The chunk is not held: it may be picked again once no other request
    /// for it is under way.
    Failed,
}

impl Shared {
    /// Whether chunks may still be picked from `peer`.
    fn is_live(&self, peer: &str) -> bool {
        self.roster.is_live(peer)
    }

    /// Records a request for chunk `index` to `peer`; the token cancels it.
    fn begin(&mut self, index: u32, peer: &str) -> CancellationToken {
        let cancel = CancellationToken::new();
        self.requests.entry(index).or_default().push(Request {
            peer: peer.to_string(),
            started: Instant::now(),
            cancel: cancel.clone(),
        });
        cancel
    }

    /// A chunk already requested from another peer that `peer` can send,
    /// for a second request: the oldest one, among those whose request has
    /// taken `rescue_after`, or among all when every chunk still missing is
    /// in flight (`endgame`).
    fn second_source(
        &self,
        peer: &str,
        known: &Bitfield,
        endgame: bool,
        rescue_after: Option<Duration>,
    ) -> Option<u32> {
        let bits = self.raw.get(peer)?;
        self.requests
            .iter()
            .filter(|&(&i, reqs)| {
                reqs.len() < MAX_SOURCES
                    && reqs.iter().all(|r| r.peer != peer)
                    && bits.get(i)
                    && known.get(i)
            })
            .filter_map(|(&i, reqs)| {
                let started = reqs.iter().map(|r| r.started).min()?;
                let overdue = rescue_after.is_some_and(|after| started.elapsed() >= after);
                (endgame || overdue).then_some((started, i))
            })
            .min()
            .map(|(_, i)| i)
    }

    /// Stops picking chunks from `peer`: the picker forgets it and its last
    /// bitfield is dropped, so learned hashes do not bring it back; its lanes
    /// stop after the chunk in flight, its watcher at once. The caller wakes
    /// idle lanes.
    fn retire(&mut self, peer: &str) {
        self.roster.retire(peer);
        if let Some(retired) = self.roster.get(peer) {
            retired.cancel();
        }
        self.raw.remove(peer);
        self.picker.remove_peer(&peer.to_string());
    }
}

/// What a lane does next.
enum Next {
    /// Request this chunk; the token cancels the request.
    Fetch(u32, CancellationToken),
    /// Nothing to pick now; chunks may be released, hashes published or the
    /// peer may gain chunks.
    Wait,
    Stop,
}

/// One blob being filled from peers (and, through the swarm engine, the registry).
pub struct Transfer {
    node: Arc<PeerNode>,
    blob: Arc<Blob>,
    shared: Mutex<Shared>,
    released: Notify,
    /// Keep lanes alive while the blob is incomplete, watching their peers'
    /// bitfields, rather than ending once no peer holds what is missing.
    swarm: bool,
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// Caps peer requests in flight, whatever the number of peers.
    downloads: tokio::sync::Semaphore,
    /// The map's chunk size (the endgame's rule reads it often).
    chunk_size: u32,
    /// Stores under way on blocking threads. Each runs to its end even when
    /// its lane is aborted, so [`Transfer::finish`] waits for them: the
    /// last chunks of a blob are stored (and the pull sees it complete) a
    /// moment before they are counted.
    storing: AtomicUsize,
    /// No tracker vouches for chunk hashes (a swarm found through the DHT):
    /// watchers take each peer's word for the hashes of the chunks it
    /// holds, through the arbiter; those chunks reach no reader until the
    /// registry or the blob's digest vouches for them.
    peer_hashes: AtomicBool,
    /// Whose word each such hash is, and the disputes the registry settles;
    /// shared by the attempts of one pull (see [`Transfer::judged_by`]).
    arbiter: std::sync::OnceLock<Arc<Mutex<Arbiter<String>>>>,
}

/// Counts one store under way for as long as it lives.
struct Storing(Arc<Transfer>);

impl Drop for Storing {
    fn drop(&mut self) {
        self.0.storing.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Transfer {
    /// Opens the blob of `map` in the node's store and starts recording progress.
    pub async fn start(node: &Arc<PeerNode>, map: &ChunkMap, swarm: bool) -> Result<Arc<Self>> {
        let store = node.store().clone();
        let m = map.clone();
        let blob = tokio::task::spawn_blocking(move || store.blob(&m)).await??;
        let held = blob.held();
        let t = Arc::new(Self {
            node: node.clone(),
            shared: Mutex::new(Shared {
                report: FetchReport {
                    resumed_chunks: held.count(),
                    ..Default::default()
                },
                picker: ChunkPicker::new(held, DEFAULT_WINDOW),
                error: None,
                // A fixed list of peers is kept whole: each may be the only
                // one holding some chunks.
                roster: Roster::new(swarm.then_some(node.config.max_peers_per_blob)),
                raw: HashMap::new(),
                gone: Default::default(),
                refused: Default::default(),
                shown: Default::default(),
                requests: HashMap::new(),
                rates: ChunkRates::default(),
                stopped: false,
                unreported: Vec::new(),
                silence: SilenceReports::default(),
            }),
            blob,
            released: Notify::new(),
            swarm,
            tasks: Mutex::new(tokio::task::JoinSet::new()),
            downloads: tokio::sync::Semaphore::new(node.config.max_downloads.max(1)),
            chunk_size: map.chunk_size(),
            storing: AtomicUsize::new(0),
            peer_hashes: AtomicBool::new(false),
            arbiter: std::sync::OnceLock::new(),
        });
        t.spawn(persist_loop(t.clone()));
        Ok(t)
    }

    /// Whether `peer` failed in this transfer: it could not be reached,
    /// its bitfield polls failed, or it does not have the blob. (A peer
    /// retired past the cap of peers is not gone.)
    /// A member this pull ruled a liar is gone too: left in, it stays a
    /// fetcher candidate without a tracker, and the registry runs it is
    /// counted for wait `swarm.stall` for it (`tests/hostile_dht.rs`).
    pub fn is_gone(&self, peer: &str) -> bool {
        self.lock().gone.contains(peer) || self.is_liar(peer)
    }

    /// Whether this pull's arbiter ruled `peer` a liar.
    fn is_liar(&self, peer: &str) -> bool {
        self.arbiter.get().is_some_and(|a| {
            a.lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_liar(&peer.to_string())
        })
    }

    /// Whether `peer` refused to be watched in this transfer, serving as
    /// many watchers as it can: not gone, but not worth asking again.
    pub fn is_refused(&self, peer: &str) -> bool {
        self.lock().refused.contains(peer)
    }

    /// Whether `peer` showed in this transfer that it holds or pulls the
    /// blob: it answered a bitfield request for it, or refused to be
    /// watched at its watcher cap (which only a member of the blob does).
    pub fn has_shown(&self, peer: &str) -> bool {
        let sh = self.lock();
        sh.shown.contains(peer) || sh.refused.contains(peer)
    }

    /// Chunks some peer's last bitfield shows, whatever their hashes:
    /// without a tracker, a chunk no peer holds is one the registry must send.
    pub fn held_by_peers(&self) -> Bitfield {
        let sh = self.lock();
        let mut all = Bitfield::new(self.blob.held().len());
        for bits in sh.raw.values() {
            for i in bits.ones() {
                all.set(i);
            }
        }
        all
    }

    /// Takes peers' word for chunk hashes from now on (see `peer_hashes`):
    /// each watcher asks for them from its next poll.
    pub fn take_hashes_from_peers(&self) {
        self.peer_hashes.store(true, Ordering::Release);
    }

    /// Keeps this transfer's claims in `arbiter`, the pull's across its
    /// attempts (a liar ruled in one stays out of the next). Before any
    /// peer is added.
    pub fn judged_by(&self, arbiter: Arc<Mutex<Arbiter<String>>>) {
        _ = self.arbiter.set(arbiter);
    }

    fn arbiter(&self) -> std::sync::MutexGuard<'_, Arbiter<String>> {
        self.arbiter
            .get_or_init(|| Arc::new(Mutex::new(Arbiter::new(self.blob.map().chunk_count()))))
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `peer`'s word for the hashes in `theirs` (see
    /// [`dray_protocol::pull::arbiter`]): a first claim is taken, unvouched;
    /// one that differs from a claim taken waits for a check; one that
    /// contradicts a vouched hash rules `peer` a liar. Returns how many
    /// hashes were new.
    fn take_claims(&self, peer: &str, theirs: &ChunkMap) -> Result<u32> {
        let peer = peer.to_string();
        let mut new = 0;
        let mut ruling = Ruling::default();
        {
            let mut arb = self.arbiter();
            for (i, h) in theirs.hashes().iter().enumerate() {
                let (i, Some(h)) = (i as u32, *h) else {
                    continue;
                };
                if let Some(ours) = self.blob.hash(i)
                    && !self.blob.is_unvouched(i)
                {
                    if ours == h {
                        continue;
                    }
                    // A hash vouched for (by a tracker before it went
                    // silent, or the registry): the claim is a lie.
                    join(&mut ruling, arb.vouched(i, ours));
                }
                let (claim, r) = arb.claim(i, h, &peer);
                join(&mut ruling, r);
                match claim {
                    Claim::Taken => new += u32::from(self.blob.claim_hash(i, h)?),
                    Claim::Disputed => {
                        tracing::info!(%peer, index = i, digest = %self.blob.digest(), "peers differ on a chunk's hash: the registry decides")
                    }
                    Claim::Lied | Claim::Ignored => break,
                    Claim::Agrees => {}
                }
            }
        }
        self.rule(ruling)?;
        Ok(new)
    }

    /// The next disputed chunk to fetch from the registry, if any.
    pub fn next_check(&self) -> Option<u32> {
        self.arbiter().next_check()
    }

    /// The blob failed its digest with chunks on peers' word: the next
    /// chunk whose claim to check (see [`Arbiter::digest_failed`]).
    pub fn suspect(&self) -> Option<u32> {
        self.arbiter().digest_failed()
    }

    /// A check of chunk `index` ended: with the registry's bytes' hash, or
    /// `None` if it could not be made. Acts on the ruling.
    pub fn checked(&self, index: u32, registry: Option<ChunkHash>) -> Result<()> {
        let ruling = {
            let mut arb = self.arbiter();
            match registry {
                Some(hash) => arb.registry_says(index, hash),
                None => {
                    arb.check_failed(index);
                    return Ok(());
                }
            }
        };
        self.lock().report.checks += 1;
        self.rule(ruling)
    }

    /// Acts on a ruling: each liar is dropped from the pull, and the
    /// chunks held on its word are dropped; if any was, the attempt ends
    /// ([`Error::Ruled`]) and the next fetches them again from others.
    fn rule(&self, ruling: Ruling<String>) -> Result<()> {
        if ruling.liars.is_empty() {
            return Ok(());
        }
        let digest = self.blob.digest();
        {
            let mut sh = self.lock();
            for liar in &ruling.liars {
                tracing::warn!(peer = %liar, %digest, "peer identified as a liar: the registry's bytes contradict a chunk hash it gave; dropping it and every hash it gave");
                self.node.metrics().liar_identified();
                sh.picker.ban(liar);
                sh.retire(liar);
                sh.raw.remove(liar);
                sh.report.liars.insert(liar.clone());
                for r in sh.requests.values().flatten().filter(|r| r.peer == *liar) {
                    r.cancel.cancel();
                }
            }
        }
        self.released.notify_waiters();
        let chunks = self.blob.drop_claims(&ruling.dropped)?;
        if chunks > 0 {
            self.fail(Error::Ruled {
                digest,
                chunks,
                liars: ruling.liars.join(", "),
            });
        }
        Ok(())
    }

    pub fn blob(&self) -> &Arc<Blob> {
        &self.blob
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` as one of the transfer's tasks, in the caller's span (a
    /// swarm pull's names the blob in every line logged).
    fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .spawn(tracing::Instrument::in_current_span(f));
    }

    /// Starts fetching from `peer` unless it is already in use (retiring
    /// included) or banned. A swarm transfer with `peer.max_peers_per_blob`
    /// live peers first retires the oldest.
    pub fn add_peer(self: &Arc<Self>, peer: PeerAddr) {
        let retired = CancellationToken::new();
        let evicted = {
            let mut sh = self.lock();
            if sh.stopped || sh.picker.is_banned(&peer.peer_id) {
                return;
            }
            if self.is_liar(&peer.peer_id) {
                return;
            }
            match sh.roster.admit(peer.peer_id.clone(), retired.clone()) {
                Admit::Known => return,
                Admit::Added { retired: None } => false,
                Admit::Added { retired: Some(old) } => {
                    tracing::debug!(peer = %old, new = %peer.peer_id, "retiring the oldest peer of a full transfer");
                    sh.retire(&old);
                    true
                }
            }
        };
        if evicted {
            self.released.notify_waiters();
        }
        self.spawn(run_peer(self.clone(), peer, retired));
    }

    /// Stops using `peer` (see [`Shared::retire`]) and wakes idle lanes.
    fn retire(&self, peer: &str) {
        self.lock().retire(peer);
        self.released.notify_waiters();
    }

    /// Claims chunk `index` for a fetch outside the peer lanes (the registry);
    /// false if it is held or a peer request for it is in flight.
    pub fn claim(&self, index: u32) -> bool {
        self.lock().picker.claim(index)
    }

    /// Waits until chunk `index` is held (false) or neither held nor in
    /// flight, then claims it (true), as [`Transfer::claim`] does.
    pub async fn claim_when_free(&self, index: u32) -> bool {
        loop {
            // Registered before the check, so a release in between wakes us.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if self.blob.has(index) {
                return false;
            }
            if self.claim(index) {
                return true;
            }
            released.await;
        }
    }

    /// Verifies and stores a chunk from `peer` (or, with `None`, the
    /// registry) and counts it, in one step on a blocking thread, so a lane or
    /// run aborted meanwhile cannot store a chunk without counting it.
    pub async fn store<D: AsRef<[u8]> + Send + 'static>(
        self: &Arc<Self>,
        index: u32,
        data: D,
        peer: Option<String>,
    ) -> Result<PutOutcome> {
        self.storing.fetch_add(1, Ordering::AcqRel);
        let storing = Storing(self.clone());
        tokio::task::spawn_blocking(move || {
            let t = &storing.0;
            let data = data.as_ref();
            let len = data.len() as u64;
            let put = match peer {
                Some(_) => t.blob.put_chunk(index, data),
                None => t.blob.put_origin_chunk(index, data),
            };
            if let Ok(PutOutcome::Stored | PutOutcome::Completed) = put {
                let mut sh = t.lock();
                match peer {
                    Some(p) => {
                        t.node.metrics().received(Source::Peer, len);
                        *sh.report.chunks_by_peer.entry(p).or_default() += 1;
                        sh.report.bytes_received += len;
                    }
                    None => {
                        t.node.metrics().received(Source::Registry, len);
                        sh.report.chunks_from_registry += 1;
                        sh.report.bytes_from_registry += len;
                    }
                }
            }
            put
        })
        .await?
    }

    /// The outcome of a claimed chunk fetched outside the lanes.
    pub fn settle(&self, index: u32, stored: bool) {
        {
            let mut sh = self.lock();
            if stored {
                sh.picker.completed(index);
            } else {
                sh.picker.failed(index);
            }
        }
        self.released.notify_waiters();
    }

    /// New chunk hashes are known: recomputes what each peer offers from its
    /// last bitfield and wakes idle lanes.
    pub fn nudge(&self) {
        {
            let mut sh = self.lock();
            // Read under our lock, so a concurrent `offer` sees these hashes too.
            let known = self.blob.known();
            let Shared { picker, raw, .. } = &mut *sh;
            for (peer, bits) in raw.iter() {
                picker.set_peer(peer.clone(), usable(bits, &known));
            }
        }
        self.released.notify_waiters();
    }

    /// `peer` no longer offers chunk `index` (until its bitfield says so anew).
    fn forget_offer(&self, peer: &str, index: u32) {
        let mut sh = self.lock();
        let known = self.blob.known();
        let Shared { picker, raw, .. } = &mut *sh;
        if let Some(bits) = raw.get_mut(peer) {
            bits.clear(index);
            picker.set_peer(peer.to_string(), usable(bits, &known));
        }
    }

    /// Takes a peer's latest bitfield: keeps it raw and gives the picker the
    /// chunks usable now; wakes idle lanes if it changed. Returns whether it did.
    fn offer(&self, peer: &str, bits: Bitfield) -> bool {
        {
            let mut sh = self.lock();
            if !sh.is_live(peer) || sh.raw.get(peer) == Some(&bits) {
                return false;
            }
            let known = self.blob.known();
            sh.picker.set_peer(peer.to_string(), usable(&bits, &known));
            sh.raw.insert(peer.to_string(), bits);
        }
        self.released.notify_waiters();
        true
    }

    /// Stopped, failed or complete: nothing more to fetch.
    fn is_over(&self) -> bool {
        let sh = self.lock();
        sh.stopped || sh.error.is_some() || self.blob.is_complete()
    }

    /// Records an error that ends the transfer.
    pub fn fail(&self, e: Error) {
        self.lock().error.get_or_insert(e);
        self.released.notify_waiters();
    }

    /// Takes the error that ended the transfer, if any.
    pub fn take_error(&self) -> Option<Error> {
        self.lock().error.take()
    }

    /// Runs `f` on the transfer's picker, read only: the pull machine plans
    /// its registry runs from what it holds, has in flight and is offered.
    pub fn with_picker<R>(&self, f: impl FnOnce(&ChunkPicker<String>) -> R) -> R {
        f(&self.lock().picker)
    }

    /// The peers the transfer takes chunks from now (not retiring, gone or banned).
    pub fn live_peers(&self) -> Vec<String> {
        let sh = self.lock();
        sh.roster
            .live()
            .iter()
            .map(|m| m.key.clone())
            .filter(|p| !sh.gone.contains(p))
            .collect()
    }

    /// Chunk requests in flight (to peers or the registry).
    pub fn in_flight(&self) -> u32 {
        self.lock().picker.in_flight()
    }

    pub fn report(&self) -> FetchReport {
        self.lock().report.clone()
    }

    /// The chunks that failed their hash since the last call, each with its
    /// sender (banned from this transfer): the pull reports them to the
    /// tracker at once, so that it stops counting the sender as a holder
    /// of those chunks while the pull runs.
    pub fn take_bad_chunks(&self) -> Vec<(String, u32)> {
        let now = Instant::now();
        let mut sh = self.lock();
        let (due, later) = std::mem::take(&mut sh.unreported)
            .into_iter()
            .partition(|&(_, _, at)| at.is_none_or(|at| now >= at));
        sh.unreported = later;
        due.into_iter()
            .map(|(peer, index, _)| (peer, index))
            .collect()
    }

    /// The peers this pull dropped for a request they left unanswered (not
    /// a byte, or none for the request timeout) or answered too slowly for
    /// its deadline, each with the chunk asked, that are due a report: the
    /// pull reports them to the tracker at once (silent, in the protocol's
    /// word: no use to an asker), which sends out what only such a peer
    /// holds as registry runs to others, and again every
    /// `pull::silence::REPORT_AGAIN` while it runs, so that the tracker's
    /// doubt does not lapse while the pull still lacks what only they claim.
    pub fn take_silent_peers(&self) -> Vec<(String, u32)> {
        self.lock().silence.due(Instant::now())
    }

    /// The report of `peer` taken from [`Transfer::take_silent_peers`] did
    /// not reach the tracker: it is due again at the next announce rather
    /// than `REPORT_AGAIN` later (`pull::silence::SilenceReports::unsent`).
    pub fn silent_report_unsent(&self, peer: &str) {
        self.lock()
            .silence
            .unsent(&peer.to_string(), Instant::now());
    }

    /// The report of a bad chunk taken from [`Transfer::take_bad_chunks`]
    /// did not reach the tracker: it is due again at the next announce
    /// (`pull::silence::RETRY_UNSENT`); unheard, the tracker goes on
    /// counting the sender as a holder.
    pub fn bad_chunk_unsent(&self, peer: String, index: u32) {
        let due = Instant::now().checked_add(dray_protocol::pull::silence::RETRY_UNSENT);
        self.lock().unreported.push((peer, index, due));
    }

    /// Stops every lane and makes what was stored durable.
    pub async fn finish(&self) -> Result<FetchReport> {
        self.lock().stopped = true;
        self.released.notify_waiters();
        let mut tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        while self.storing.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (store, b) = (self.node.store().clone(), self.blob.clone());
        tokio::task::spawn_blocking(move || store.persist(&b)).await??;
        Ok(self.report())
    }

    /// Waits until the lanes have all ended.
    async fn join_lanes(&self) {
        loop {
            let next = {
                let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
                // The persister never ends on its own: one task left means the lanes are done.
                if tasks.len() <= 1 {
                    return;
                }
                tasks.try_join_next()
            };
            if next.is_none() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    fn next_for(&self, peer: &str) -> Next {
        if self.is_over() {
            return Next::Stop;
        }
        let mut sh = self.lock();
        if !sh.is_live(peer) || sh.picker.is_banned(&peer.to_string()) {
            return Next::Stop;
        }
        if let Some(i) = sh.picker.pick(&peer.to_string()) {
            let cancel = sh.begin(i, peer);
            return Next::Fetch(i, cancel);
        }
        let held = self.blob.held();
        let endgame = held.len() - held.count() == sh.picker.in_flight();
        let rescue_after = sh
            .rates
            .median()
            .map(|rate| Duration::from_secs_f64(RESCUE_FACTOR * f64::from(self.chunk_size) / rate));
        let known = self.blob.known();
        if let Some(i) = sh.second_source(peer, &known, endgame, rescue_after) {
            tracing::debug!(index = i, %peer, endgame, "requesting a chunk from a second peer");
            sh.report.second_requests += 1;
            let cancel = sh.begin(i, peer);
            return Next::Fetch(i, cancel);
        }
        if self.swarm || sh.picker.in_flight() > 0 {
            Next::Wait
        } else {
            Next::Stop
        }
    }

    /// How long a request for a chunk of `len` bytes may take: see the
    /// module doc.
    fn deadline(&self, len: usize) -> Deadline {
        let rates = self.lock().rates.clone();
        rates.deadline(len, || self.node.first_chunk_deadline(len))
    }

    /// The end of `peer`'s request for chunk `index`. A held chunk cancels
    /// the other request for it; a failed one is released to the picker
    /// once no other request for it is under way.
    fn end_request(&self, index: u32, peer: &str, ended: Ended) {
        {
            let mut sh = self.lock();
            let left = sh.requests.get_mut(&index).map_or(0, |reqs| {
                reqs.retain(|r| r.peer != peer);
                reqs.len()
            });
            match ended {
                Ended::Held(rate) => {
                    for other in sh.requests.remove(&index).into_iter().flatten() {
                        other.cancel.cancel();
                    }
                    sh.picker.completed(index);
                    if let Some(rate) = rate {
                        sh.rates.record(rate);
                    }
                }
                Ended::Failed if left == 0 => {
                    sh.requests.remove(&index);
                    sh.picker.failed(index);
                }
                Ended::Failed => {}
            }
        }
        self.released.notify_waiters();
    }

    /// `peer` was too slow with chunk `index`, or silent (it answered
    /// nothing): a swarm transfer drops it for good (its other requests
    /// cancelled at once) and has it reported, as silent or slow alike (a
    /// peer trickling a byte now and then is as useless as a silent one,
    /// and unreported it starved every pull for what only it held: the
    /// chaos sweep's `tricklers`); a fixed list of peers keeps it, as it
    /// may be the only one holding some chunks.
    fn too_slow(&self, peer: &str, index: u32, why: &str) {
        if !self.swarm {
            tracing::info!(%peer, index, why, "chunk request too slow");
            return;
        }
        tracing::warn!(%peer, index, why, digest = %self.blob.digest(), "peer too slow for this transfer; dropping it");
        {
            let mut sh = self.lock();
            sh.retire(peer);
            sh.picker.ban(&peer.to_string());
            sh.report.slow_peers.insert(peer.to_string(), index);
            sh.silence.dropped(peer.to_string(), index);
            for r in sh.requests.values().flatten().filter(|r| r.peer == peer) {
                r.cancel.cancel();
            }
        }
        self.released.notify_waiters();
    }
}

/// Runs a chunk request to its `deadline`, and past it for as long as
/// `pull::deadline::extension` gives it for the bytes of `len` it has
/// `received` by then. `Err` carries the deadline it missed, extension
/// included.
async fn within_deadline<F: std::future::Future>(
    deadline: Deadline,
    len: usize,
    received: &AtomicUsize,
    fetch: F,
) -> std::result::Result<F::Output, Duration> {
    tokio::pin!(fetch);
    if let Ok(out) = tokio::time::timeout(deadline.wait, &mut fetch).await {
        return Ok(out);
    }
    let got = received.load(Ordering::Acquire);
    let more = extension(deadline, got, len).ok_or(deadline.wait)?;
    tracing::debug!(
        ?deadline,
        ?more,
        len,
        "chunk request past its deadline, half there: waited for"
    );
    tokio::time::timeout(more, fetch)
        .await
        .map_err(|_| deadline.wait + more)
}

/// Fetches the blob of a complete `map` from a fixed list of peers.
pub async fn fetch_from_peers(
    node: &Arc<PeerNode>,
    map: &ChunkMap,
    peers: &[PeerAddr],
) -> Result<FetchReport> {
    let t = Transfer::start(node, map, false).await?;
    for p in peers {
        t.add_peer(p.clone());
    }
    t.join_lanes().await;
    let report = t.finish().await?;
    if let Some(e) = t.take_error() {
        return Err(e);
    }
    if !t.blob.is_complete() {
        let missing = map.chunk_count() - t.blob.held().count();
        return Err(Error::Incomplete {
            digest: map.digest(),
            detail: format!("{missing} chunks missing and no peer left that holds them"),
        });
    }
    Ok(report)
}

/// Peer bits usable now: held by the peer and with a known hash.
fn usable(bits: &Bitfield, known: &Bitfield) -> Bitfield {
    let mut out = Bitfield::new(bits.len());
    for i in bits.ones().filter(|&i| known.get(i)) {
        out.set(i);
    }
    out
}

async fn run_peer(t: Arc<Transfer>, p: PeerAddr, retired: CancellationToken) {
    let forget = |t: &Transfer| {
        let mut sh = t.lock();
        sh.retire(&p.peer_id);
        sh.roster.leave(&p.peer_id);
    };
    let start = async {
        let link = t.node.connect(&p.peer_id, p.addr).await?;
        let bits = t.node.bitfield(&link, &t.blob.map()).await?;
        Ok::<_, Error>((link, bits))
    };
    // A peer retired while still connecting is not worth the wait.
    let (link, seen) = match retired.run_until_cancelled(start).await {
        Some(Ok((link, bits))) => {
            let n = bits.count();
            t.lock().shown.insert(p.peer_id.clone());
            t.offer(&p.peer_id, bits);
            (link, n)
        }
        Some(Err(e)) => {
            tracing::warn!(error = %e, "skipping peer");
            let mut sh = t.lock();
            match e {
                // At its cap: alive, and still one of the blob's members.
                Error::Busy { .. } => sh.refused.insert(p.peer_id.clone()),
                _ => sh.gone.insert(p.peer_id.clone()),
            };
            drop(sh);
            return forget(&t);
        }
        None => return forget(&t),
    };
    let mut lanes = tokio::task::JoinSet::new();
    for _ in 0..DEFAULTS.depth_per_peer {
        lanes.spawn(tracing::Instrument::in_current_span(lane(
            t.clone(),
            link.clone(),
        )));
    }
    let lanes_done = async { while lanes.join_next().await.is_some() {} };
    if t.swarm {
        tokio::pin!(lanes_done);
        tokio::select! {
            () = &mut lanes_done => {}
            watched = watch_peer(&t, &link, seen, &retired) => {
                match watched {
                    Err(e @ Error::Busy { .. }) => {
                        // It serves as many watchers as it can: no fault of
                        // its, but a pull without a tracker watches others.
                        tracing::info!(error = %e, "retiring a peer that serves no more watchers");
                        t.lock().refused.insert(p.peer_id.clone());
                        t.retire(&p.peer_id);
                    }
                    Err(e) => {
                        tracing::info!(error = %e, "retiring a peer whose bitfield long poll failed");
                        t.lock().gone.insert(p.peer_id.clone());
                        t.retire(&p.peer_id);
                    }
                    Ok(()) => {}
                }
                lanes_done.await;
            }
        }
    } else {
        lanes_done.await;
    }
    t.lock()
        .report
        .path_mtu_by_peer
        .insert(p.peer_id.clone(), link.path_mtu());
    forget(&t);
}

/// Follows a peer's bitfield with long polls, starting from `seen` chunks,
/// until the transfer is over, the peer holds every chunk (and, once the
/// pull takes peers' word for hashes, has told them all) or it is retired
/// (which drops the open poll). An error means the peer stopped answering.
async fn watch_peer(
    t: &Transfer,
    link: &PeerLink,
    mut seen: u32,
    retired: &CancellationToken,
) -> Result<()> {
    // Only the digest and the chunk count are used: they never change.
    let map = t.blob.map();
    // Whether hashes may be missing: the last answer left some out, or,
    // taking peers' word, none was asked for yet (a peer holding every
    // chunk already would otherwise never be asked). Then ask at once.
    let mut more_hashes = t.peer_hashes.load(Ordering::Acquire);
    while !t.is_over() {
        if seen >= map.chunk_count() && !more_hashes {
            // The peer holds every chunk and has told the hashes asked for.
            // A pull that does not take peers' word for hashes has nothing
            // more to ask; if it comes to (every tracker replica went down),
            // the peer is asked for its hashes then.
            if t.peer_hashes.load(Ordering::Acquire) {
                return Ok(());
            }
            let hash_mode = async {
                while !t.peer_hashes.load(Ordering::Acquire) && !t.is_over() {
                    tokio::time::sleep(IDLE_RECHECK).await;
                }
            };
            if retired.run_until_cancelled(hash_mode).await.is_none() || t.is_over() {
                return Ok(());
            }
            more_hashes = true;
        }
        let asked = tokio::time::Instant::now();
        let peer_hashes = t.peer_hashes.load(Ordering::Acquire);
        let above = if more_hashes { 0 } else { seen };
        let poll = async {
            if !peer_hashes {
                return t.node.bitfield_after(link, &map, above, WATCH_WAIT).await;
            }
            let known = t.blob.known();
            let (bits, theirs) = t
                .node
                .bitfield_with_hashes(link, &map, above, WATCH_WAIT, &known)
                .await?;
            let told = theirs.known().count();
            more_hashes = told as usize >= dray_protocol::framing::MAX_HASHES_PER_ANSWER;
            match t.take_claims(&link.peer_id, &theirs) {
                Ok(0) => {}
                Ok(_) => t.nudge(),
                Err(e) => t.fail(e),
            }
            Ok(bits)
        };
        let Some(bits) = retired.run_until_cancelled(poll).await else {
            return Ok(());
        };
        let bits = bits?;
        seen = bits.count();
        if !t.offer(&link.peer_id, bits) && !more_hashes {
            tokio::time::sleep_until(asked + MIN_ASK_GAP).await;
        }
    }
    Ok(())
}

/// One request slot towards one peer: pick, fetch, verify and store, repeat,
/// until the transfer is over or the peer is retired or banned. A chunk
/// already requested is always finished and settled first.
async fn lane(t: Arc<Transfer>, link: PeerLink) {
    let peer = link.peer_id.clone();
    loop {
        let Ok(_slot) = t.downloads.acquire().await else {
            return;
        };
        // Listen before looking, so a wake-up in between is not lost.
        let wake = t.released.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        let (index, cancel) = match t.next_for(&peer) {
            Next::Fetch(i, cancel) => (i, cancel),
            Next::Wait => {
                drop(_slot);
                let _ = tokio::time::timeout(IDLE_RECHECK, wake).await;
                continue;
            }
            Next::Stop => return,
        };
        let map = t.blob.map();
        let len = map.chunk_len(index);
        let deadline = t.deadline(len);
        tracing::debug!(index, %peer, ?deadline, "requesting chunk");
        let started = Instant::now();
        let received = AtomicUsize::new(0);
        let fetch = within_deadline(
            deadline,
            len,
            &received,
            t.node.fetch_chunk_noting(&link, &map, index, &received),
        );
        let bytes = match cancel.run_until_cancelled(fetch).await {
            // Another copy landed first, or the peer was dropped as too slow.
            None => {
                t.end_request(index, &peer, Ended::Failed);
                continue;
            }
            Some(Err(missed)) => {
                t.end_request(index, &peer, Ended::Failed);
                let why = match received.load(Ordering::Acquire) {
                    0 => format!("sent no byte within its deadline of {missed:?}"),
                    got => format!("missed its deadline of {missed:?} with {got} of {len} bytes"),
                };
                t.too_slow(&peer, index, &why);
                continue;
            }
            Some(Ok(Err(e @ Error::PeerSilent { .. }))) => {
                t.end_request(index, &peer, Ended::Failed);
                t.too_slow(&peer, index, &e.to_string());
                continue;
            }
            Some(Ok(Ok(b))) => {
                if started.elapsed() > deadline.wait {
                    t.lock().report.extended_requests += 1;
                }
                b
            }
            Some(Ok(Err(e))) => {
                tracing::warn!(error = %e, index, "chunk request failed");
                t.end_request(index, &peer, Ended::Failed);
                if link.is_closed() {
                    t.retire(&peer);
                    return;
                }
                if matches!(e, Error::Rejected { .. } | Error::Busy { .. }) {
                    // BUSY or not held: give the peer (and the others) a
                    // moment; the peer's other lanes carry on.
                    tokio::time::sleep(Duration::from_millis(DEFAULTS.busy_backoff_ms)).await;
                }
                continue;
            }
        };
        let took = started.elapsed().as_secs_f64().max(1e-6);
        match t.store(index, bytes, Some(peer.clone())).await {
            Ok(outcome) => {
                tracing::debug!(index, %peer, ?outcome, "chunk stored");
                let rate = matches!(outcome, PutOutcome::Stored | PutOutcome::Completed)
                    .then(|| len as f64 / took);
                // Also wakes lanes waiting on chunks in flight (the end of a
                // plain transfer, say).
                t.end_request(index, &peer, Ended::Held(rate));
            }
            // A hash ruled a liar's claim while the chunk was on its way
            // (the arbiter dropped it): the sender is not at fault, and the
            // chunk is asked for again once an honest claim is taken.
            // Failing the pull here failed 3 of 8 mirror pulls beside two
            // liars without a tracker (tests/hostile_dht.rs).
            Err(Error::Verify(VerifyError::HashUnknown { .. }))
                if t.peer_hashes.load(Ordering::Acquire) =>
            {
                tracing::info!(%peer, index, "peer sent a chunk whose claimed hash was ruled out; asking again");
                t.forget_offer(&peer, index);
                t.end_request(index, &peer, Ended::Failed);
                continue;
            }
            Err(Error::Superseded { .. }) => {
                // Stale, not lying: it drops the chunk at its next announce.
                tracing::info!(%peer, index, "peer sent a chunk whose hash was replaced; asking another");
                t.forget_offer(&peer, index);
                t.end_request(index, &peer, Ended::Failed);
                continue;
            }
            // Bytes that fail a hash taken on another peer's word: their
            // hash is this peer's claim, and the registry decides.
            Err(Error::Disputed { hash, .. }) => {
                t.end_request(index, &peer, Ended::Failed);
                t.forget_offer(&peer, index);
                let ruling = {
                    let mut arb = t.arbiter();
                    arb.sent(index, hash, &peer).1
                };
                if let Err(e) = t.rule(ruling) {
                    t.fail(e);
                    return;
                }
                continue;
            }
            Err(Error::Verify(VerifyError::ChunkHash { .. } | VerifyError::ChunkLength { .. })) => {
                tracing::warn!(%peer, index, digest = %map.digest(), "peer sent a chunk that fails its hash; banning it");
                t.node.metrics().verify_failed(Source::Peer);
                {
                    let mut sh = t.lock();
                    sh.picker.ban(&peer);
                    sh.report.bad_peers.insert(peer.clone(), index);
                    sh.unreported.push((peer.clone(), index, None));
                }
                t.end_request(index, &peer, Ended::Failed);
                return;
            }
            // Every chunk held and the blob failed its digest, some on
            // peers' word alone: those claims are the suspects, checked
            // against the registry one claimant at a time (the pull's drive
            // loop asks [`Transfer::suspect`]), and readers were handed none
            // of their bytes. Only a pull without unvouched chunks fails.
            Err(Error::Verify(VerifyError::BlobDigest { .. }))
                if t.blob.is_failed() && t.blob.unvouched() > 0 =>
            {
                tracing::warn!(digest = %map.digest(), unvouched = t.blob.unvouched(), "the blob failed its digest with chunks on peers' word: checking their claims against the registry");
                t.end_request(index, &peer, Ended::Held(None));
                continue;
            }
            Err(e) => {
                t.end_request(index, &peer, Ended::Failed);
                t.fail(e);
                return;
            }
        }
    }
}

/// Adds `more` to `ruling`.
fn join(ruling: &mut Ruling<String>, more: Ruling<String>) {
    ruling.liars.extend(more.liars);
    ruling.dropped.extend(more.dropped);
}

async fn persist_loop(t: Arc<Transfer>) {
    let mut tick = tokio::time::interval(PERSIST_EVERY);
    loop {
        tick.tick().await;
        let (store, b) = (t.node.store().clone(), t.blob.clone());
        match tokio::task::spawn_blocking(move || store.persist(&b)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "recording completed chunks failed"),
            // The runtime is shutting down; `finish` persists on a normal end.
            Err(e) if e.is_cancelled() => return,
            Err(e) => tracing::error!(error = %e, "recording completed chunks panicked"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ClusterCa;
    use crate::peer::PeerConfig;
    use crate::store::ChunkStore;
    use dray_protocol::chunkmap::MIN_CHUNK_SIZE;

    /// A request moving at a busy honest peer's pace, half there or more at
    /// its deadline, is waited for as long again; one with less (a
    /// trickler) ends at the deadline. Paused time: exact, whatever the
    /// machine's load.
    #[tokio::test(start_paused = true)]
    async fn a_request_half_there_at_its_deadline_is_waited_for_and_a_trickle_is_not() {
        let wait = Duration::from_secs(8);
        let deadline = Deadline {
            wait,
            extendable: true,
        };
        let len = 4 << 20;
        // Three quarters there at the deadline, done at 12 s.
        let received = AtomicUsize::new(0);
        let paced = async {
            received.store(len * 3 / 4, Ordering::Release);
            tokio::time::sleep(Duration::from_secs(12)).await;
            len
        };
        let started = tokio::time::Instant::now();
        assert_eq!(
            within_deadline(deadline, len, &received, paced).await,
            Ok(len)
        );
        assert_eq!(started.elapsed(), Duration::from_secs(12));
        // A kilobyte a second: 8 KiB at the deadline.
        let trickled = AtomicUsize::new(0);
        let trickle = async {
            trickled.store(8 << 10, Ordering::Release);
            std::future::pending::<usize>().await
        };
        let started = tokio::time::Instant::now();
        assert_eq!(
            within_deadline(deadline, len, &trickled, trickle).await,
            Err(wait)
        );
        assert_eq!(started.elapsed(), wait);
        // Half there, and no further past twice the deadline.
        let stuck = AtomicUsize::new(len / 2);
        let pending = std::future::pending::<usize>();
        assert_eq!(
            within_deadline(deadline, len, &stuck, pending).await,
            Err(2 * wait)
        );
        // A first deadline (no rate seen yet) is not extended.
        let first = Deadline {
            wait,
            extendable: false,
        };
        let pending = std::future::pending::<usize>();
        assert_eq!(
            within_deadline(first, len, &stuck, pending).await,
            Err(wait)
        );
    }

    /// A transfer's live and retiring peers, each sorted.
    fn peers(t: &Transfer) -> (Vec<String>, Vec<String>) {
        let sh = t.lock();
        let mut live: Vec<String> = sh.roster.live().iter().map(|m| m.key.clone()).collect();
        let mut retiring: Vec<String> = sh.roster.retiring().cloned().collect();
        live.sort();
        retiring.sort();
        (live, retiring)
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    async fn until_nothing_retiring(t: &Transfer) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !peers(t).1.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "retired peers never left: {:?}",
                peers(t)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A leech configured as `leech` and two peers holding the same blob of
    /// 8 chunks of 256 KiB, one serving at full speed and one paced to
    /// 32 KiB/s (after a 64 KiB burst): 2 s between its 64 KiB slices.
    struct FastAndSlow {
        leech: Arc<PeerNode>,
        fast: Arc<PeerNode>,
        slow: Arc<PeerNode>,
        map: ChunkMap,
        ca: ClusterCa,
    }

    fn fast_and_slow(dir: &std::path::Path, leech: PeerConfig) -> FastAndSlow {
        let ca = ClusterCa::generate().unwrap();
        let any = "127.0.0.1:0".parse().unwrap();
        let src = dir.join("src");
        let chunk = 4 * MIN_CHUNK_SIZE;
        let bytes: Vec<u8> = (0..8 * chunk).map(|i| (i % 253) as u8).collect();
        std::fs::write(&src, bytes).unwrap();
        let node = |id: &str, config: PeerConfig| {
            let store = Arc::new(ChunkStore::open(&dir.join(id)).unwrap());
            PeerNode::bind(ca.issue(id).unwrap(), store, any, config).unwrap()
        };
        let fast = node("fast", PeerConfig::default());
        let slow = node(
            "slow",
            PeerConfig {
                upload_bytes_per_s: Some(32 << 10),
                ..PeerConfig::default()
            },
        );
        let map = fast.store().import(&src, chunk).unwrap();
        slow.store().import(&src, chunk).unwrap();
        FastAndSlow {
            leech: node("leech", leech),
            fast,
            slow,
            map,
            ca,
        }
    }

    /// A peer that holds every chunk of `map`'s blob but the last with one
    /// bit flipped, under the hashes of its flipped bytes: it answers
    /// bitfields and hashes, and serves its bytes, as an honest peer would.
    fn liar_node(
        dir: &std::path::Path,
        ca: &ClusterCa,
        map: &ChunkMap,
        bytes: &[u8],
    ) -> Arc<PeerNode> {
        let flip = |i: u32| {
            let (at, len) = (map.offset(i) as usize, map.chunk_len(i));
            let mut b = bytes[at..at + len].to_vec();
            b[len / 2] ^= 0x40;
            b
        };
        let hashes = (0..map.chunk_count())
            .map(|i| dray_protocol::chunkmap::chunk_hash(&flip(i)))
            .collect();
        let lie = ChunkMap::new(map.digest(), map.size(), map.chunk_size(), hashes).unwrap();
        let store = Arc::new(ChunkStore::open(&dir.join("liar")).unwrap());
        let held = store.blob(&lie).unwrap();
        for i in 0..lie.chunk_count() - 1 {
            held.put_chunk(i, &flip(i)).unwrap();
        }
        let any = "127.0.0.1:0".parse().unwrap();
        PeerNode::bind(ca.issue("liar").unwrap(), store, any, PeerConfig::default()).unwrap()
    }

    #[tokio::test]
    async fn a_bad_chunk_report_the_tracker_did_not_hear_is_due_again_at_the_next_announce() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = fast_and_slow(dir.path(), PeerConfig::default());
        let t = Transfer::start(&nodes.leech, &nodes.map, true)
            .await
            .unwrap();
        t.bad_chunk_unsent("liar".into(), 3);
        assert!(
            t.take_bad_chunks().is_empty(),
            "due only after a retry period"
        );
        tokio::time::sleep(dray_protocol::pull::silence::RETRY_UNSENT + Duration::from_millis(50))
            .await;
        assert_eq!(t.take_bad_chunks(), [("liar".to_string(), 3)]);
        assert!(t.take_bad_chunks().is_empty(), "taken once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_liar_answering_first_is_found_out_by_one_registry_chunk_and_readers_see_none_of_its_bytes()
     {
        let dir = tempfile::tempdir().unwrap();
        let nodes = fast_and_slow(dir.path(), PeerConfig::default());
        let m = &nodes.map;
        let bytes = std::fs::read(dir.path().join("src")).unwrap();
        let liar = liar_node(dir.path(), &nodes.ca, m, &bytes);
        let unhashed = ChunkMap::unhashed(m.digest(), m.size(), m.chunk_size()).unwrap();
        let t = Transfer::start(&nodes.leech, &unhashed, true)
            .await
            .unwrap();
        t.take_hashes_from_peers();
        let readers = t.blob().subscribe();
        // The liar answers first: its word is taken for every chunk it holds.
        t.add_peer(addr_of(&liar));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while t.blob().held().count() < m.chunk_count() - 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "held {}",
                t.blob().held().count()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Then an honest peer: the last chunk comes from it, and the blob
        // fails its digest with every other chunk on the liar's word.
        t.add_peer(addr_of(&nodes.fast));
        while !t.blob().is_failed() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the blob never failed its digest"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let p = *readers.borrow();
        assert_eq!(
            (p.chunks, p.failed),
            (0, false),
            "readers were offered chunks on a peer's word: {p:?}"
        );
        assert_eq!(
            t.blob().offered().count(),
            0,
            "chunks on peers' word are offered on"
        );
        // The suspect is the liar's: its claims outnumber the honest peer's.
        let index = t.suspect().expect("a claim to check");
        let (at, len) = (m.offset(index) as usize, m.chunk_len(index));
        let registry = dray_protocol::chunkmap::chunk_hash(&bytes[at..at + len]);
        // As the pull's check does: the registry's bytes are stored (they
        // replace the liar's), then the ruling.
        let from_registry = bytes[at..at + len].to_vec();
        match t.store(index, from_registry, None).await {
            // Still wrong: the liar's other chunks.
            Err(Error::Verify(VerifyError::BlobDigest { .. })) => {}
            other => panic!("{other:?}"),
        }
        t.checked(index, Some(registry)).unwrap();
        let ruled = t.take_error();
        assert!(
            matches!(ruled, Some(Error::Ruled { chunks, .. }) if chunks == m.chunk_count() - 2),
            "suspect {index}: {ruled:?}"
        );
        let report = t.finish().await.unwrap();
        assert_eq!(report.liars.iter().collect::<Vec<_>>(), vec!["liar"]);
        assert!(
            report.bad_peers.is_empty() && report.slow_peers.is_empty(),
            "{report:?}"
        );
        // Left: the registry's chunk, vouched, and the honest peer's.
        assert_eq!(t.blob().held().count(), 2, "the liar's chunks were dropped");
        assert_eq!(t.blob().offered().count(), 1);
    }

    fn addr_of(n: &PeerNode) -> PeerAddr {
        PeerAddr {
            peer_id: n.peer_id().into(),
            addr: n.local_addr().unwrap(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_last_chunks_held_by_a_slow_peer_are_requested_again_from_a_fast_one() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = fast_and_slow(dir.path(), PeerConfig::default());
        let (slow, fast) = (addr_of(&nodes.slow), addr_of(&nodes.fast));
        let t = std::time::Instant::now();
        let report = fetch_from_peers(&nodes.leech, &nodes.map, &[slow, fast])
            .await
            .unwrap();
        let took = t.elapsed();
        // The slow peer needs 8 s per chunk.
        assert!(took < Duration::from_secs(4), "took {took:?}: {report:?}");
        assert!(report.second_requests > 0, "{report:?}");
        assert!(
            report.chunks_by_peer.get("slow").copied().unwrap_or(0) <= 1,
            "{report:?}"
        );
        // A fixed list keeps its peers, slow or not.
        assert!(report.slow_peers.is_empty(), "{report:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_swarm_drops_and_reports_a_peer_that_misses_a_chunk_deadline_and_fetches_its_chunks_elsewhere()
     {
        let dir = tempfile::tempdir().unwrap();
        // One request at a time, so the slow peer's slices come 2 s apart,
        // within the 3 s without a byte that abandons a request; before any
        // chunk has come, a request of 256 KiB waits 2 s plus those 3 s.
        let leech = PeerConfig {
            max_downloads: 1,
            request_timeout: Duration::from_secs(3),
            ..PeerConfig::default()
        };
        let nodes = fast_and_slow(dir.path(), leech);
        let (slow, fast) = (addr_of(&nodes.slow), addr_of(&nodes.fast));
        let t = Transfer::start(&nodes.leech, &nodes.map, true)
            .await
            .unwrap();
        t.add_peer(slow.clone());
        let started = std::time::Instant::now();
        while t.report().slow_peers.is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(8),
                "never dropped: {:?}",
                t.report()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            started.elapsed() >= Duration::from_millis(4_900),
            "{:?}",
            started.elapsed()
        );
        // Named again (the tracker names it at every announce): not taken back.
        t.add_peer(slow);
        t.add_peer(fast);
        while !t.blob().is_complete() {
            assert!(
                started.elapsed() < Duration::from_secs(12),
                "incomplete: {:?}",
                t.report()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let report = t.finish().await.unwrap();
        assert!(report.slow_peers.contains_key("slow"), "{report:?}");
        assert!(
            report.chunks_by_peer.get("slow").copied().unwrap_or(0) <= 1,
            "{report:?}"
        );
        assert!(
            report.bad_peers.is_empty(),
            "a slow peer is not a liar: {report:?}"
        );
        // It answered, too slowly: reported all the same, once until the
        // report is due again.
        let reported = t.take_silent_peers();
        assert_eq!(reported.len(), 1, "{reported:?}");
        assert_eq!(reported[0].0, "slow", "{reported:?}");
        assert!(t.take_silent_peers().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_complete_peer_is_asked_for_hashes_once_the_pull_takes_peers_word() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = fast_and_slow(dir.path(), PeerConfig::default());
        let m = &nodes.map;
        // As a tracker's pull starts: the blob's geometry, no hash yet.
        let unhashed = ChunkMap::unhashed(m.digest(), m.size(), m.chunk_size()).unwrap();
        let t = Transfer::start(&nodes.leech, &unhashed, true)
            .await
            .unwrap();
        t.add_peer(addr_of(&nodes.fast));
        // The peer holds every chunk, but none can be verified: its watcher
        // has seen it all and waits.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(t.blob().held().count(), 0);
        // Every tracker replica went down: the pull takes peers' word.
        t.take_hashes_from_peers();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !t.blob().is_complete() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "held {} of {} chunks",
                t.blob().held().count(),
                m.chunk_count()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        t.finish().await.unwrap();
    }

    #[tokio::test]
    async fn a_peer_named_past_the_cap_retires_the_oldest_which_may_come_back_later() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        let store = Arc::new(ChunkStore::open(&dir.path().join("leech")).unwrap());
        let config = PeerConfig {
            max_peers_per_blob: 2,
            ..PeerConfig::default()
        };
        let any = "127.0.0.1:0".parse().unwrap();
        let node = PeerNode::bind(ca.issue("leech").unwrap(), store, any, config).unwrap();
        let blob = |byte| {
            ChunkMap::of_bytes(&vec![byte; 2 * MIN_CHUNK_SIZE as usize], MIN_CHUNK_SIZE).unwrap()
        };
        // Peers that never finish a handshake: they stay connecting until retired.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = |id: &str| PeerAddr {
            peer_id: id.into(),
            addr: silent.local_addr().unwrap(),
        };
        let t = Transfer::start(&node, &blob(1), true).await.unwrap();

        for id in ["p1", "p2", "p3"] {
            t.add_peer(at(id));
        }
        assert_eq!(peers(&t), (ids(&["p2", "p3"]), ids(&["p1"])));
        // Named again while still retiring: ignored.
        t.add_peer(at("p1"));
        assert_eq!(peers(&t), (ids(&["p2", "p3"]), ids(&["p1"])));
        until_nothing_retiring(&t).await;
        assert_eq!(peers(&t), (ids(&["p2", "p3"]), vec![]));

        // Gone, it comes back as a new peer and retires the now oldest.
        t.add_peer(at("p1"));
        assert_eq!(peers(&t), (ids(&["p1", "p3"]), ids(&["p2"])));
        // A live peer named again changes nothing.
        t.add_peer(at("p3"));
        assert_eq!(peers(&t), (ids(&["p1", "p3"]), ids(&["p2"])));
        until_nothing_retiring(&t).await;
        t.finish().await.unwrap();
        assert_eq!(t.in_flight(), 0);

        // A fixed list of peers is not capped.
        let plain = Transfer::start(&node, &blob(2), false).await.unwrap();
        for id in ["p1", "p2", "p3"] {
            plain.add_peer(at(id));
        }
        assert_eq!(peers(&plain), (ids(&["p1", "p2", "p3"]), vec![]));
        plain.finish().await.unwrap();
    }

    #[tokio::test]
    async fn a_chunk_in_flight_is_claimed_once_its_request_fails_and_not_once_it_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        let store = Arc::new(ChunkStore::open(dir.path()).unwrap());
        let any = "127.0.0.1:0".parse().unwrap();
        let node =
            PeerNode::bind(ca.issue("n").unwrap(), store, any, PeerConfig::default()).unwrap();
        let bytes = vec![7u8; 2 * MIN_CHUNK_SIZE as usize];
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let t = Transfer::start(&node, &map, true).await.unwrap();
        let waiting = Duration::from_millis(50);

        // In flight elsewhere (a peer request): the waiter waits; the
        // request fails, and the waiter holds the claim.
        assert!(t.claim(0));
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.claim_when_free(0).await }
        });
        tokio::time::sleep(waiting).await;
        assert!(!waiter.is_finished());
        t.settle(0, false);
        assert!(waiter.await.unwrap());
        assert!(!t.claim(0), "the waiter's claim stands");
        t.settle(0, false);

        // The request succeeds: nothing to claim.
        assert!(t.claim(1));
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.claim_when_free(1).await }
        });
        tokio::time::sleep(waiting).await;
        assert!(!waiter.is_finished());
        let chunk = bytes[MIN_CHUNK_SIZE as usize..].to_vec();
        t.store(1, chunk, None).await.unwrap();
        t.settle(1, true);
        assert!(!waiter.await.unwrap());
        t.finish().await.unwrap();
    }
}
