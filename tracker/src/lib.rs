//! The dray tracker: the announce service that keeps soft who-has-what state and
//! schedules registry fetches so that each chunk leaves the registry about once.
//!
//! It wraps the pure [`dray_protocol::scheduler::Scheduler`] (shared with the
//! simulator) with what a service needs: an HTTP endpoint taking protobuf
//! `TrackerRequest`s, a clock, a ticker that takes back stalled assignments, and
//! the chunk maps that registry fetchers publish piecemeal. Nothing is written
//! to disk: a restarted tracker asks each agent for a full announce and is whole
//! again within one announce interval. Replicas share nothing; agents pick the
//! replica that owns a blob by rendezvous hashing of its digest.
//!
//! Next to `POST /v1/tracker` the same listener serves `/metrics` (see
//! [`metrics`]), `/healthz`, `/readyz`, the preheat API (`POST
//! /v1/preheat`, `GET /v1/preheat/{id}`; see [`preheat`]) for preheaters'
//! certificates, and, when `[signer]` is configured, `POST /v1/certificate`
//! (see [`signer`]): agents obtain their certificates there.
//!
//! The listener speaks TLS with a certificate from the cluster CA (see
//! [`tls`]). The tracker API needs a node's client certificate from the same
//! CA (a preheater's or one without a role is refused), and the peer id of every announce, publication and report is the
//! certificate's: a request naming another peer is refused. `/metrics`,
//! `/healthz` and `/readyz` need none, so that probes and Prometheus reach
//! them. Plain HTTP, where the request's own peer id is believed, exists only
//! behind `insecure_plain_http`.

pub mod metrics;
pub mod preheat;
pub mod signer;
pub mod tls;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dray_protocol::chunkmap::ChunkHash;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::framing::MAX_TRACKER_FRAME;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::preheat::{PREHEAT_PATH, PreheatJob, PreheatRequest};
use dray_protocol::scheduler::{self, MAX_ADDRESS_BYTES, Scheduler, SchedulerConfig};
use dray_protocol::settings::{deprecated_seconds, duration};
use dray_protocol::{Bitfield, BlobDigest, ChunkMap};
use metrics::{AnnounceKind, OPENMETRICS_CONTENT_TYPE, TrackerMetrics};
use prost::Message;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tls::{Caller, TlsListener};

/// HTTP path of the tracker protocol.
pub const TRACKER_PATH: &str = "/v1/tracker";
/// Longest origin (a registry's base URL) an announce may name.
const MAX_ORIGIN_BYTES: usize = 1024;
/// Longest peer id (a DNS name) an announce may carry (its address:
/// [`MAX_ADDRESS_BYTES`]).
const MAX_ID_BYTES: usize = 253;
/// Topology labels per announce, and the longest key or value.
const MAX_LABELS: usize = 16;
const MAX_LABEL_BYTES: usize = 253;
/// What one stored hash slot costs (an `Option<[u8; 32]>`).
const HASH_SLOT_BYTES: u64 = 33;

/// Tracker settings, from TOML; every key optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrackerConfig {
    /// HTTPS listen address. Loopback by default; a Deployment sets `0.0.0.0:7880`.
    pub listen: SocketAddr,
    /// The tracker's certificate (PEM, from `dray ca issue --tracker`).
    pub cert: PathBuf,
    /// Its private key (PKCS#8 PEM).
    pub key: PathBuf,
    /// The cluster CA certificate: agents' client certificates must chain to it.
    pub ca: PathBuf,
    /// Serve plain HTTP, no TLS: anyone who reaches the port may announce,
    /// publish chunk maps and report under any peer id. For a trusted test
    /// network only.
    pub insecure_plain_http: bool,
    /// Connections open at once; past it, new ones wait in the kernel's
    /// backlog. Each idle agent keeps one open per replica.
    pub max_connections: usize,
    /// Agents known at once; an announce from one more is refused.
    pub max_nodes: usize,
    /// Blobs tracked at once.
    pub max_blobs: usize,
    /// Blobs one agent may hold or want at once (and list in one announce).
    pub max_blobs_per_node: usize,
    /// Chunks of one blob (1 TiB in 4 MiB chunks).
    pub max_chunks_per_blob: u32,
    /// Chunks over all tracked blobs.
    pub max_total_chunks: u64,
    /// Bytes of chunk maps held, over all blobs (33 bytes a chunk).
    pub max_chunk_map_bytes: u64,
    /// Chunks with hashes held unconfirmed (published by a node that was
    /// not the chunk's registry fetcher, waiting for a second one to
    /// agree); each holds at most 8 candidate hashes.
    pub max_unconfirmed_hashes: usize,
    /// A first ban's length; each repeat lasts twice the one before.
    #[serde(with = "duration")]
    pub ban: Duration,
    /// Deprecated: `ban` in whole seconds; written, it wins (with a warning).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ban_s: Option<u64>,
    /// Longest gap between an agent's announces. Agents pulling a blob
    /// announce sooner, on progress.
    #[serde(with = "duration", alias = "announce_interval_ms")]
    pub announce_interval: Duration,
    /// Peers handed out per wanted blob.
    pub peers_per_blob: usize,
    /// Chunks per registry-fetch assignment.
    pub stripe_chunks: u32,
    /// Registry-fetch assignments one agent may hold at once, in a crowd.
    pub max_outstanding: usize,
    /// Registry-fetch assignments a blob's swarm of few agents keeps going
    /// at once: each may hold this many divided by the members, rounded up,
    /// when that is more than `max_outstanding` (an agent pulling alone
    /// fetches this many chunks at once).
    pub min_blob_runs: usize,
    /// Live registry-fetch assignments per origin (the registry the agents
    /// pull from), over all its blobs and agents (0: no limit). Per tracker
    /// replica: a sharded tracker's registry sees up to replicas times this.
    pub max_runs_per_origin: usize,
    /// Slowest registry fetch tolerated before an assignment is taken back, bytes/s.
    pub min_fetch_bytes_per_s: u64,
    /// Floor on an assignment's deadline.
    #[serde(with = "duration", alias = "min_fetch_timeout_ms")]
    pub min_fetch_timeout: Duration,
    /// Peer ids of preheater certificates (`dray ca issue --preheater`, or
    /// the signer's) that may start and read preheat jobs; empty: any
    /// preheater's. A node's certificate never may: a job makes nodes pull
    /// an image.
    pub preheaters: Vec<String>,
    /// The certificate signer (`[signer]`, see [`signer::SignerConfig`]);
    /// absent: off, and `POST /v1/certificate` answers 404.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signer: Option<signer::SignerConfig>,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        let s = SchedulerConfig::default();
        Self {
            listen: "127.0.0.1:7880".parse().expect("valid address"),
            cert: "/etc/dray/tls/tracker.crt".into(),
            key: "/etc/dray/tls/tracker.key".into(),
            ca: "/etc/dray/tls/ca.crt".into(),
            insecure_plain_http: false,
            max_connections: 16_384,
            max_nodes: 20_000,
            max_blobs: s.max_blobs,
            max_blobs_per_node: s.max_blobs_per_peer,
            max_chunks_per_blob: s.max_chunks,
            max_total_chunks: s.max_total_chunks,
            max_chunk_map_bytes: 64 << 20,
            max_unconfirmed_hashes: 1 << 16,
            ban: s.ban,
            ban_s: None,
            announce_interval: s.announce_interval,
            peers_per_blob: s.peers_per_blob,
            stripe_chunks: s.stripe_chunks,
            max_outstanding: s.max_outstanding,
            min_blob_runs: s.min_blob_runs,
            max_runs_per_origin: s.max_runs_per_origin,
            min_fetch_bytes_per_s: s.min_fetch_rate,
            min_fetch_timeout: s.min_fetch_timeout,
            preheaters: Vec::new(),
            signer: None,
        }
    }
}

