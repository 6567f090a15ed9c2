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
//! [`metrics`]), `/healthz` and `/readyz`.
//!
//! The listener speaks TLS with a certificate from the cluster CA (see
//! [`tls`]). The tracker API needs a client certificate from the same CA,
//! and the peer id of every announce, publication and report is the
//! certificate's: a request naming another peer is refused. `/metrics`,
//! `/healthz` and `/readyz` need none, so that probes and Prometheus reach
//! them. Plain HTTP, where the request's own peer id is believed, exists only
//! behind `insecure_plain_http`.

pub mod metrics;
pub mod tls;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use dray_protocol::framing::MAX_TRACKER_FRAME;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::scheduler::{self, Scheduler, SchedulerConfig};
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
    /// Longest gap between an agent's announces, ms. Agents pulling a blob
    /// announce sooner, on progress.
    pub announce_interval_ms: u64,
    /// Peers handed out per wanted blob.
    pub peers_per_blob: usize,
    /// Chunks per registry-fetch assignment.
    pub stripe_chunks: u32,
    /// Registry-fetch assignments one agent may hold at once.
    pub max_outstanding: usize,
    /// Live registry-fetch assignments per origin (the registry the agents
    /// pull from), over all its blobs and agents (0: no limit). Per tracker
    /// replica: a sharded tracker's registry sees up to replicas times this.
    pub max_runs_per_origin: usize,
    /// Slowest registry fetch tolerated before an assignment is taken back, bytes/s.
    pub min_fetch_bytes_per_s: u64,
    /// Floor on an assignment's deadline, ms.
    pub min_fetch_timeout_ms: u64,
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
            announce_interval_ms: s.announce_interval.as_millis() as u64,
            peers_per_blob: s.peers_per_blob,
            stripe_chunks: s.stripe_chunks,
            max_outstanding: s.max_outstanding,
            max_runs_per_origin: s.max_runs_per_origin,
            min_fetch_bytes_per_s: s.min_fetch_rate,
            min_fetch_timeout_ms: s.min_fetch_timeout.as_millis() as u64,
        }
    }
}

