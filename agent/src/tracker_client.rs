//! Talking to the tracker replicas. Each blob has an owner among the replicas,
//! chosen by rendezvous hashing of its digest: every agent computes the same
//! owner with no coordination, and when the owner is unreachable the next
//! replica in that blob's order takes over (and rebuilds its state from the full
//! announces that follow).
//!
//! Requests go over TLS: the client presents the node's certificate (the
//! tracker reads the caller's peer id from it) and checks the tracker's
//! against the cluster CA (see [`Identity::tracker_client_tls`]). An
//! `http://` replica URL speaks plain HTTP to a tracker started with
//! `insecure_plain_http`; the client warns once about each such replica.

use crate::identity::Identity;
use dray_protocol::BlobDigest;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::preheat::{self, PREHEAT_PATH, PreheatJob, PreheatRequest};
use prost::Message;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a replica that failed is skipped.
const DOWN_FOR: Duration = Duration::from_secs(3);

/// Why no replica answered.
#[derive(Debug, thiserror::Error)]
#[error("no tracker replica answered: {0}")]
pub struct TrackerUnavailable(pub String);

/// HTTP client for the tracker replicas.
pub struct TrackerClient {
    http: reqwest::Client,
    replicas: Vec<String>,
    down_until: Mutex<HashMap<String, Instant>>,
}

impl TrackerClient {
    /// `replicas` are base URLs such as `https://tracker-0.dray:7880`;
    /// `identity` is the node's certificate, presented to them.
    pub fn new(replicas: Vec<String>, identity: &Identity) -> Self {
        crate::registry::install_crypto_provider();
        let tls = identity
            .tracker_client_tls()
            .expect("an identity whose key loaded builds a client TLS config");
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .tls_backend_preconfigured(tls)
            .build()
            .expect("static client settings are valid");
        for r in replicas.iter().filter(|r| r.starts_with("http://")) {
            tracing::warn!(replica = %r, "tracker replica named by an http:// URL: announces, reports and chunk maps travel unauthenticated and in the clear");
        }
        Self {
            http,
            replicas: replicas
                .into_iter()
                .map(|r| r.trim_end_matches('/').to_string())
                .collect(),
            down_until: Mutex::new(HashMap::new()),
        }
    }

    pub fn is_configured(&self) -> bool {
        !self.replicas.is_empty()
    }

    /// Replicas in the order that owns `digest`: rendezvous (highest random
    /// weight) hashing, so removing a replica moves only the blobs it owned.
    pub fn order(&self, digest: &BlobDigest) -> Vec<&str> {
        let mut ranked: Vec<(&str, [u8; 32])> = self
            .replicas
            .iter()
            .map(|r| {
                let mut h = blake3::Hasher::new();
                h.update(r.as_bytes()).update(digest.as_bytes());
                (r.as_str(), *h.finalize().as_bytes())
            })
            .collect();
        ranked.sort_by_key(|r| std::cmp::Reverse(r.1));
        ranked.into_iter().map(|(r, _)| r).collect()
    }

    /// The replica to use for `digest` now: the first in its order not marked down.
    pub fn owner(&self, digest: &BlobDigest) -> Option<String> {
        let order = self.order(digest);
        order
            .iter()
            .find(|r| !self.is_down(r))
            .or(order.first())
            .map(|r| r.to_string())
    }

    fn mark_down(&self, replica: &str) {
        self.down_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(replica.to_string(), Instant::now() + DOWN_FOR);
    }

    /// Sends one request to `replica`; a failure marks it down for a while.
    pub async fn send(
        &self,
        replica: &str,
        body: Body,
    ) -> Result<Option<pb::AnnounceResponse>, TrackerUnavailable> {
        let req = pb::TrackerRequest { body: Some(body) };
        let url = format!("{replica}{}", "/v1/tracker");
        let post = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
            .body(req.encode_to_vec());
        let bytes = self.exchange(replica, &url, post).await?;
        if bytes.is_empty() {
            return Ok(None);
        }
        pb::AnnounceResponse::decode(bytes).map(Some).map_err(|e| {
            self.mark_down(replica);
            TrackerUnavailable(format!("{url}: bad answer: {e}"))
        })
    }