impl TrackerConfig {
    /// Reads a TOML file; unknown keys are errors. A mistake is one line
    /// naming the file, line, column and key.
    pub fn load(path: &Path) -> Result<Self, TrackerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TrackerError::Config(format!("cannot read {}: {e}", path.display())))?;
        let mut cfg: Self = dray_protocol::settings::from_toml(&text)
            .map_err(|e| TrackerError::Config(format!("{}: {e}", path.display())))?;
        let (ban, warning) = deprecated_seconds("ban_s", "ban", cfg.ban_s.take(), cfg.ban);
        cfg.ban = ban;
        if let Some(w) = warning {
            tracing::warn!(file = %path.display(), "{w}");
        }
        Ok(cfg)
    }

    fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            announce_interval: self.announce_interval,
            peers_per_blob: self.peers_per_blob,
            stripe_chunks: self.stripe_chunks,
            max_outstanding: self.max_outstanding,
            min_blob_runs: self.min_blob_runs,
            max_runs_per_origin: self.max_runs_per_origin,
            min_fetch_rate: self.min_fetch_bytes_per_s,
            min_fetch_timeout: self.min_fetch_timeout,
            max_chunks: self.max_chunks_per_blob,
            max_blobs: self.max_blobs,
            max_total_chunks: self.max_total_chunks,
            max_blobs_per_peer: self.max_blobs_per_node,
            max_chunks_per_peer: u64::from(self.max_chunks_per_blob)
                .saturating_mul(4)
                .max(1 << 20),
            ban: self.ban,
            ..SchedulerConfig::default()
        }
    }
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("malformed request: {0}")]
    BadRequest(String),
    #[error(
        "{what} names peer {claimed:?}, but the client certificate is peer {certified:?}: a node speaks only for itself"
    )]
    NotYourId {
        what: &'static str,
        claimed: String,
        certified: String,
    },
    #[error(transparent)]
    Schedule(#[from] scheduler::ScheduleError),
    #[error(transparent)]
    Map(#[from] dray_protocol::VerifyError),
    #[error("{what} is {got}, more than the limit of {limit}")]
    TooLarge { what: String, got: u64, limit: u64 },
    #[error("the tracker knows {limit} agents already; peer {peer:?} is refused until some expire")]
    TooManyNodes { peer: String, limit: usize },
    #[error(
        "chunk map for {digest}: the tracker holds {held} bytes of chunk maps and {more} more would pass its limit of {limit}"
    )]
    TooManyMapBytes {
        digest: BlobDigest,
        held: u64,
        more: u64,
        limit: u64,
    },
    #[error(
        "chunk map for {0}: no agent announced that blob, so the tracker cannot check the map against its swarm (announce it first)"
    )]
    MapForUnknownBlob(BlobDigest),
    #[error(
        "chunk map for {digest} says {got_size} bytes in {got_chunk_size}-byte chunks ({got_count} chunks), but the blob's swarm has {size} bytes in {chunk_size}-byte chunks ({count} chunks)"
    )]
    MapDisagrees {
        digest: BlobDigest,
        got_size: u64,
        got_chunk_size: u32,
        got_count: u32,
        size: u64,
        chunk_size: u32,
        count: u32,
    },
}

impl TrackerError {
    /// The `reason` label of the refusal metric: a few fixed values.
    fn reason(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::BadRequest(_) | Self::Map(_) => "malformed",
            Self::NotYourId { .. } => "not_your_id",
            Self::TooLarge { .. }
            | Self::TooManyNodes { .. }
            | Self::TooManyMapBytes { .. }
            | Self::Schedule(
                scheduler::ScheduleError::TooManyBlobs { .. }
                | scheduler::ScheduleError::TooManyBlobsForPeer { .. }
                | scheduler::ScheduleError::ChunkCountOutOfRange { .. },
            ) => "limit",
            Self::MapForUnknownBlob(_) | Self::MapDisagrees { .. } => "map_disagrees",
            Self::Schedule(
                scheduler::ScheduleError::NotNamed { .. }
                | scheduler::ScheduleError::ReporterBanned(_)
                | scheduler::ScheduleError::NotAHolder { .. }
                | scheduler::ScheduleError::SelfReport(_),
            ) => "report_refused",
            // A node naming more peers than an honest node meets: many
            // liars about, or a lying reporter (the alert's question).
            Self::Schedule(
                scheduler::ScheduleError::SilenceReportLimit { .. }
                | scheduler::ScheduleError::BadChunkReportLimit { .. },
            ) => "report_limit",
            Self::Schedule(_) => "inconsistent",
        }
    }
}

fn too_large(what: impl Into<String>, got: usize, limit: usize) -> TrackerError {
    TrackerError::TooLarge {
        what: what.into(),
        got: got as u64,
        limit: limit as u64,
    }
}

/// The tracker's soft state.
pub struct Tracker {
    state: Mutex<TrackerState>,
    metrics: TrackerMetrics,
    /// Tracker requests decoded and handled at once, off the async workers
    /// (which stay free for probes); bounds the memory of requests in hand.
    api_slots: tokio::sync::Semaphore,
    /// Who may use the preheat API (`preheaters`).
    preheaters: Vec<String>,
    /// The certificate signer, if configured.
    signer: Option<signer::Signer>,
}

/// Tracker requests handled at once: about the cores a replica gets (the
/// state's lock serialises most of the work anyway).
const API_SLOTS: usize = 2;

/// Candidate hashes kept per chunk while none is confirmed: past it the
/// oldest goes, so a few forgers can neither crowd out honest fetchers nor
/// grow the table.
const MAX_CANDIDATES: usize = 8;

struct TrackerState {
    scheduler: Scheduler,
    /// Chunk maps as published so far, per blob; may be partial. Shared
    /// with answers being encoded, so that the lock is not held for that.
    maps: HashMap<BlobDigest, Arc<ChunkMap>>,
    /// Bytes the maps hold (`HASH_SLOT_BYTES` a chunk).
    map_bytes: u64,
    /// Hashes published by nodes that were not the chunk's registry
    /// fetcher, with their publishers, oldest first: one is taken once a
    /// second node agrees. Several are kept (at most `MAX_CANDIDATES`), so
    /// that a forger's hash, published first, cannot keep two honest
    /// fetchers from agreeing.
    unconfirmed: HashMap<(BlobDigest, u32), Vec<(ChunkHash, String)>>,
    limits: Limits,
    /// The preheat jobs this replica coordinates.
    preheats: preheat::Jobs,
}

/// The limits the tracker checks itself (the scheduler checks the rest).
#[derive(Clone, Copy)]
struct Limits {
    max_nodes: usize,
    max_blobs_per_node: usize,
    max_chunks_per_blob: u32,
    max_chunk_map_bytes: u64,
    max_unconfirmed_hashes: usize,
}

/// The peer a request speaks for: the certificate's, which a non-empty
/// field of the request must repeat.
fn speaker(
    what: &'static str,
    claimed: String,
    certified: Option<&str>,
) -> Result<String, TrackerError> {
    match certified {
        None => Ok(claimed),
        Some(c) if claimed.is_empty() || claimed == c => Ok(c.to_owned()),
        Some(c) => Err(TrackerError::NotYourId {
            what,
            claimed,
            certified: c.to_owned(),
        }),
    }
}

/// A report's offender, within the length of a peer id.
fn offender_id(id: String) -> Result<String, TrackerError> {
    if id.len() > MAX_ID_BYTES {
        return Err(too_large("the offender's peer id", id.len(), MAX_ID_BYTES));
    }
    Ok(id)
}

fn digest(s: &str) -> Result<BlobDigest, TrackerError> {
    s.parse()
        .map_err(|e: dray_protocol::DigestError| TrackerError::BadRequest(e.to_string()))
}

impl Tracker {
    /// A tracker without a signer.
    pub fn new(config: &TrackerConfig) -> Arc<Self> {
        Self::with_signer(config, None)
    }

