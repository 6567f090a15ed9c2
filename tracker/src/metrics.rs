//! The tracker's Prometheus metrics, served at `/metrics` next to the tracker
//! protocol. One [`TrackerMetrics`] per [`crate::Tracker`]; labels take a few
//! fixed values only, never a digest or a peer id.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::fmt::Write;
use std::time::Duration;

/// Content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A full announce (every holding as a bitfield) or a delta (chunks added).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum AnnounceKind {
    Full,
    Delta,
}

impl EncodeLabelValue for AnnounceKind {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(match self {
            Self::Full => "full",
            Self::Delta => "delta",
        })
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: AnnounceKind,
}

/// Why a request was refused: a few fixed words (see `TrackerError::reason`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// Every metric of one tracker replica.
#[derive(Debug)]
pub struct TrackerMetrics {
    registry: Registry,
    announces: Family<KindLabel, Counter>,
    announce_duration: Histogram,
    rejected_requests: Counter,
    refusals: Family<ReasonLabel, Counter>,
    pub(crate) nodes: Gauge,
    pub(crate) chunk_map_bytes: Gauge,
    pub(crate) blobs: Gauge,
    pub(crate) chunk_maps: Gauge,
    pub(crate) preheat_jobs: Gauge,
    pub(crate) preheat_nodes_pending: Gauge,
    runs_assigned: Counter,
    runs_reclaimed: Counter,
    expired_nodes: Counter,
    left_nodes: Counter,
    bad_chunk_reports: Counter,
    bans: Counter,
    silent_peer_reports: Counter,
    silent_owed_chunks: Counter,
    digest_failures: Counter,
}

impl Default for TrackerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl TrackerMetrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("dray_tracker"),
            announces: Family::default(),
            // 25 µs to about 0.8 s.
            announce_duration: Histogram::new(exponential_buckets(25e-6, 2.0, 16)),
            rejected_requests: Counter::default(),
            refusals: Family::default(),
            nodes: Gauge::default(),
            chunk_map_bytes: Gauge::default(),
            blobs: Gauge::default(),
            chunk_maps: Gauge::default(),
            preheat_jobs: Gauge::default(),
            preheat_nodes_pending: Gauge::default(),
            runs_assigned: Counter::default(),
            runs_reclaimed: Counter::default(),
            expired_nodes: Counter::default(),
            left_nodes: Counter::default(),
            bad_chunk_reports: Counter::default(),
            bans: Counter::default(),
            silent_peer_reports: Counter::default(),
            silent_owed_chunks: Counter::default(),
            digest_failures: Counter::default(),
        };
        let r = &mut m.registry;
        r.register(
            "announces",
            "Announces handled, full or delta",
            m.announces.clone(),
        );
        r.register_with_unit(
            "announce_duration",
            "Time to handle one announce, decoding and encoding excluded",
            Unit::Seconds,
            m.announce_duration.clone(),
        );
        r.register(
            "rejected_requests",
            "Tracker requests refused as malformed or inconsistent",
            m.rejected_requests.clone(),
        );
        r.register(
            "refusals",
            "Tracker requests refused, by reason (unauthenticated, not_your_id, malformed, limit, map_disagrees, report_refused, report_limit, inconsistent, preheat_refused)",
            m.refusals.clone(),
        );
        r.register("nodes", "Agents known now", m.nodes.clone());
        r.register_with_unit(
            "chunk_map_memory",
            "Bytes the chunk maps held take (33 a chunk), against max_chunk_map_bytes",
            Unit::Bytes,
            m.chunk_map_bytes.clone(),
        );
        r.register(
            "blobs",
            "Blobs with at least one agent holding or wanting them",
            m.blobs.clone(),
        );
        r.register(
            "chunk_maps",
            "Blobs whose chunk map (possibly partial) this replica hands out",
            m.chunk_maps.clone(),
        );
        r.register(
            "preheat_jobs",
            "Preheat jobs this replica keeps (it coordinates them), ended ones included",
            m.preheat_jobs.clone(),
        );
        r.register(
            "preheat_nodes_pending",
            "Nodes chosen by this replica's preheat jobs that have not reported the job done or failed",
            m.preheat_nodes_pending.clone(),
        );
        r.register(
            "registry_runs_assigned",
            "Registry-fetch runs handed to agents",
            m.runs_assigned.clone(),
        );
        r.register(
            "registry_runs_reclaimed",
            "Registry-fetch runs taken back from agents that stalled",
            m.runs_reclaimed.clone(),
        );
        r.register(
            "expired_nodes",
            "Agents dropped after missing their announces",
            m.expired_nodes.clone(),
        );
        r.register(
            "left_nodes",
            "Agents dropped at once because they said they were stopping",
            m.left_nodes.clone(),
        );
        r.register(
            "bad_chunk_reports",
            "Reports of a peer sending a chunk that failed its hash",
            m.bad_chunk_reports.clone(),
        );
        r.register(
            "bans",
            "Agents banned: each reported more peers for corrupt chunks than an honest node meets (or a report the tracker confirmed named it)",
            m.bans.clone(),
        );
        r.register(
            "silent_peer_reports",
            "Reports of a peer leaving a chunk request unanswered, or too slow for its deadline (repeated every 30 s while the asker's pull runs)",
            m.silent_peer_reports.clone(),
        );
        r.register(
            "silent_owed_chunks",
            "Chunks held by one agent only that a silent-peer report sent out as registry runs",
            m.silent_owed_chunks.clone(),
        );
        r.register(
            "digest_failures",
            "Blobs that failed their digest at two nodes, whose chunks are rechecked against the registry",
            m.digest_failures.clone(),
        );
        m
    }

    pub fn announced(&self, kind: AnnounceKind, took: Duration, new_runs: u64) {
        self.announces.get_or_create(&KindLabel { kind }).inc();
        self.announce_duration.observe(took.as_secs_f64());
        self.runs_assigned.inc_by(new_runs);
    }

    /// A request refused, for `reason` (one of a few fixed words).
    pub fn refused(&self, reason: &'static str) {
        self.rejected_requests.inc();
        self.refusals.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A bad-chunk report taken; `newly_banned`: it banned the offender.
    pub fn bad_chunk_reported(&self, newly_banned: bool) {
        self.bad_chunk_reports.inc();
        if newly_banned {
            self.bans.inc();
        }
    }

    /// A silent-peer report taken, which made `owed` chunks owed a run.
    pub fn silent_peer_reported(&self, owed: u32) {
        self.silent_peer_reports.inc();
        self.silent_owed_chunks.inc_by(u64::from(owed));
    }

    pub fn digest_failed(&self) {
        self.digest_failures.inc();
    }

    /// An agent said it leaves; `known`: the tracker had state for it.
    pub fn left(&self, known: bool) {
        if known {
            self.left_nodes.inc();
        }
    }

    pub fn ticked(&self, reclaimed: usize, expired: usize) {
        self.runs_reclaimed.inc_by(reclaimed as u64);
        self.expired_nodes.inc_by(expired as u64);
    }

    /// The exposition in OpenMetrics text, `# EOF` included.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
