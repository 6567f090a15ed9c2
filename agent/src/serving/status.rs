//! What a node is doing now, for `dray status` (`GET /v1/status` on the
//! local API's unix socket, so no network access is needed to ask): the
//! pulls in progress with their bytes from peers and from the registry,
//! rate, ETA and peers; the store against its watermarks; the tracker's and
//! the DHT's state; recent fallbacks and bans with their reasons
//! ([`crate::pull::events`]); and the blobs held.
//!
//! The answer is bounded whatever the node holds: at most [`MAX_PULLS`]
//! pulls, [`MAX_PEERS`] peers each, [`crate::pull::events::KEPT`] events and
//! [`MAX_BLOBS`] blobs (pulls and partial blobs first, then the most
//! recently used), with the totals beside the lists.

use crate::pull::events::Event;
use crate::pull::swarm::Swarm;
use crate::store::gc::{GcConfig, Usage};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Pulls listed at most.
pub const MAX_PULLS: usize = 256;
/// Peers listed per pull at most.
pub const MAX_PEERS: usize = 32;
/// Blobs listed at most.
pub const MAX_BLOBS: usize = 1024;

/// `GET /v1/status` answer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub peer_id: String,
    pub peer_addr: String,
    pub trackers: Vec<String>,
    /// Whether a tracker replica answers now; absent with none configured.
    #[serde(default)]
    pub tracker_reachable: Option<bool>,
    /// The DHT's state; absent when the node has not joined one.
    #[serde(default)]
    pub dht: Option<DhtStatus>,
    pub uptime_s: f64,
    pub uploads_in_progress: u32,
    /// Pulls in progress, longest running first.
    #[serde(default)]
    pub pulls: Vec<PullStatus>,
    /// Of them, the number running (the list stops at [`MAX_PULLS`]).
    #[serde(default)]
    pub pulls_running: usize,
    /// Recent fallbacks, bans and drops, newest first.
    #[serde(default)]
    pub events: Vec<Event>,
    /// Blobs held; see [`MAX_BLOBS`].
    pub blobs: Vec<BlobStatus>,
    /// Blobs held in all.
    #[serde(default)]
    pub blobs_held: usize,
    /// The store's garbage-collection settings and what it holds.
    #[serde(default)]
    pub gc: Option<GcStatus>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DhtStatus {
    /// Peers in this node's routing table.
    pub routing_peers: usize,
}

/// One pull in progress.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PullStatus {
    pub digest: String,
    pub repository: String,
    /// The registry's base URL.
    pub registry: String,
    pub size: u64,
    /// Verified bytes on disk (resumed ones included).
    pub have: u64,
    /// Bytes this attempt took from peers and from the registry.
    pub bytes_from_peers: u64,
    pub bytes_from_registry: u64,
    pub elapsed_s: f64,
    /// Bytes per second since the pull started.
    pub rate: f64,
    /// Seconds left at that rate; absent before the first byte.
    pub eta_s: Option<f64>,
    /// The peers the transfer takes chunks from now (at most [`MAX_PEERS`]).
    pub peers: Vec<String>,
    /// Their number.
    pub peer_count: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GcStatus {
    pub config: GcConfig,
    pub usage: Usage,
    /// Share of its limits the store uses, which the watermarks are shares of
    /// ([`crate::store::gc::use_share`]).
    #[serde(default)]
    pub use_share: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BlobStatus {
    pub digest: String,
    pub size: u64,
    pub have: u64,
    pub complete: bool,
}

/// The node's status now; `started` is when the agent started.
pub async fn of(swarm: &Swarm, started: Instant) -> Status {
    let node = swarm.node();
    let store = node.store();
    let mut pulls: Vec<PullStatus> = swarm
        .pulling()
        .into_iter()
        .map(|p| {
            let blob = p.transfer.blob();
            let report = p.transfer.report();
            let size = blob.map().size();
            let have = blob.held_bytes();
            let elapsed_s = p.started.elapsed().as_secs_f64();
            // What arrived during this pull, not what was resumed.
            let fetched = report.bytes_received + report.bytes_from_registry;
            let rate = fetched as f64 / elapsed_s.max(1e-3);
            let mut peers = p.transfer.live_peers();
            peers.sort();
            let peer_count = peers.len();
            peers.truncate(MAX_PEERS);
            PullStatus {
                digest: p.digest.to_string(),
                repository: p.repo,
                registry: p.origin,
                size,
                have,
                bytes_from_peers: report.bytes_received,
                bytes_from_registry: report.bytes_from_registry,
                elapsed_s,
                rate,
                eta_s: (rate > 0.0).then(|| size.saturating_sub(have) as f64 / rate),
                peers,
                peer_count,
            }
        })
        .collect();
    pulls.sort_by(|a, b| b.elapsed_s.total_cmp(&a.elapsed_s));
    let pulls_running = pulls.len();
    pulls.truncate(MAX_PULLS);
    let mut holdings = store.holdings();
    let blobs_held = holdings.len();
    holdings.sort_by_key(|h| (h.complete, std::cmp::Reverse(h.last_used)));
    let blobs = holdings
        .iter()
        .take(MAX_BLOBS)
        .map(|h| BlobStatus {
            digest: h.digest.to_string(),
            size: h.size,
            have: h.held_bytes(),
            complete: h.complete,
        })
        .collect();
    let dht = match swarm.dht() {
        Some(d) => Some(DhtStatus {
            routing_peers: d.routing_peers().await,
        }),
        None => None,
    };
    Status {
        peer_id: node.peer_id().to_string(),
        peer_addr: node.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        trackers: swarm.config().trackers.clone(),
        tracker_reachable: swarm.tracker_reachable(),
        dht,
        uptime_s: started.elapsed().as_secs_f64(),
        uploads_in_progress: node.active_uploads(),
        pulls,
        pulls_running,
        events: swarm.events().recent(),
        blobs,
        blobs_held,
        gc: store.usage().ok().map(|usage| {
            let config = store.gc().config();
            GcStatus {
                use_share: crate::store::gc::use_share(&config, &usage),
                config,
                usage,
            }
        }),
    }
}