    /// A tracker serving `signer` at `POST /v1/certificate` (see
    /// [`signer::Signer::new`]).
    pub fn with_signer(config: &TrackerConfig, signer: Option<signer::Signer>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(TrackerState {
                scheduler: Scheduler::new(config.scheduler()),
                maps: HashMap::new(),
                map_bytes: 0,
                unconfirmed: HashMap::new(),
                limits: Limits {
                    max_nodes: config.max_nodes,
                    max_blobs_per_node: config.max_blobs_per_node,
                    max_chunks_per_blob: config.max_chunks_per_blob,
                    max_chunk_map_bytes: config.max_chunk_map_bytes,
                    max_unconfirmed_hashes: config.max_unconfirmed_hashes,
                },
                preheats: preheat::Jobs::default(),
            }),
            metrics: TrackerMetrics::new(),
            api_slots: tokio::sync::Semaphore::new(API_SLOTS),
            preheaters: config.preheaters.clone(),
            signer,
        })
    }

    pub fn metrics(&self) -> &TrackerMetrics {
        &self.metrics
    }

    /// The metrics exposition, gauges read from the state now.
    pub fn encode_metrics(&self) -> String {
        {
            let st = self.lock();
            let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            self.metrics.nodes.set(gauge(st.scheduler.peer_count()));
            self.metrics.blobs.set(gauge(st.scheduler.blob_count()));
            self.metrics.chunk_maps.set(gauge(st.maps.len()));
            self.metrics
                .preheat_jobs
                .set(gauge(st.preheats.job_count()));
            self.metrics
                .preheat_nodes_pending
                .set(gauge(st.preheats.pending_nodes()));
            self.metrics
                .chunk_map_bytes
                .set(i64::try_from(st.map_bytes).unwrap_or(i64::MAX));
        }
        self.metrics.encode()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TrackerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Handles one request from `certified` (the peer id of the caller's
    /// certificate; `None` only on the insecure plain-HTTP listener, where the
    /// request's own peer id is believed); an announce gets an answer.
    pub fn handle(
        &self,
        req: pb::TrackerRequest,
        certified: Option<&str>,
        now: Instant,
    ) -> Result<Option<pb::AnnounceResponse>, TrackerError> {
        let handled = self.handle_counted(req, certified, now);
        if let Err(e) = &handled {
            self.metrics.refused(e.reason());
        }
        handled
    }

    fn handle_counted(
        &self,
        req: pb::TrackerRequest,
        certified: Option<&str>,
        now: Instant,
    ) -> Result<Option<pb::AnnounceResponse>, TrackerError> {
        let limits = self.lock().limits;
        match req.body {
            Some(Body::Announce(mut a)) => {
                a.peer_id = speaker("an announce", a.peer_id, certified)?;
                let started = Instant::now();
                let kind = if a.full {
                    AnnounceKind::Full
                } else {
                    AnnounceKind::Delta
                };
                let preheats = std::mem::take(&mut a.preheats);
                preheat::check_reports(&preheats).map_err(TrackerError::BadRequest)?;
                let peer = a.peer_id.clone();
                // Checked and converted before the lock: the bitfields are
                // allocated here, each within the chunk limit.
                let (announce, wanted) = checked_announce(a, &limits)?;
                let (resp, maps, new_runs) = {
                    let mut st = self.lock();
                    let runs_before = st.scheduler.runs_assigned();
                    let (mut resp, maps) = st.announce(announce, &wanted, now)?;
                    st.preheats.note(&peer, &preheats);
                    resp.preheat = st.preheats.tasks_for(&peer);
                    (resp, maps, st.scheduler.runs_assigned() - runs_before)
                };
                let mut resp = resp;
                resp.chunk_maps = maps.iter().map(|m| m.to_pb()).collect();
                self.metrics.announced(kind, started.elapsed(), new_runs);
                Ok(Some(resp))
            }
            Some(Body::Publish(p)) => {
                let publisher = speaker("a chunk map publication", p.peer_id, certified)?;
                let m = p.map.ok_or_else(|| {
                    TrackerError::BadRequest("publication without a chunk map".into())
                })?;
                let d = digest(&m.digest)?;
                let count = dray_protocol::chunkmap::chunk_count(d, m.size, m.chunk_size)?;
                // The swarm's geometry, before the map is built.
                self.lock().check_map(d, m.size, m.chunk_size, count)?;
                let map = ChunkMap::from_pb(&m)?;
                let taken = self.lock().publish(&publisher, &map, now)?;
                tracing::debug!(%publisher, digest = %d, taken, "chunk hashes published");
                Ok(None)
            }
            Some(Body::BadChunk(r)) => {
                let report = scheduler::BadChunk {
                    reporter: speaker("a bad-chunk report", r.reporter, certified)?,
                    offender: offender_id(r.offender)?,
                    digest: digest(&r.digest)?,
                    index: r.index,
                    confirmed: false,
                };
                let mut st = self.lock();
                let was_banned = st.scheduler.standing(&report.offender).banned;
                let standing = st.scheduler.report_bad_chunk(&report, now)?;
                drop(st);
                let banned_now = standing.banned && !was_banned;
                self.metrics.bad_chunk_reported(banned_now);
                // A warning for what changes the swarm: one node's word, which
                // any certificate holder can repeat many times a second, is
                // counted (`dray_tracker_bad_chunk_reports_total`) and logged
                // at info.
                if banned_now {
                    tracing::warn!(offender = %report.offender, reporter = %report.reporter, digest = %report.digest,
                        index = report.index, "bad chunk reported; the offender is banned");
                } else {
                    tracing::info!(offender = %report.offender, reporter = %report.reporter, digest = %report.digest,
                        index = report.index, banned = standing.banned, "bad chunk reported");
                }
                Ok(None)
            }
            Some(Body::SilentPeer(r)) => {
                let report = scheduler::Silent {
                    reporter: speaker("a silent-peer report", r.reporter, certified)?,
                    offender: offender_id(r.offender)?,
                    digest: digest(&r.digest)?,
                    index: r.index,
                };
                let (doubt, reporters) = {
                    let mut st = self.lock();
                    let doubt = st.scheduler.report_silent(&report, now)?;
                    let standing = st.scheduler.standing(&report.offender);
                    (doubt, standing.silent_reporters)
                };
                let owed = doubt.owed;
                self.metrics.silent_peer_reported(owed);
                // A pull repeats its report while it runs (every 30 s): said
                // once at info, the repeats only at debug.
                if doubt.repeat {
                    tracing::debug!(offender = %report.offender, reporter = %report.reporter, digest = %report.digest,
                        index = report.index, owed, reporters, "silent peer reported again");
                } else {
                    tracing::info!(offender = %report.offender, reporter = %report.reporter, digest = %report.digest,
                        index = report.index, owed, reporters,
                        "silent peer reported; the chunks only it holds go out as registry runs");
                }
                Ok(None)
            }
            Some(Body::DigestFailed(f)) => {
                let reporter = speaker("a digest-failure report", f.reporter, certified)?;
                let d = digest(&f.digest)?;
                let mut st = self.lock();
                let rechecking = st.scheduler.blob_failed(&reporter, &d, now)?;
                drop(st);
                if rechecking {
                    self.metrics.digest_failed();
                    tracing::warn!(digest = %d, %reporter, "blob failed its digest at several nodes; rechecking its chunks against the registry");
                } else {
                    tracing::info!(digest = %d, %reporter, "a node reports that a blob failed its digest; nothing is rechecked until another node says so");
                }
                Ok(None)
            }
            Some(Body::Leave(l)) => {
                let peer = speaker("a leave", l.peer_id, certified)?;
                let known = self.lock().scheduler.leave(&peer);
                self.metrics.left(known);
                tracing::info!(%peer, known, "agent left");
                Ok(None)
            }
            None => Err(TrackerError::BadRequest("empty tracker request".into())),
        }
    }

    /// Starts a preheat job (see [`preheat`]).
    pub fn start_preheat(
        &self,
        req: &PreheatRequest,
        now: Instant,
    ) -> Result<PreheatJob, preheat::PreheatError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let members: Vec<_> = st.scheduler.members().collect();
        st.preheats.start(req, &members, now)
    }

    /// A preheat job's progress, if this replica has it.
    pub fn preheat(&self, id: &str, now: Instant) -> Option<PreheatJob> {
        self.lock().preheats.view(id, now)
    }

    /// Whether `caller` may use the preheat API: a preheater's certificate
    /// (whose peer id `preheaters` lists, when it lists any), or anyone on
    /// the insecure plain-HTTP listener.
    fn may_preheat(&self, caller: &Caller) -> Result<(), (StatusCode, String)> {
        match caller {
            Caller::InsecurePlainHttp => Ok(()),
            Caller::Preheater(id) if self.preheaters.is_empty() || self.preheaters.contains(id) => {
                Ok(())
            }
            Caller::Preheater(id) => Err((
                StatusCode::FORBIDDEN,
                format!(
                    "preheater {id:?} may not use the preheat API: the tracker's `preheaters` does not list it\n"
                ),
            )),
            Caller::Node(id) => Err((
                StatusCode::FORBIDDEN,
                format!(
                    "{id:?} presented a node's certificate, and the preheat API accepts only a preheater's (`dray ca issue --preheater`, or the signer's preheater service accounts)\n"
                ),
            )),
            Caller::Anonymous(why) => Err((StatusCode::UNAUTHORIZED, format!("{why}\n"))),
        }
    }

    /// Agents known now.
    pub fn peer_count(&self) -> usize {
        self.lock().scheduler.peer_count()
    }

    /// Agents known to hold chunk `index` of `digest`.
    pub fn holders(&self, digest: &BlobDigest, index: u32) -> u32 {
        self.lock().scheduler.holders(digest, index)
    }

    /// How far the tracker trusts `peer` now (reports against it, bans).
    pub fn standing(&self, peer: &str) -> scheduler::Standing {
        self.lock().scheduler.standing(peer)
    }

    /// The chunk map (possibly partial) this replica hands out for `digest`.
    pub fn map(&self, digest: &BlobDigest) -> Option<ChunkMap> {
        self.lock().maps.get(digest).map(|m| ChunkMap::clone(m))
    }

    /// Expires silent agents, takes back stalled assignments, ends bans and
    /// drops the maps of blobs no agent holds or wants any more.
    pub fn tick(&self, now: Instant) {
        let report = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let report = st.scheduler.tick(now);
            st.forget_untracked();
            st.preheats.forget_gone(|p| st.scheduler.knows(p));
            report
        };
        for peer in &report.unbanned {
            tracing::info!(%peer, "ban ended");
        }
        self.metrics
            .ticked(report.reclaimed.len(), report.expired.len());
        for (peer, a) in &report.reclaimed {
            tracing::info!(%peer, digest = %a.digest, first = a.first, count = a.count, "assignment taken back");
        }
        for peer in &report.expired {
            tracing::info!(%peer, "agent expired");
        }
    }
}