    /// Sends `request` (to `url` at `replica`) and reads the answer's body.
    /// A refusal (4xx) is the tracker's answer; anything else that fails
    /// marks the replica down for a while.
    async fn exchange(
        &self,
        replica: &str,
        url: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<bytes::Bytes, TrackerUnavailable> {
        let result = async {
            let resp = request
                .send()
                .await
                .map_err(|e| (false, format!("{url}: {}", with_causes(&e))))?;
            let status = resp.status();
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| (false, format!("{url}: {}", with_causes(&e))))?;
            if !status.is_success() {
                return Err((
                    status.is_client_error(),
                    format!(
                        "{url} answered {status}: {}",
                        String::from_utf8_lossy(&bytes).trim_end()
                    ),
                ));
            }
            Ok(bytes)
        }
        .await;
        result.map_err(|(refused, e)| {
            if !refused {
                self.mark_down(replica);
            }
            TrackerUnavailable(e)
        })
    }

    /// Starts a preheat job at the replica that coordinates them (see
    /// [`preheat`]), failing over along its order while replicas are
    /// unreachable; answers the job and the replica that took it.
    pub async fn start_preheat(
        &self,
        req: &PreheatRequest,
    ) -> Result<(String, PreheatJob), TrackerUnavailable> {
        let mut errors = Vec::new();
        for replica in self.order(&preheat::coordinator_key()) {
            let url = format!("{replica}{PREHEAT_PATH}");
            let post = self.http.post(&url).json(req);
            match self.exchange(replica, &url, post).await {
                Ok(body) => return Ok((replica.to_string(), preheat_job(&url, &body)?)),
                // Down: the next replica coordinates while it is.
                Err(e) if self.is_down(replica) => errors.push(e.0),
                Err(refused) => return Err(refused),
            }
        }
        Err(TrackerUnavailable(if errors.is_empty() {
            "no replicas configured".into()
        } else {
            errors.join("; ")
        }))
    }

    /// Preheat job `id`'s progress at `replica`.
    pub async fn preheat(&self, replica: &str, id: &str) -> Result<PreheatJob, TrackerUnavailable> {
        let url = format!("{replica}{PREHEAT_PATH}/{id}");
        let body = self.exchange(replica, &url, self.http.get(&url)).await?;
        preheat_job(&url, &body)
    }

    /// Whether every replica failed lately (none configured: false).
    pub fn all_down(&self) -> bool {
        self.is_configured() && self.replicas.iter().all(|r| self.is_down(r))
    }

    fn is_down(&self, replica: &str) -> bool {
        let down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        down.get(replica)
            .is_some_and(|until| *until > Instant::now())
    }

    /// Sends a request about `digest` to its owner, failing over along its order.
    pub async fn send_for(
        &self,
        digest: &BlobDigest,
        body: Body,
    ) -> Result<Option<pb::AnnounceResponse>, TrackerUnavailable> {
        let mut errors = Vec::new();
        for replica in self.order(digest) {
            match self.send(replica, body.clone()).await {
                Ok(r) => return Ok(r),
                Err(e) => errors.push(e.0),
            }
        }
        Err(TrackerUnavailable(if errors.is_empty() {
            "no replicas configured".into()
        } else {
            errors.join("; ")
        }))
    }
}

fn preheat_job(url: &str, body: &[u8]) -> Result<PreheatJob, TrackerUnavailable> {
    serde_json::from_slice(body)
        .map_err(|e| TrackerUnavailable(format!("{url}: not a preheat job: {e}")))
}

/// An error and its causes, one sentence: a refused TLS handshake says why
/// only in its causes.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_order_moves_only_the_blobs_of_a_removed_replica() {
        let id = crate::identity::ClusterCa::generate()
            .unwrap()
            .issue("node-a")
            .unwrap();
        let three = TrackerClient::new(
            vec!["https://a".into(), "https://b".into(), "https://c".into()],
            &id,
        );
        let two = TrackerClient::new(vec!["https://a".into(), "https://b".into()], &id);
        let mut owned = HashMap::new();
        for i in 0..300u32 {
            let d = BlobDigest::of(&i.to_be_bytes());
            let before = three.order(&d)[0];
            let after = two.order(&d)[0];
            if before != "https://c" {
                assert_eq!(before, after, "a blob not owned by c moved");
            }
            *owned.entry(before).or_insert(0) += 1;
        }
        assert!(
            owned.values().all(|&n| n > 60),
            "ownership is spread: {owned:?}"
        );
    }
}
