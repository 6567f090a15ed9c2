//! Preheat: an image's blobs pulled into chosen nodes' stores ahead of a
//! rollout, so that the rollout finds them in the swarm. One definition of
//! the tracker's preheat API (JSON over the tracker's TLS listener, for
//! `dray preheat`, CI systems and registry webhooks) and of its limits, for
//! the tracker that answers and the clients that ask.
//!
//! One replica coordinates every preheat job: the owner of
//! [`coordinator_key`] by the same rendezvous hashing that picks a blob's
//! replica, so that agents and clients find it with no coordination. Agents
//! that run preheat jobs (`dray agent`) announce to it even when they hold
//! nothing it owns; it hands a chosen
//! node its jobs in announce answers, and the node reports its progress in
//! its next announces.

use crate::BlobDigest;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where a preheat job is started (`POST`, a [`PreheatRequest`]) and, under
/// it, read (`GET .../{id}`, a [`PreheatJob`]).
pub const PREHEAT_PATH: &str = "/v1/preheat";
/// Longest image reference a job may name.
pub const MAX_IMAGE_BYTES: usize = 512;
/// Longest error a node may report for a job.
pub const MAX_ERROR_BYTES: usize = 512;
/// Jobs a node reports at once (its newest); jobs a replica keeps.
pub const MAX_NODE_JOBS: usize = 16;
pub const MAX_JOBS: usize = 64;
/// Longest job id (hex).
pub const MAX_ID_BYTES: usize = 32;

/// The key whose rendezvous owner among the replicas coordinates preheats.
pub fn coordinator_key() -> BlobDigest {
    BlobDigest::of(b"dray preheat coordinator")
}

/// `POST /v1/preheat`: which image, on which nodes. With neither `count`
/// nor `percent`, every node that matches `labels`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreheatRequest {
    /// Image reference, e.g. `registry.example/team/app:1.0`.
    pub image: String,
    /// This many nodes (all that match, if fewer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// This share of the matching nodes, 0-100, rounded up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<f64>,
    /// Only nodes announcing all these topology labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// Where one node is with a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Chosen; the node has not reported the job yet.
    Queued,
    Pulling,
    Done,
    Failed,
}

impl NodeState {
    pub fn of(s: crate::pb::preheat_status::State) -> Self {
        use crate::pb::preheat_status::State;
        match s {
            State::Queued => Self::Queued,
            State::Pulling => Self::Pulling,
            State::Done => Self::Done,
            State::Failed => Self::Failed,
        }
    }

    /// Done or failed: the node will not report the job again.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Done | Self::Failed)
    }
}

/// One chosen node's progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeProgress {
    pub peer_id: String,
    /// Its topology labels when it was chosen.
    pub labels: BTreeMap<String, String>,
    pub state: NodeState,
    /// Verified bytes of the image's blobs held.
    pub have: u64,
    /// The image's blob bytes (0 until the node resolved the manifest).
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A preheat job as the coordinating replica knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreheatJob {
    pub id: String,
    pub image: String,
    /// Nodes that matched the request's labels when it was made.
    pub matched: u32,
    pub nodes: Vec<NodeProgress>,
    /// Every chosen node holds the image.
    pub done: bool,
    /// Chosen nodes that reported a failure.
    pub failed: u32,
    /// Seconds since the job was made.
    pub age_s: f64,
}

impl PreheatJob {
    /// Every chosen node is done or failed.
    pub fn ended(&self) -> bool {
        self.nodes.iter().all(|n| n.state.is_final())
    }
}

/// The nodes a job takes out of `matched` (at least one, at most all).
pub fn wanted(matched: usize, count: Option<u32>, percent: Option<f64>) -> usize {
    let n = match (count, percent) {
        (Some(c), _) => c as usize,
        (None, Some(p)) => (matched as f64 * p.clamp(0.0, 100.0) / 100.0).ceil() as usize,
        (None, None) => matched,
    };
    n.clamp(1, matched.max(1)).min(matched)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_of_the_nodes_is_rounded_up_and_never_more_than_match() {
        assert_eq!(wanted(8, None, Some(25.0)), 2);
        assert_eq!(wanted(7, None, Some(25.0)), 2);
        assert_eq!(wanted(8, None, Some(1.0)), 1);
        assert_eq!(wanted(8, Some(20), None), 8);
        assert_eq!(wanted(8, Some(3), None), 3);
        assert_eq!(wanted(8, None, None), 8);
        assert_eq!(wanted(0, Some(3), None), 0);
        assert_eq!(wanted(8, None, Some(250.0)), 8);
    }
}