/// Checks an announce against the limits and converts it, allocating each
/// bitfield only once its chunk count is known to be within them. Returns
/// the scheduler's announce and the blobs wanted.
fn checked_announce(
    a: pb::Announce,
    limits: &Limits,
) -> Result<(scheduler::Announce, Vec<BlobDigest>), TrackerError> {
    if a.peer_id.len() > MAX_ID_BYTES {
        return Err(too_large("the peer id", a.peer_id.len(), MAX_ID_BYTES));
    }
    if a.address.len() > MAX_ADDRESS_BYTES {
        return Err(too_large(
            "the peer address",
            a.address.len(),
            MAX_ADDRESS_BYTES,
        ));
    }
    if a.labels.len() > MAX_LABELS {
        return Err(too_large(
            "the number of labels",
            a.labels.len(),
            MAX_LABELS,
        ));
    }
    if let Some((k, v)) = a
        .labels
        .iter()
        .find(|(k, v)| k.len() > MAX_LABEL_BYTES || v.len() > MAX_LABEL_BYTES)
    {
        let what = format!("label {:?}", k.chars().take(40).collect::<String>());
        return Err(too_large(what, k.len().max(v.len()), MAX_LABEL_BYTES));
    }
    if a.blobs.len() > limits.max_blobs_per_node {
        return Err(too_large(
            "the number of blobs in one announce",
            a.blobs.len(),
            limits.max_blobs_per_node,
        ));
    }
    let mut blobs = Vec::with_capacity(a.blobs.len());
    let mut wanted = Vec::new();
    for b in a.blobs {
        let d = digest(&b.digest)?;
        let count = dray_protocol::chunkmap::chunk_count(d, b.size, b.chunk_size)?;
        if count > limits.max_chunks_per_blob {
            return Err(TrackerError::TooLarge {
                what: format!(
                    "{d}: the chunk count ({} bytes in {}-byte chunks)",
                    b.size, b.chunk_size
                ),
                got: count.into(),
                limit: limits.max_chunks_per_blob.into(),
            });
        }
        if b.added.len() > count as usize {
            return Err(too_large(
                format!("{d}: the number of chunks added"),
                b.added.len(),
                count as usize,
            ));
        }
        if b.origin.len() > MAX_ORIGIN_BYTES {
            return Err(TrackerError::BadRequest(format!(
                "{d}: origin is {} bytes, more than {MAX_ORIGIN_BYTES}",
                b.origin.len()
            )));
        }
        let held = if a.full || !b.bits.is_empty() {
            let bits = Bitfield::from_bytes(count, &b.bits)
                .map_err(|e| TrackerError::BadRequest(format!("{d}: {e}")))?;
            scheduler::Held::Bits(bits)
        } else {
            scheduler::Held::Added(b.added)
        };
        if b.wanted {
            wanted.push(d);
        }
        blobs.push(scheduler::BlobAnnounce {
            digest: d,
            chunk_count: count,
            size: b.size,
            chunk_size: b.chunk_size,
            held,
            wanted: b.wanted,
            origin: b.origin,
            ranges_ignored: b.ranges_ignored,
        });
    }
    let announce = scheduler::Announce {
        peer: a.peer_id,
        address: a.address,
        upload_bytes_per_s: a.upload_bytes_per_s,
        active_uploads: a.active_uploads,
        labels: a.labels.into_iter().collect(),
        blobs,
        full: a.full,
    };
    Ok((announce, wanted))
}

impl TrackerState {
    /// Answers an announce; the maps of wanted blobs are returned apart, to
    /// be encoded after the lock is released.
    fn announce(
        &mut self,
        a: scheduler::Announce,
        wanted: &[BlobDigest],
        now: Instant,
    ) -> Result<(pb::AnnounceResponse, Vec<Arc<ChunkMap>>), TrackerError> {
        if !self.scheduler.knows(&a.peer) && self.scheduler.peer_count() >= self.limits.max_nodes {
            return Err(TrackerError::TooManyNodes {
                peer: a.peer,
                limit: self.limits.max_nodes,
            });
        }
        let peer = a.peer.clone();
        let decision = self.scheduler.announce(a, now);
        for e in &decision.rejected {
            // Visible at the default level: a refused entry is a node
            // disagreeing with the others about a blob, or a limit reached.
            tracing::info!(%peer, error = %e, "announce entry refused");
        }
        let maps = wanted
            .iter()
            .filter_map(|d| self.maps.get(d).cloned())
            .collect();
        let resp = pb::AnnounceResponse {
            peers: decision
                .peers
                .into_iter()
                .map(|(d, ps)| {
                    let peers = ps
                        .into_iter()
                        .map(|p| pb::PeerInfo {
                            peer_id: p.peer,
                            address: p.address,
                        })
                        .collect();
                    (d.to_string(), pb::PeerList { peers })
                })
                .collect(),
            assignments: decision
                .assignments
                .into_iter()
                .map(|x| pb::Assignment {
                    digest: x.digest.to_string(),
                    first: x.first,
                    count: x.count,
                })
                .collect(),
            interval_ms: decision.interval.as_millis() as u32,
            chunk_maps: Vec::new(),
            resend_full: decision.resend_full,
            fetching: decision.fetching.iter().map(ToString::to_string).collect(),
            holders: decision
                .holders
                .iter()
                .map(|h| pb::BlobHolders {
                    digest: h.digest.to_string(),
                    complete: h.complete,
                    rank: h.rank,
                })
                .collect(),
            preheat: Vec::new(),
        };
        Ok((resp, maps))
    }

    /// A map of `digest` must have the geometry of its swarm.
    fn check_map(
        &self,
        digest: BlobDigest,
        size: u64,
        chunk_size: u32,
        count: u32,
    ) -> Result<(), TrackerError> {
        let g = self
            .scheduler
            .geometry(&digest)
            .ok_or(TrackerError::MapForUnknownBlob(digest))?;
        if (size, count) != (g.size, g.chunk_count)
            || (g.chunk_size != 0 && chunk_size != g.chunk_size)
        {
            return Err(TrackerError::MapDisagrees {
                digest,
                got_size: size,
                got_chunk_size: chunk_size,
                got_count: count,
                size: g.size,
                chunk_size: g.chunk_size,
                count: g.chunk_count,
            });
        }
        Ok(())
    }