impl TrackerConfig {
    /// Reads a TOML file; unknown keys are errors. A mistake is one line
    /// naming the file, line, column and key.
    pub fn load(path: &Path) -> Result<Self, TrackerError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| TrackerError::Config(format!("cannot read {}: {e}", path.display())))?;
        dray_protocol::settings::from_toml(&text)
            .map_err(|e| TrackerError::Config(format!("{}: {e}", path.display())))
    }

    fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            announce_interval: Duration::from_millis(self.announce_interval_ms),
            peers_per_blob: self.peers_per_blob,
            stripe_chunks: self.stripe_chunks,
            max_outstanding: self.max_outstanding,
            max_runs_per_origin: self.max_runs_per_origin,
            min_fetch_rate: self.min_fetch_bytes_per_s,
            min_fetch_timeout: Duration::from_millis(self.min_fetch_timeout_ms),
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
    #[error("{what} names peer {claimed:?}, but the client certificate is peer {certified:?}: a node speaks only for itself")]
    NotYourId {
        what: &'static str,
        claimed: String,
        certified: String,
    },
    #[error(transparent)]
    Schedule(#[from] scheduler::ScheduleError),
    #[error(transparent)]
    Map(#[from] dray_protocol::VerifyError),
}

/// The tracker's soft state.
pub struct Tracker {
    state: Mutex<TrackerState>,
    metrics: TrackerMetrics,
}

struct TrackerState {
    scheduler: Scheduler,
    /// Chunk maps as published so far, per blob; may be partial.
    maps: HashMap<BlobDigest, ChunkMap>,
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

fn digest(s: &str) -> Result<BlobDigest, TrackerError> {
    s.parse()
        .map_err(|e: dray_protocol::DigestError| TrackerError::BadRequest(e.to_string()))
}

impl Tracker {
    pub fn new(config: &TrackerConfig) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(TrackerState {
                scheduler: Scheduler::new(config.scheduler()),
                maps: HashMap::new(),
            }),
            metrics: TrackerMetrics::new(),
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
        if handled.is_err() {
            self.metrics.rejected();
        }
        handled
    }

    fn handle_counted(
        &self,
        req: pb::TrackerRequest,
        certified: Option<&str>,
        now: Instant,
    ) -> Result<Option<pb::AnnounceResponse>, TrackerError> {
        let mut st = self.lock();
        match req.body {
            Some(Body::Announce(mut a)) => {
                a.peer_id = speaker("an announce", a.peer_id, certified)?;
                let started = Instant::now();
                let kind = if a.full {
                    AnnounceKind::Full
                } else {
                    AnnounceKind::Delta
                };
                let runs_before = st.scheduler.runs_assigned();
                let resp = st.announce(a, now)?;
                let new_runs = st.scheduler.runs_assigned() - runs_before;
                self.metrics.announced(kind, started.elapsed(), new_runs);
                Ok(Some(resp))
            }
            Some(Body::Publish(p)) => {
                speaker("a chunk map publication", p.peer_id, certified)?;
                let map = p.map.ok_or_else(|| {
                    TrackerError::BadRequest("publication without a chunk map".into())
                })?;
                let map = ChunkMap::from_pb(&map)?;
                match st.maps.get_mut(&map.digest()) {
                    Some(known) => {
                        known.merge(&map)?;
                    }
                    None => {
                        st.maps.insert(map.digest(), map);
                    }
                }
                Ok(None)
            }
            Some(Body::BadChunk(r)) => {
                let report = scheduler::BadChunk {
                    reporter: speaker("a bad-chunk report", r.reporter, certified)?,
                    offender: r.offender,
                    digest: digest(&r.digest)?,
                    index: r.index,
                    confirmed: false,
                };
                let was_banned = st.scheduler.standing(&report.offender).banned;
                let standing = st.scheduler.report_bad_chunk(&report)?;
                self.metrics
                    .bad_chunk_reported(standing.banned && !was_banned);
                tracing::warn!(offender = %report.offender, reporter = %report.reporter, digest = %report.digest,
                    index = report.index, banned = standing.banned, "bad chunk reported");
                Ok(None)
            }
            Some(Body::DigestFailed(f)) => {
                let reporter = speaker("a digest-failure report", f.reporter, certified)?;
                let d = digest(&f.digest)?;
                st.scheduler.blob_failed(&reporter, &d)?;
                st.maps.remove(&d);
                self.metrics.digest_failed();
                tracing::warn!(digest = %d, %reporter, "blob failed its digest; chunk map withdrawn");
                Ok(None)
            }
            None => Err(TrackerError::BadRequest("empty tracker request".into())),
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

    /// The chunk map (possibly partial) this replica hands out for `digest`.
    pub fn map(&self, digest: &BlobDigest) -> Option<ChunkMap> {
        self.lock().maps.get(digest).cloned()
    }

    /// Expires silent agents and takes back stalled assignments.
    pub fn tick(&self, now: Instant) {
        let report = self.lock().scheduler.tick(now);
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

impl TrackerState {
    fn announce(
        &mut self,
        a: pb::Announce,
        now: Instant,
    ) -> Result<pb::AnnounceResponse, TrackerError> {
        let mut blobs = Vec::with_capacity(a.blobs.len());
        let mut wanted = Vec::new();
        for b in &a.blobs {
            let d = digest(&b.digest)?;
            let count = ChunkMap::unhashed(d, b.size, b.chunk_size)?.chunk_count();
            let held = if a.full || !b.bits.is_empty() {
                let bits = Bitfield::from_bytes(count, &b.bits)
                    .map_err(|e| TrackerError::BadRequest(format!("{d}: {e}")))?;
                scheduler::Held::Bits(bits)
            } else {
                scheduler::Held::Added(b.added.clone())
            };
            if b.wanted {
                wanted.push(d);
            }
            if b.origin.len() > MAX_ORIGIN_BYTES {
                return Err(TrackerError::BadRequest(format!(
                    "{d}: origin is {} bytes, more than {MAX_ORIGIN_BYTES}",
                    b.origin.len()
                )));
            }
            blobs.push(scheduler::BlobAnnounce {
                digest: d,
                chunk_count: count,
                size: b.size,
                held,
                wanted: b.wanted,
                origin: b.origin.clone(),
            });
        }
        let decision = self.scheduler.announce(
            scheduler::Announce {
                peer: a.peer_id,
                address: a.address,
                upload_bytes_per_s: a.upload_bytes_per_s,
                active_uploads: a.active_uploads,
                labels: a.labels.into_iter().collect(),
                blobs,
                full: a.full,
            },
            now,
        );
        for e in &decision.rejected {
            tracing::debug!(error = %e, "announce entry ignored");
        }
        Ok(pb::AnnounceResponse {
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
            chunk_maps: wanted
                .iter()
                .filter_map(|d| self.maps.get(d))
                .map(ChunkMap::to_pb)
                .collect(),
            resend_full: decision.resend_full,
            withdrawn: decision.withdrawn.iter().map(ToString::to_string).collect(),
            fetching: decision.fetching.iter().map(ToString::to_string).collect(),
        })
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
        let mut every = tokio::time::interval(Duration::from_millis(500));
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

async fn handle_http(
    State(tracker): State<Arc<Tracker>>,
    ConnectInfo(caller): ConnectInfo<Caller>,
    body: Bytes,
) -> Response {
    let certified = match &caller {
        Caller::Certified(id) => Some(id.as_str()),
        Caller::InsecurePlainHttp => None,
        Caller::Anonymous(why) => {
            tracker.metrics.rejected();
            return (StatusCode::UNAUTHORIZED, format!("{why}\n")).into_response();
        }
    };
    let req = match pb::TrackerRequest::decode(body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("body is not a TrackerRequest: {e}"),
            )
                .into_response();
        }
    };
    match tracker.handle(req, certified, Instant::now()) {
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
                .handle(announce(p, d, size, Some(&Bitfield::new(64)), true), None, now)
                .unwrap()
                .unwrap();
            for a in &resp.assignments {
                for i in a.first..a.first + a.count {
                    assert!(covered.set(i), "chunk {i} assigned twice");
                }
            }
        }
        let mut map = ChunkMap::unhashed(d, size, 1 << 22).unwrap();
        map.set_hash(3, [7; 32]).unwrap();
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
        assert_eq!(got.hashes()[3], Some([7; 32]));
    }

    #[test]
    fn a_restarted_tracker_asks_for_full_announces_and_a_digest_failure_withdraws_the_map() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let resp = t
            .handle(announce("a", d, 1 << 22, None, false), None, Instant::now())
            .unwrap()
            .unwrap();
        assert!(resp.resend_full);
        t.handle(
            announce("a", d, 1 << 22, Some(&Bitfield::new(1)), true),
            None,
            Instant::now(),
        )
        .unwrap();
        let failed = pb::TrackerRequest {
            body: Some(Body::DigestFailed(pb::BlobDigestFailed {
                reporter: "a".into(),
                digest: d.to_string(),
            })),
        };
        t.handle(failed, None, Instant::now()).unwrap();
        let resp = t
            .handle(announce("a", d, 1 << 22, None, false), None, Instant::now())
            .unwrap()
            .unwrap();
        assert_eq!(resp.withdrawn, vec![d.to_string()]);
    }

    #[test]
    fn metrics_count_announces_runs_reports_and_one_ban() {
        let t = Tracker::new(&TrackerConfig::default());
        let d = BlobDigest::of(b"blob");
        let size = 64u64 << 22;
        let now = Instant::now();
        for p in ["a", "bb", "ccc", "dddd"] {
            t.handle(announce(p, d, size, Some(&Bitfield::new(64)), true), None, now)
                .unwrap();
        }
        t.handle(announce("a", d, size, None, false), None, now).unwrap();
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
        assert!(t.handle(pb::TrackerRequest { body: None }, None, now).is_err());
        let text = t.encode_metrics();
        // Each of the 4 nodes holds as many runs as it may.
        let runs = format!(
            "dray_tracker_registry_runs_assigned_total {}",
            4 * TrackerConfig::default().max_outstanding
        );
        for line in [
            "dray_tracker_announces_total{kind=\"full\"} 4",
            "dray_tracker_announces_total{kind=\"delta\"} 1",
            "dray_tracker_announce_duration_seconds_count 5",
            &runs,
            "dray_tracker_bad_chunk_reports_total 3",
            "dray_tracker_bans_total 1",
            "dray_tracker_rejected_requests_total 1",
            "dray_tracker_nodes 4",
            "dray_tracker_blobs 1",
        ] {
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
        let err = t.handle(long, None, Instant::now()).unwrap_err().to_string();
        assert!(
            err.contains("origin is 1025 bytes, more than 1024"),
            "{err}"
        );
    }
}
