//! The agent's Prometheus metrics and its admin endpoint.
//!
//! [`AgentMetrics`] is the one registry of an agent's metrics. It is created
//! once per agent, handed to its [`PeerNode`] and reached through
//! [`PeerNode::metrics`] by everything that counts (transfers, the swarm pull,
//! the peer server, the mirror); tests running several agents in one process
//! get one registry each. Labels take a few fixed values only: never a digest
//! or a peer id.
//!
//! [`AdminEndpoint`] serves `/metrics` (OpenMetrics text), `/healthz` (the
//! process serves) and `/readyz` (the chunk store is open and the peer endpoint
//! bound) on the admin listener, which starts before the store is opened so
//! that a slow start (re-verifying partial blobs) shows as not ready.

use crate::peer::PeerNode;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::fmt::Write;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// Content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Label value enums, encoded as the given lowercase text.
macro_rules! label_values {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        pub enum $name { $($(#[$vdoc])* $variant),+ }

        impl $name {
            /// Every value.
            pub const ALL: &[Self] = &[$(Self::$variant),+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
                e.write_str(self.as_str())
            }
        }
    };
}

label_values! {
    /// Where chunk bytes came from.
    Source { Peer => "peer", Registry => "registry" }
}

label_values! {
    /// Why a pull turned to the registry for chunks the swarm did not deliver.
    FallbackReason {
        /// The tracker did not answer within `swarm.tracker_grace`.
        TrackerSilent => "tracker_silent",
        /// Nothing arrived or was in flight for `swarm.stall`.
        Stall => "stall",
        /// The tracker answered but nothing arrived or was in flight for
        /// `swarm.tracker_grace`: chunks no live peer gives, from the registry.
        Starved => "starved",
        /// The blob failed its digest twice in one pull, or its recheck found
        /// nothing wrong: pulled again from the registry alone.
        MapFailure => "map_failure",
    }
}

label_values! {
    /// How a pull ended.
    Outcome { Completed => "completed", Failed => "failed" }
}

label_values! {
    /// What a mirror request asked for.
    MirrorRequest { Ping => "ping", Manifest => "manifest", Blob => "blob", Tags => "tags", Invalid => "invalid" }
}

label_values! {
    /// An HTTP status class.
    StatusClass { Informational => "1xx", Success => "2xx", Redirect => "3xx", ClientError => "4xx", ServerError => "5xx" }
}

impl StatusClass {
    pub fn of(status: StatusCode) -> Self {
        match status.as_u16() {
            ..200 => Self::Informational,
            200..300 => Self::Success,
            300..400 => Self::Redirect,
            400..500 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: Source,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: FallbackReason,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MirrorLabels {
    pub kind: MirrorRequest,
    pub status: StatusClass,
}

/// Every metric of one agent, and the registry that exposes them.
#[derive(Debug)]
pub struct AgentMetrics {
    registry: Registry,
    received_bytes: Family<SourceLabel, Counter>,
    uploaded_bytes: Counter,
    upload_refusals: Counter,
    verify_failures: Family<SourceLabel, Counter>,
    liars_identified: Counter,
    connected_peers: Gauge,
    fallbacks: Family<ReasonLabel, Counter>,
    pull_duration: Histogram,
    pulls_in_flight: Gauge,
    pulls: Family<OutcomeLabel, Counter>,
    mirror_requests: Family<MirrorLabels, Counter>,
    /// The chunk store's size and its garbage collector's work.
    gc: crate::store::gc::GcMetrics,
    /// The DHT's routing table, traffic and refusals.
    dht: crate::discovery::dht::DhtMetrics,
    certificate_expiry: Gauge,
    /// One unlabelled sample, absent while no tracker is configured (a
    /// DHT-only node is not one that lost its tracker).
    tracker_reachable: Family<NoLabels, Gauge>,
    unpacked_bytes: Counter,
    certificate_lifetime: Gauge,
}

/// The label set of a family with one unlabelled sample, present only once set.
type NoLabels = Vec<(&'static str, &'static str)>;

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("dray_agent"),
            received_bytes: Family::default(),
            uploaded_bytes: Counter::default(),
            upload_refusals: Counter::default(),
            verify_failures: Family::default(),
            liars_identified: Counter::default(),
            connected_peers: Gauge::default(),
            fallbacks: Family::default(),
            // 0.1 s to about 7 minutes.
            pull_duration: Histogram::new(exponential_buckets(0.1, 2.0, 13)),
            pulls_in_flight: Gauge::default(),
            pulls: Family::default(),
            mirror_requests: Family::default(),
            gc: crate::store::gc::GcMetrics::default(),
            dht: crate::discovery::dht::DhtMetrics::default(),
            certificate_expiry: Gauge::default(),
            tracker_reachable: Family::default(),
            unpacked_bytes: Counter::default(),
            certificate_lifetime: Gauge::default(),
        };
        // Every series of the labelled counters exists from the start, at 0:
        // a rate or a dashboard panel then reads 0, not "no data", on a node
        // that never fell back or never saw a bad chunk.
        for &source in Source::ALL {
            let _ = m.received_bytes.get_or_create(&SourceLabel { source });
            let _ = m.verify_failures.get_or_create(&SourceLabel { source });
        }
        for &reason in FallbackReason::ALL {
            let _ = m.fallbacks.get_or_create(&ReasonLabel { reason });
        }
        for &outcome in Outcome::ALL {
            let _ = m.pulls.get_or_create(&OutcomeLabel { outcome });
        }
        let r = &mut m.registry;
        m.gc.register(r);
        m.dht.register(r);
        r.register_with_unit(
            "received",
            "Verified chunk bytes stored, by where they came from",
            Unit::Bytes,
            m.received_bytes.clone(),
        );
        r.register_with_unit(
            "uploaded",
            "Chunk bytes sent to peers",
            Unit::Bytes,
            m.uploaded_bytes.clone(),
        );
        r.register(
            "upload_busy_refusals",
            "Chunk requests refused BUSY because every upload slot was in use",
            m.upload_refusals.clone(),
        );
        r.register(
            "chunk_verify_failures",
            "Chunks that failed their hash, by where they came from",
            m.verify_failures.clone(),
        );
        r.register(
            "liars_identified",
            "Peers whose chunk hashes the registry's bytes contradicted, in a pull without a tracker's hashes",
            m.liars_identified.clone(),
        );
        r.register(
            "connected_peers",
            "Open QUIC connections with other agents, either direction",
            m.connected_peers.clone(),
        );
        r.register(
            "registry_fallbacks",
            "Pulls that turned to the registry for chunks the swarm did not deliver, by reason",
            m.fallbacks.clone(),
        );
        r.register_with_unit(
            "pull_duration",
            "Time to pull a blob into the chunk store, completed pulls only",
            Unit::Seconds,
            m.pull_duration.clone(),
        );
        r.register(
            "pulls_in_flight",
            "Blob pulls running now",
            m.pulls_in_flight.clone(),
        );
        r.register("pulls", "Blob pulls ended, by outcome", m.pulls.clone());
        r.register(
            "mirror_requests",
            "Registry mirror requests answered, by what they asked for and status class",
            m.mirror_requests.clone(),
        );
        r.register_with_unit(
            "certificate_expiry_timestamp",
            "When this agent's peer certificate ends, Unix time: alert well before it",
            Unit::Seconds,
            m.certificate_expiry.clone(),
        );
        r.register(
            "tracker_reachable",
            "1 while a tracker replica answers this agent, 0 while every replica failed or hangs; absent with no tracker configured",
            m.tracker_reachable.clone(),
        );
        r.register_with_unit(
            "unpacked",
            "Uncompressed layer bytes unpacked for the snapshotter (tar streams that matched their diffID)",
            Unit::Bytes,
            m.unpacked_bytes.clone(),
        );
        r.register_with_unit(
            "certificate_lifetime",
            "How long this agent's peer certificate is valid in all (a signer's are short and renewed at two thirds)",
            Unit::Seconds,
            m.certificate_lifetime.clone(),
        );
        m
    }

    /// What the store's collector counts into (hand it to `GcState::use_metrics`).
    pub fn gc(&self) -> &crate::store::gc::GcMetrics {
        &self.gc
    }

    /// What the DHT counts into (hand it to `Dht::join`).
    pub fn dht(&self) -> &crate::discovery::dht::DhtMetrics {
        &self.dht
    }

    /// The agent's certificate is valid from `not_before` to `not_after` (Unix seconds).
    pub fn certificate_valid(&self, not_before: i64, not_after: i64) {
        self.certificate_expiry.set(not_after);
        self.certificate_lifetime.set(not_after - not_before);
    }

    /// Whether a tracker replica answers this agent now.
    pub fn tracker_reachable(&self, reachable: bool) {
        self.tracker_reachable
            .get_or_create(&NoLabels::new())
            .set(i64::from(reachable));
    }

    /// One layer unpacked, `bytes` of tar.
    pub fn unpacked(&self, bytes: u64) {
        self.unpacked_bytes.inc_by(bytes);
    }

    /// Verified bytes of one chunk stored.
    pub fn received(&self, source: Source, bytes: u64) {
        self.received_bytes
            .get_or_create(&SourceLabel { source })
            .inc_by(bytes);
    }

    /// Bytes of one chunk sent to a peer.
    pub fn uploaded(&self, bytes: u64) {
        self.uploaded_bytes.inc_by(bytes);
    }

    /// A chunk request refused because every upload slot was taken.
    pub fn upload_refused(&self) {
        self.upload_refusals.inc();
    }

    /// A chunk that failed its hash.
    pub fn verify_failed(&self, source: Source) {
        self.verify_failures
            .get_or_create(&SourceLabel { source })
            .inc();
    }

    /// A peer ruled a liar by a check against the registry.
    pub fn liar_identified(&self) {
        self.liars_identified.inc();
    }

    /// A pull turning to the registry.
    pub fn fell_back(&self, reason: FallbackReason) {
        self.fallbacks.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A mirror request answered.
    pub fn mirror_request(&self, kind: MirrorRequest, status: StatusCode) {
        self.mirror_requests
            .get_or_create(&MirrorLabels {
                kind,
                status: StatusClass::of(status),
            })
            .inc();
    }

    /// Starts timing a pull; it counts as failed unless
    /// [`PullTimer::completed`] is called.
    pub fn pull_started(&self) -> PullTimer<'_> {
        self.pulls_in_flight.inc();
        PullTimer {
            metrics: self,
            started: Instant::now(),
            completed: false,
        }
    }

    /// The exposition in OpenMetrics text, `# EOF` included.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// One pull in flight; see [`AgentMetrics::pull_started`].
pub struct PullTimer<'a> {
    metrics: &'a AgentMetrics,
    started: Instant,
    completed: bool,
}

impl PullTimer<'_> {
    pub fn completed(mut self) {
        self.completed = true;
        self.metrics
            .pull_duration
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for PullTimer<'_> {
    fn drop(&mut self) {
        self.metrics.pulls_in_flight.dec();
        let outcome = if self.completed {
            Outcome::Completed
        } else {
            Outcome::Failed
        };
        self.metrics
            .pulls
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }
}

/// The admin listener's routes: metrics, liveness and readiness.
pub struct AdminEndpoint {
    metrics: Arc<AgentMetrics>,
    node: OnceLock<Arc<PeerNode>>,
}

impl AdminEndpoint {
    /// Not ready until [`AdminEndpoint::set_ready`].
    pub fn new(metrics: Arc<AgentMetrics>) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            node: OnceLock::new(),
        })
    }

    /// The store is open and `node` is bound: `/readyz` answers 200 from now on.
    pub fn set_ready(&self, node: Arc<PeerNode>) {
        let _ = self.node.set(node);
    }

    pub fn router(self: &Arc<Self>) -> axum::Router {
        use axum::routing::get;
        let (m, r) = (self.clone(), self.clone());
        axum::Router::new()
            .route("/metrics", get(move || async move { m.metrics_response() }))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(move || async move { r.readiness() }))
    }

    /// Serves on `listener` until the task is dropped.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }

    fn metrics_response(&self) -> axum::response::Response {
        if let Some(node) = self.node.get() {
            self.metrics
                .connected_peers
                .set(i64::try_from(node.connected_peers()).unwrap_or(i64::MAX));
            // The store's gauges as of this scrape, not the collector's last pass.
            if let Ok(usage) = node.store().usage() {
                node.store().gc().count_usage(&usage);
            }
        }
        (
            [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
            self.metrics.encode(),
        )
            .into_response()
    }

    fn readiness(&self) -> axum::response::Response {
        match self.node.get().map(|n| n.local_addr()) {
            Some(Ok(addr)) => format!("ready: peer endpoint on {addr}\n").into_response(),
            Some(Err(e)) => {
                (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")).into_response()
            }
            None => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: the chunk store is opening or the peer endpoint is not bound yet\n",
            )
                .into_response(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_follow_prometheus_conventions() {
        let m = AgentMetrics::new();
        m.received(Source::Peer, 4 << 20);
        m.received(Source::Registry, 1 << 20);
        m.fell_back(FallbackReason::TrackerSilent);
        m.mirror_request(MirrorRequest::Blob, StatusCode::PARTIAL_CONTENT);
        m.pull_started().completed();
        drop(m.pull_started());
        let text = m.encode();
        for line in [
            "dray_agent_received_bytes_total{source=\"peer\"} 4194304",
            "dray_agent_received_bytes_total{source=\"registry\"} 1048576",
            "dray_agent_registry_fallbacks_total{reason=\"tracker_silent\"} 1",
            "dray_agent_mirror_requests_total{kind=\"blob\",status=\"2xx\"} 1",
            "dray_agent_pull_duration_seconds_count 1",
            "dray_agent_pulls_total{outcome=\"completed\"} 1",
            "dray_agent_pulls_total{outcome=\"failed\"} 1",
            "dray_agent_pulls_in_flight 0",
            "dray_agent_uploaded_bytes_total 0",
            "dray_agent_registry_fallbacks_total{reason=\"stall\"} 0",
            "dray_agent_chunk_verify_failures_total{source=\"peer\"} 0",
            "dray_agent_unpacked_bytes_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            !text.contains("dray_agent_tracker_reachable "),
            "unset: {text}"
        );
        m.tracker_reachable(false);
        assert!(
            m.encode()
                .lines()
                .any(|l| l == "dray_agent_tracker_reachable 0"),
            "{}",
            m.encode()
        );
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
        (status, raw)
    }

    #[tokio::test]
    async fn readiness_waits_for_the_store_and_endpoint_while_liveness_and_metrics_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = tokio::spawn(AdminEndpoint::new(Arc::default()).serve(listener));
        assert_eq!(get(addr, "/healthz").await.0, 200);
        let (status, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("not ready"), "{body}");
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(
            body.contains(OPENMETRICS_CONTENT_TYPE) && body.ends_with("# EOF\n"),
            "{body}"
        );
        served.abort();
    }
}