    /// Takes the hashes of `map` that `publisher` may vouch for: those of
    /// chunks the tracker assigned it to fetch from the registry, and others
    /// once a second node publishes the same. A chunk's hash differing from
    /// the one taken already replaces it only when the publisher fetched the
    /// chunk again from the registry for a recheck (the blob failed its
    /// digest); otherwise it refuses the whole map. Returns how many hashes
    /// it took.
    fn publish(
        &mut self,
        publisher: &str,
        map: &ChunkMap,
        now: Instant,
    ) -> Result<u32, TrackerError> {
        let d = map.digest();
        self.check_map(d, map.size(), map.chunk_size(), map.chunk_count())?;
        let rechecked = |s: &Self, i: u32| {
            s.scheduler.rechecking(&d, i) && s.scheduler.registry_fetcher(&d, i) == Some(publisher)
        };
        if let Some(known) = self.maps.get(&d) {
            for (i, (new, old)) in map.hashes().iter().zip(known.hashes()).enumerate() {
                if let (Some(new), Some(old)) = (new, old)
                    && new != old
                    && !rechecked(self, i as u32)
                {
                    return Err(dray_protocol::VerifyError::HashConflict {
                        digest: d,
                        index: i as u32,
                    }
                    .into());
                }
            }
        }
        let (mut take, mut replace) = (Vec::new(), Vec::new());
        for (i, h) in map.hashes().iter().enumerate() {
            let (i, Some(h)) = (i as u32, h) else {
                continue;
            };
            let known = self.maps.get(&d).and_then(|m| m.hashes()[i as usize]);
            if rechecked(self, i) {
                match known {
                    Some(old) if old == *h => self.scheduler.hash_settled(&d, i, now),
                    _ => replace.push((i, *h)),
                }
                continue;
            }
            if let Some(known) = known {
                // The same hash again settles the chunk (settling twice
                // changes nothing): a swarm formed again while the blob's
                // map lived on (its last member left and another joined
                // before the next tick dropped the map) starts with no
                // chunk settled, and would hand out registry runs for
                // chunks its members hold, forever.
                if known == *h {
                    self.scheduler.hash_settled(&d, i, now);
                }
                continue;
            }
            if self.scheduler.registry_fetcher(&d, i) == Some(publisher) {
                take.push((i, *h));
                continue;
            }
            let pending = self.unconfirmed.len();
            match self.unconfirmed.get_mut(&(d, i)) {
                Some(seen) if seen.iter().any(|(s, by)| s == h && by != publisher) => {
                    take.push((i, *h));
                }
                // One node twice is one node.
                Some(seen) if seen.iter().any(|(_, by)| by == publisher) => {}
                Some(seen) => {
                    tracing::warn!(digest = %d, index = i, others = ?seen.iter().map(|(_, by)| by).collect::<Vec<_>>(),
                        %publisher, "nodes published different hashes for a chunk; none is handed out until two agree");
                    if seen.len() >= MAX_CANDIDATES {
                        seen.remove(0);
                    }
                    seen.push((*h, publisher.to_owned()));
                }
                None if pending >= self.limits.max_unconfirmed_hashes => {
                    return Err(too_large(
                        "the number of chunks with unconfirmed hashes",
                        pending + 1,
                        self.limits.max_unconfirmed_hashes,
                    ));
                }
                None => {
                    self.unconfirmed
                        .insert((d, i), vec![(*h, publisher.to_owned())]);
                }
            }
        }
        if let Some(stored) = self.maps.get_mut(&d) {
            let stored = Arc::make_mut(stored);
            for &(i, h) in &replace {
                stored.replace_hash(i, h)?;
                self.scheduler.chunk_replaced(&d, i, now);
                tracing::warn!(digest = %d, index = i, %publisher,
                    "a chunk fetched again from the registry differs from its published hash: the hash is replaced, and holders of the old chunk fetch it again");
            }
        }
        if take.is_empty() {
            return Ok(replace.len() as u32);
        }
        if !self.maps.contains_key(&d) {
            let more = u64::from(map.chunk_count()) * HASH_SLOT_BYTES;
            if self.map_bytes + more > self.limits.max_chunk_map_bytes {
                return Err(TrackerError::TooManyMapBytes {
                    digest: d,
                    held: self.map_bytes,
                    more,
                    limit: self.limits.max_chunk_map_bytes,
                });
            }
            let empty = ChunkMap::unhashed(d, map.size(), map.chunk_size())?;
            self.maps.insert(d, Arc::new(empty));
            self.map_bytes += more;
        }
        let stored = Arc::make_mut(self.maps.get_mut(&d).expect("inserted above"));
        for &(i, h) in &take {
            stored.set_hash(i, h)?;
            self.unconfirmed.remove(&(d, i));
            self.scheduler.hash_settled(&d, i, now);
        }
        Ok(take.len() as u32)
    }

    fn forget_map(&mut self, digest: &BlobDigest) {
        if let Some(m) = self.maps.remove(digest) {
            self.map_bytes -= u64::from(m.chunk_count()) * HASH_SLOT_BYTES;
        }
        self.unconfirmed.retain(|(d, _), _| d != digest);
    }

    /// Drops maps and unconfirmed hashes of blobs no longer tracked.
    fn forget_untracked(&mut self) {
        let gone: Vec<BlobDigest> = self
            .maps
            .keys()
            .filter(|d| self.scheduler.geometry(d).is_none())
            .copied()
            .collect();
        for d in gone {
            self.forget_map(&d);
        }
        let scheduler = &self.scheduler;
        self.unconfirmed
            .retain(|(d, _), _| scheduler.geometry(d).is_some());
    }
}

/// How the tracker's listener speaks.
pub enum Transport {
    /// TLS with this configuration (see `Identity::tracker_server_tls`),
    /// at most this many connections at once.
    Tls {
        config: Arc<rustls::ServerConfig>,
        max_connections: usize,
    },
    /// Plain HTTP, no authentication: `insecure_plain_http`.
    InsecurePlainHttp,
}

/// Serves the tracker on `listener` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tracker: Arc<Tracker>,
    transport: Transport,
) -> std::io::Result<()> {
    let ticker = tracker.clone();
    let tick = tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(DEFAULTS.tracker_tick_ms));
        loop {
            every.tick().await;
            ticker.tick(Instant::now());
        }
    });
    let app = Router::new()
        .route(TRACKER_PATH, post(handle_http))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/metrics", get(metrics_http))
        .route(PREHEAT_PATH, post(preheat_start_http))
        .route(&format!("{PREHEAT_PATH}/{{id}}"), get(preheat_http))
        .route(
            signer::CERTIFICATE_PATH,
            post(certificate_http).layer(DefaultBodyLimit::max(signer::MAX_REQUEST_BYTES)),
        )
        .layer(DefaultBodyLimit::max(MAX_TRACKER_FRAME))
        .with_state(tracker)
        .into_make_service_with_connect_info::<Caller>();
    let served = match transport {
        Transport::Tls {
            config,
            max_connections,
        } => axum::serve(TlsListener::new(listener, config, max_connections)?, app).await,
        Transport::InsecurePlainHttp => axum::serve(listener, app).await,
    };
    tick.abort();
    served
}

async fn metrics_http(State(tracker): State<Arc<Tracker>>) -> Response {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        tracker.encode_metrics(),
    )
        .into_response()
}

/// Longest preheat request body.
const MAX_PREHEAT_REQUEST: usize = 16 << 10;

async fn preheat_start_http(
    State(tracker): State<Arc<Tracker>>,
    ConnectInfo(caller): ConnectInfo<Caller>,
    body: Bytes,
) -> Response {
    if let Err(refused) = tracker.may_preheat(&caller) {
        tracker.metrics.refused("preheat_refused");
        return refused.into_response();
    }
    if body.len() > MAX_PREHEAT_REQUEST {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "a preheat request of {} bytes, more than {MAX_PREHEAT_REQUEST}\n",
                body.len()
            ),
        )
            .into_response();
    }
    let req: PreheatRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("body is not a preheat request: {e}\n"),
            )
                .into_response();
        }
    };
    match tracker.start_preheat(&req, Instant::now()) {
        Ok(job) => {
            tracing::info!(?caller, id = %job.id, image = %job.image, nodes = job.nodes.len(), matched = job.matched, "preheat job started");
            (StatusCode::CREATED, axum::Json(job)).into_response()
        }
        Err(e) => {
            let status = match e {
                preheat::PreheatError::Invalid(_) => StatusCode::BAD_REQUEST,
                preheat::PreheatError::NoNodes(_) | preheat::PreheatError::TooMany => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            };
            (status, format!("{e}\n")).into_response()
        }
    }
}

/// `POST /v1/certificate`: a certificate signing request (PEM) and a
/// projected service-account token; see [`signer`].
async fn certificate_http(
    State(tracker): State<Arc<Tracker>>,
    ConnectInfo(caller): ConnectInfo<Caller>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    use signer::SignerError;
    let issued = async {
        let signer = tracker.signer.as_ref().ok_or(SignerError::Off)?;
        if caller == Caller::InsecurePlainHttp {
            return Err(SignerError::Refused(
                "the signer answers over TLS only: a token must not cross the network in clear"
                    .into(),
            ));
        }
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(SignerError::NoToken)?;
        let csr = std::str::from_utf8(&body).map_err(|_| {
            SignerError::Refused("the body is not a PEM certificate signing request".into())
        })?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        signer.issue(token.trim(), csr, now).await
    }
    .await;
    match issued {
        Ok(pem) => ([(header::CONTENT_TYPE, "application/x-pem-file")], pem).into_response(),
        Err(e) => {
            tracker.metrics.refused(e.reason());
            tracing::info!(?caller, error = %e, "refused a certificate request");
            let status =
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, format!("{e}\n")).into_response()
        }
    }
}

async fn preheat_http(
    State(tracker): State<Arc<Tracker>>,
    ConnectInfo(caller): ConnectInfo<Caller>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Err(refused) = tracker.may_preheat(&caller) {
        tracker.metrics.refused("preheat_refused");
        return refused.into_response();
    }
    match tracker.preheat(&id, Instant::now()) {
        Some(job) => axum::Json(job).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!("no preheat job {id:?} on this replica (jobs are soft state: a restarted replica has none)\n"),
        )
            .into_response(),
    }
}

async fn handle_http(
    State(tracker): State<Arc<Tracker>>,
    ConnectInfo(caller): ConnectInfo<Caller>,
    body: Bytes,
) -> Response {
    let certified = match &caller {
        Caller::Node(id) => Some(id.clone()),
        Caller::InsecurePlainHttp => None,
        Caller::Preheater(id) => {
            tracker.metrics.refused("wrong_role");
            return (
                StatusCode::FORBIDDEN,
                format!("{id:?} presented a preheater's certificate, and the tracker API accepts only a node's\n"),
            )
                .into_response();
        }
        Caller::Anonymous(why) => {
            tracker.metrics.refused("unauthenticated");
            return (StatusCode::UNAUTHORIZED, format!("{why}\n")).into_response();
        }
    };
    let Ok(_slot) = tracker.api_slots.acquire().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    // Decoding a 4 MiB body and handling it is CPU work: on a blocking
    // thread, so that /healthz answers meanwhile.
    let worker = tracker.clone();
    let handled = tokio::task::spawn_blocking(move || {
        let req = pb::TrackerRequest::decode(body)
            .map_err(|e| format!("body is not a TrackerRequest: {e}"))?;
        Ok::<_, String>(worker.handle(req, certified.as_deref(), Instant::now()))
    })
    .await;
    let handled = match handled {
        Ok(Ok(h)) => h,
        Ok(Err(malformed)) => return (StatusCode::BAD_REQUEST, malformed).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "a tracker request's handler failed");
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    match handled {
        Ok(Some(resp)) => (
            [(header::CONTENT_TYPE, "application/x-protobuf")],
            resp.encode_to_vec(),
        )
            .into_response(),
        Ok(None) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => {
            tracing::info!(?caller, error = %e, "tracker request refused");
            let status = match e {
                TrackerError::NotYourId { .. } => StatusCode::FORBIDDEN,
                _ => StatusCode::BAD_REQUEST,
            };
            (status, e.to_string()).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announce(
        peer: &str,
        digest: BlobDigest,
        size: u64,
        bits: Option<&Bitfield>,
        full: bool,
    ) -> pb::TrackerRequest {
        pb::TrackerRequest {
            body: Some(Body::Announce(pb::Announce {
                peer_id: peer.into(),
                address: format!("127.0.0.1:{}", 7000 + peer.len()),
                full,
                blobs: vec![pb::BlobHolding {
                    digest: digest.to_string(),
                    size,
                    chunk_size: 1 << 22,
                    bits: bits
                        .map(|b| b.as_bytes().to_vec().into())
                        .unwrap_or_default(),
                    wanted: true,
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn stripes_registry_fetches_and_hands_out_published_maps() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 64u64 << 22;
        let now = Instant::now();
        let mut covered = Bitfield::new(64);
        for p in ["a", "bb", "ccc", "dddd"] {
            let resp = t
                .handle(
                    announce(p, d, size, Some(&Bitfield::new(64)), true),
                    None,
                    now,
                )
                .unwrap()
                .unwrap();
            for a in &resp.assignments {
                for i in a.first..a.first + a.count {
                    assert!(covered.set(i), "chunk {i} assigned twice");
                }
            }
        }
        // "a" holds the run of chunk 0: its hash is taken from "a".
        let mut map = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
        map.set_hash(0, [7; 32]).unwrap();
        let publish = pb::TrackerRequest {
            body: Some(Body::Publish(pb::PublishChunkMap {
                peer_id: "a".into(),
                map: Some(map.to_pb()),
            })),
        };
        assert!(t.handle(publish, None, now).unwrap().is_none());
        let resp = t
            .handle(announce("a", d, size, None, false), None, now)
            .unwrap()
            .unwrap();
        let got = ChunkMap::from_pb(&resp.chunk_maps[0]).unwrap();
        assert_eq!(got.hashes()[0], Some([7; 32]));
    }

    #[test]
    fn a_swarm_formed_again_while_its_map_lives_settles_the_chunks_its_members_republish() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let (size, now) = (1u64 << 22, Instant::now());
        let none = Bitfield::new(1);
        let mut all = Bitfield::new(1);
        all.set(0);
        let mut map = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
        map.set_hash(0, [7; 32]).unwrap();
        // a fetches the chunk from the registry, publishes its hash and
        // leaves: the swarm goes, its map stays until the next tick.
        let resp = t
            .handle(announce("a", d, size, Some(&none), true), Some("a"), now)
            .unwrap()
            .unwrap();
        assert_eq!(resp.assignments.len(), 1);
        t.handle(publish("a", &map), Some("a"), now).unwrap();
        let leave = pb::TrackerRequest {
            body: Some(Body::Leave(pb::Leave {
                peer_id: "a".into(),
            })),
        };
        t.handle(leave, Some("a"), now).unwrap();
        // b, holding the blob, forms the swarm again and republishes its map.
        t.handle(announce("b", d, size, Some(&all), true), Some("b"), now)
            .unwrap();
        t.handle(publish("b", &map), Some("b"), now).unwrap();
        // c wants the blob: b serves the chunk, nobody fetches it again.
        let resp = t
            .handle(announce("c", d, size, Some(&none), true), Some("c"), now)
            .unwrap()
            .unwrap();
        assert!(resp.assignments.is_empty(), "{:?}", resp.assignments);
    }

    #[test]
    fn a_restarted_tracker_asks_for_full_announces() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let resp = t
            .handle(announce("a", d, 1 << 22, None, false), None, Instant::now())
            .unwrap()
            .unwrap();
        assert!(resp.resend_full);
    }

    fn digest_failed(reporter: &str, d: BlobDigest) -> pb::TrackerRequest {
        pb::TrackerRequest {
            body: Some(Body::DigestFailed(pb::BlobDigestFailed {
                reporter: reporter.into(),
                digest: d.to_string(),
            })),
        }
    }

    #[test]
    fn after_a_digest_failure_a_hash_is_replaced_only_by_the_chunks_new_registry_fetcher() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let (size, now) = (1u64 << 22, Instant::now());
        let mut all = Bitfield::new(1);
        all.set(0);
        let none = Bitfield::new(1);
        let hashed = |h: u8| {
            let mut m = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
            m.set_hash(0, [h; 32]).unwrap();
            m
        };
        // a fetched the chunk from the registry and published a wrong hash.
        t.handle(announce("a", d, size, Some(&none), true), Some("a"), now)
            .unwrap();
        t.handle(publish("a", &hashed(6)), Some("a"), now).unwrap();
        assert_eq!(t.map(&d).unwrap().hashes()[0], Some([6; 32]));
        for p in ["a", "b", "c"] {
            t.handle(announce(p, d, size, Some(&all), true), Some(p), now)
                .unwrap();
        }
        let rechecking = || t.lock().scheduler.rechecking(&d, 0);
        // One node's word is not enough; a second's is.
        t.handle(digest_failed("b", d), Some("b"), now).unwrap();
        assert!(!rechecking());
        t.handle(digest_failed("c", d), Some("c"), now).unwrap();
        assert!(rechecking());
        assert_eq!(t.map(&d).unwrap().hashes()[0], Some([6; 32]), "kept");
        let fetcher = t
            .handle(announce("b", d, size, Some(&all), true), Some("b"), now)
            .unwrap()
            .unwrap();
        assert_eq!(fetcher.assignments.len(), 1, "b fetches the chunk again");
        // c, not its fetcher, cannot replace the hash.
        let refused = refusal(&t, publish("c", &hashed(7)), "c");
        assert!(refused.contains("two different hashes"), "{refused}");
        assert!(rechecking());
        // The new registry fetcher is believed.
        t.handle(publish("b", &hashed(7)), Some("b"), now).unwrap();
        assert_eq!(t.map(&d).unwrap().hashes()[0], Some([7; 32]));
        assert!(!rechecking());
        // The old hash is no longer taken from anybody.
        let refused = refusal(&t, publish("a", &hashed(6)), "a");
        assert!(refused.contains("two different hashes"), "{refused}");
    }

    #[test]
    fn metrics_count_announces_runs_and_reports_and_members_word_bans_nobody() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 64u64 << 22;
        let now = Instant::now();
        for p in ["a", "bb", "ccc", "dddd"] {
            t.handle(
                announce(p, d, size, Some(&Bitfield::new(64)), true),
                None,
                now,
            )
            .unwrap();
        }
        for p in ["a", "bb", "ccc"] {
            // Each hears of "dddd" before it reports it.
            t.handle(announce(p, d, size, None, false), None, now)
                .unwrap();
        }
        for reporter in ["a", "bb", "ccc"] {
            let report = pb::TrackerRequest {
                body: Some(Body::BadChunk(pb::BadChunkReport {
                    reporter: reporter.into(),
                    offender: "dddd".into(),
                    digest: d.to_string(),
                    index: 0,
                })),
            };
            t.handle(report, None, now).unwrap();
        }
        assert!(
            t.handle(pb::TrackerRequest { body: None }, None, now)
                .is_err()
        );
        let text = t.encode_metrics();
        // Each of the 4 nodes holds as many runs as it may.
        let runs = format!(
            "dray_tracker_registry_runs_assigned_total {}",
            4 * TrackerConfig::default().max_outstanding
        );
        for line in [
            "dray_tracker_announces_total{kind=\"full\"} 4",
            "dray_tracker_announces_total{kind=\"delta\"} 3",
            "dray_tracker_announce_duration_seconds_count 7",
            &runs,
            "dray_tracker_bad_chunk_reports_total 3",
            "dray_tracker_bans_total 0",
            "dray_tracker_rejected_requests_total 1",
            "dray_tracker_refusals_total{reason=\"malformed\"} 1",
            "dray_tracker_nodes 4",
            "dray_tracker_blobs 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    /// A node reporting more peers' chunks corrupt than an honest node meets
    /// (16 in an hour) is not heard past them, and not banned (17 liars
    /// each sending it a bad chunk must not ban an honest node): the
    /// refusal is counted for the operator's alert.
    #[test]
    fn a_reporter_accusing_many_peers_is_not_heard_past_its_limit_nor_banned() {
        let t = Tracker::new(&TrackerConfig {
            peers_per_blob: 32,
            ..TrackerConfig::default()
        });
        let d = BlobDigest::of(b"blob");
        let size = 64u64 << 22;
        let now = Instant::now();
        let others: Vec<String> = (0..17).map(|i| format!("peer-{i}")).collect();
        for p in others.iter().map(String::as_str).chain(["accuser"]) {
            t.handle(
                announce(p, d, size, Some(&Bitfield::new(64)), true),
                None,
                now,
            )
            .unwrap();
        }
        t.handle(announce("accuser", d, size, None, false), None, now)
            .unwrap();
        let report = |offender: &str| pb::TrackerRequest {
            body: Some(Body::BadChunk(pb::BadChunkReport {
                reporter: "accuser".into(),
                offender: offender.into(),
                digest: d.to_string(),
                index: 0,
            })),
        };
        for o in &others[..16] {
            t.handle(report(o), None, now).unwrap();
        }
        let err = t.handle(report(&others[16]), None, now).unwrap_err();
        assert!(err.to_string().contains("reported 16 peers"), "{err}");
        // Heard again on the peers it reported before, and not banned.
        t.handle(report(&others[0]), None, now).unwrap();
        let text = t.encode_metrics();
        for line in [
            "dray_tracker_bad_chunk_reports_total 17",
            "dray_tracker_bans_total 0",
            "dray_tracker_refusals_total{reason=\"report_limit\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn a_leaving_agent_is_forgotten_at_once_and_no_longer_handed_out() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 4u64 << 22;
        let now = Instant::now();
        let mut all = Bitfield::new(4);
        (0..4).for_each(|i| _ = all.set(i));
        t.handle(announce("a", d, size, Some(&all), true), Some("a"), now)
            .unwrap();
        let peers_of = |resp: pb::AnnounceResponse| -> Vec<String> {
            resp.peers[&d.to_string()]
                .peers
                .iter()
                .map(|p| p.peer_id.clone())
                .collect()
        };
        let resp = t
            .handle(
                announce("bb", d, size, Some(&Bitfield::new(4)), true),
                Some("bb"),
                now,
            )
            .unwrap()
            .unwrap();
        assert_eq!(peers_of(resp), ["a"]);
        let leave = |peer: &str| pb::TrackerRequest {
            body: Some(Body::Leave(pb::Leave {
                peer_id: peer.into(),
            })),
        };
        // A node cannot make another one leave.
        let err = t
            .handle(leave("a"), Some("bb"), now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"a\"") && err.contains("bb"), "{err}");
        assert_eq!(t.peer_count(), 2);
        assert!(t.handle(leave("a"), Some("a"), now).unwrap().is_none());
        // Unknown: nothing to forget, nothing counted.
        assert!(t.handle(leave("zz"), Some("zz"), now).unwrap().is_none());
        assert_eq!(t.peer_count(), 1);
        assert_eq!(t.holders(&d, 0), 0);
        let resp = t
            .handle(announce("bb", d, size, None, false), Some("bb"), now)
            .unwrap()
            .unwrap();
        assert!(
            !resp.assignments.is_empty(),
            "a's chunks come from the registry now"
        );
        assert!(
            resp.peers
                .get(&d.to_string())
                .is_none_or(|l| l.peers.is_empty())
        );
        let text = t.encode_metrics();
        for line in ["dray_tracker_left_nodes_total 1", "dray_tracker_nodes 1"] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn malformed_requests_are_refused_with_the_reason() {
        let t = Tracker::new(&TrackerConfig::default());
        let bad = pb::TrackerRequest {
            body: Some(Body::Announce(pb::Announce {
                peer_id: "a".into(),
                blobs: vec![pb::BlobHolding {
                    digest: "sha256:zz".into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
        };
        let err = t.handle(bad, None, Instant::now()).unwrap_err().to_string();
        assert!(err.contains("64 lowercase hex"), "{err}");
        let err = t
            .handle(pb::TrackerRequest { body: None }, None, Instant::now())
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty tracker request"), "{err}");
        let mut long = announce(
            "a",
            BlobDigest::of(b"blob"),
            1 << 22,
            Some(&Bitfield::new(1)),
            true,
        );
        if let Some(Body::Announce(a)) = &mut long.body {
            a.blobs[0].origin = "x".repeat(MAX_ORIGIN_BYTES + 1);
        }
        let err = t
            .handle(long, None, Instant::now())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("origin is 1025 bytes, more than 1024"),
            "{err}"
        );
    }

    fn publish(peer: &str, map: &ChunkMap) -> pb::TrackerRequest {
        pb::TrackerRequest {
            body: Some(Body::Publish(pb::PublishChunkMap {
                peer_id: peer.into(),
                map: Some(map.to_pb()),
            })),
        }
    }

    fn refusal(t: &Tracker, req: pb::TrackerRequest, as_peer: &str) -> String {
        t.handle(req, Some(as_peer), Instant::now())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_map_disagreeing_with_the_swarm_is_refused_and_never_handed_out() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 32u64 << 20;
        t.handle(
            announce("a", d, size, Some(&Bitfield::new(8)), true),
            Some("a"),
            Instant::now(),
        )
        .unwrap();
        // The forged map of issue 16: the real digest, 4 MiB larger, no hashes.
        let forged = ChunkMap::unhashed(d, size + (4 << 20), 1 << 22).unwrap();
        assert_eq!(
            refusal(&t, publish("a", &forged), "a"),
            format!(
                "chunk map for {d} says 37748736 bytes in 4194304-byte chunks (9 chunks), but the blob's swarm has 33554432 bytes in 4194304-byte chunks (8 chunks)"
            )
        );
        let other_chunks = ChunkMap::unhashed(d, size, 8 << 20).unwrap();
        assert!(
            refusal(&t, publish("a", &other_chunks), "a")
                .contains("in 8388608-byte chunks (4 chunks), but the blob's swarm has")
        );
        let unknown = ChunkMap::unhashed(BlobDigest::of(b"other"), size, 1 << 22).unwrap();
        assert!(refusal(&t, publish("a", &unknown), "a").contains(
            "no agent announced that blob, so the tracker cannot check the map against its swarm"
        ));
        assert!(t.map(&d).is_none());
        assert!(
            t.encode_metrics()
                .contains("dray_tracker_refusals_total{reason=\"map_disagrees\"} 3")
        );
    }

    #[test]
    fn a_huge_blob_is_refused_by_its_chunk_count_before_anything_is_allocated() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let mut req = announce("a", d, dray_protocol::chunkmap::MAX_BLOB_SIZE, None, true);
        if let Some(Body::Announce(a)) = &mut req.body {
            a.blobs[0].chunk_size = 64 << 10;
        }
        assert_eq!(
            refusal(&t, req, "a"),
            format!(
                "{d}: the chunk count (1099511627776 bytes in 65536-byte chunks) is 16777216, more than the limit of 262144"
            )
        );
        assert_eq!(t.peer_count(), 0);
    }

    #[test]
    fn hashes_are_taken_from_the_chunks_registry_fetcher_or_from_two_nodes_agreeing() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 64u64 << 22;
        let now = Instant::now();
        // One run of one chunk each: a has chunk 0, b chunk 1, c chunk 2.
        for p in ["a", "b", "c", "d"] {
            t.handle(
                announce(p, d, size, Some(&Bitfield::new(64)), true),
                Some(p),
                now,
            )
            .unwrap();
        }
        let one = |i: u32, h: u8| {
            let mut m = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
            m.set_hash(i, [h; 32]).unwrap();
            m
        };
        let handed = |t: &Tracker| t.map(&d).map(|m| m.hashes()[..3].to_vec());
        // A node that did not fetch chunk 0 cannot vouch for it alone.
        t.handle(publish("b", &one(0, 9)), Some("b"), now).unwrap();
        assert_eq!(handed(&t), None);
        t.handle(publish("a", &one(0, 7)), Some("a"), now).unwrap();
        assert_eq!(handed(&t), Some(vec![Some([7; 32]), None, None]));
        // Two nodes other than its fetcher agreeing on chunk 2's hash.
        t.handle(publish("a", &one(2, 5)), Some("a"), now).unwrap();
        t.handle(publish("a", &one(2, 5)), Some("a"), now).unwrap();
        assert_eq!(
            handed(&t),
            Some(vec![Some([7; 32]), None, None]),
            "one node twice is one node"
        );
        t.handle(publish("d", &one(2, 5)), Some("d"), now).unwrap();
        assert_eq!(handed(&t), Some(vec![Some([7; 32]), None, Some([5; 32])]));
        // A forger publishing first does not keep two others from agreeing.
        let chunk3 = |t: &Tracker| t.map(&d).and_then(|m| m.hashes()[3]);
        t.handle(publish("b", &one(3, 66)), Some("b"), now).unwrap();
        t.handle(publish("a", &one(3, 3)), Some("a"), now).unwrap();
        assert_eq!(chunk3(&t), None, "two disagreeing nodes settle nothing");
        t.handle(publish("d", &one(3, 3)), Some("d"), now).unwrap();
        assert_eq!(chunk3(&t), Some([3; 32]));
        // A hash that differs from a taken one is refused, naming the chunk.
        assert_eq!(
            refusal(&t, publish("c", &one(0, 1)), "c"),
            format!("chunk 0 of {d} was published with two different hashes")
        );
    }

    #[test]
    fn a_digest_failure_is_taken_only_from_a_node_holding_every_chunk() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let now = Instant::now();
        t.handle(
            announce("a", d, 2 << 22, Some(&Bitfield::new(2)), true),
            Some("a"),
            now,
        )
        .unwrap();
        assert_eq!(
            refusal(&t, digest_failed("a", d), "a"),
            format!(
                "peer \"a\" holds 0 of the 2 chunks of {d}: only a node that assembled every chunk can report that the blob failed its digest"
            )
        );
    }

    #[test]
    fn limits_on_nodes_ids_addresses_labels_and_blobs_are_refused_with_the_limit() {
        let t = Tracker::new(&TrackerConfig {
            max_nodes: 1,
            max_blobs_per_node: 1,
            ..TrackerConfig::default()
        });
        let d = BlobDigest::of(b"blob");
        let now = Instant::now();
        t.handle(
            announce("a", d, 1 << 22, Some(&Bitfield::new(1)), true),
            Some("a"),
            now,
        )
        .unwrap();
        assert_eq!(
            refusal(
                &t,
                announce("b", d, 1 << 22, Some(&Bitfield::new(1)), true),
                "b"
            ),
            "the tracker knows 1 agents already; peer \"b\" is refused until some expire"
        );
        let with = |f: &dyn Fn(&mut pb::Announce)| {
            let mut req = announce("a", d, 1 << 22, Some(&Bitfield::new(1)), true);
            if let Some(Body::Announce(a)) = &mut req.body {
                f(a);
            }
            req
        };
        assert_eq!(
            refusal(&t, with(&|a| a.address = "x".repeat(300)), "a"),
            "the peer address is 300, more than the limit of 256"
        );
        assert_eq!(
            refusal(
                &t,
                with(&|a| {
                    a.labels = (0..17).map(|i| (format!("k{i}"), "v".into())).collect();
                }),
                "a"
            ),
            "the number of labels is 17, more than the limit of 16"
        );
        assert_eq!(
            refusal(
                &t,
                with(&|a| {
                    a.labels.insert("zone".into(), "z".repeat(254));
                }),
                "a"
            ),
            "label \"zone\" is 254, more than the limit of 253"
        );
        assert_eq!(
            refusal(
                &t,
                with(&|a| {
                    let extra = a.blobs[0].clone();
                    a.blobs.push(extra);
                }),
                "a"
            ),
            "the number of blobs in one announce is 2, more than the limit of 1"
        );
        let text = t.encode_metrics();
        assert!(
            text.contains("dray_tracker_refusals_total{reason=\"limit\"} 5"),
            "{text}"
        );
    }

    #[test]
    fn chunk_maps_past_their_byte_limit_are_refused() {
        let t = Tracker::new(&TrackerConfig {
            // Room for one 64-chunk map.
            max_chunk_map_bytes: 64 * HASH_SLOT_BYTES,
            ..TrackerConfig::default()
        });
        let now = Instant::now();
        let size = 64u64 << 22;
        for (p, name) in [("a", b"x"), ("b", b"y")] {
            let d = BlobDigest::of(name);
            t.handle(
                announce(p, d, size, Some(&Bitfield::new(64)), true),
                Some(p),
                now,
            )
            .unwrap();
            let mut m = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
            m.set_hash(0, [1; 32]).unwrap();
            let published = t.handle(publish(p, &m), Some(p), now);
            if p == "a" {
                published.unwrap();
            } else {
                assert_eq!(
                    published.unwrap_err().to_string(),
                    format!(
                        "chunk map for {d}: the tracker holds 2112 bytes of chunk maps and 2112 more would pass its limit of 2112"
                    )
                );
            }
        }
    }
}
