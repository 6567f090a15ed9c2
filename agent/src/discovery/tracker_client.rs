//! Talking to the tracker replicas. Each blob has an owner among the replicas,
//! chosen by rendezvous hashing of its digest: every agent computes the same
//! owner with no coordination, and when the owner is unreachable the next
//! replica in that blob's order takes over (and rebuilds its state from the full
//! announces that follow).
//!
//! A replica is down for routing for a while after a request to it failed;
//! for a pull deciding whether the DHT stands in ([`TrackerClient::all_down`])
//! it stays down until it answers again, and a replica whose request has
//! been outstanding for [`HUNG_AFTER`] counts as down at once. A tracker
//! that hangs (a stopped process: connections accepted, nothing answered)
//! otherwise held every pull for the request's whole timeout and then
//! flapped back to "up" between retries, so each node's tracker-silence
//! fallback fetched from the registry alone before the DHT took over (2.4
//! to 3.2 copies of the blob for 4 to 8 nodes, issue 36).
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

/// A request outstanding this long means its replica hangs. An announce's
/// answer takes milliseconds; this is half the default
/// `swarm.tracker_grace`, so the DHT stands in before a pull's
/// tracker-silence fallback would go to the registry.
pub const HUNG_AFTER: Duration = Duration::from_millis(1_500);

/// What the client knows of one replica's health.
#[derive(Default)]
struct Health {
    /// Skipped for routing until then, after a failure.
    down_until: Option<Instant>,
    /// Its last request failed and none has succeeded since.
    failing: bool,
    /// Requests outstanding, by number, with when each was sent.
    pending: HashMap<u64, Instant>,
}

impl Health {
    fn hung(&self, now: Instant) -> bool {
        self.pending
            .values()
            .any(|sent| now.saturating_duration_since(*sent) >= HUNG_AFTER)
    }
}

/// A request outstanding at a replica, for as long as it lives.
struct Pending<'a> {
    client: &'a TrackerClient,
    replica: &'a str,
    id: u64,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.client.health().get_mut(self.replica) {
            h.pending.remove(&self.id);
        }
    }
}

/// Why no replica answered.
#[derive(Debug, thiserror::Error)]
#[error("no tracker replica answered: {0}")]
pub struct TrackerUnavailable(pub String);

/// HTTP client for the tracker replicas.
pub struct TrackerClient {
    http: reqwest::Client,
    replicas: Vec<String>,
    health: Mutex<HashMap<String, Health>>,
    next_request: std::sync::atomic::AtomicU64,
}

impl TrackerClient {
    /// `replicas` are base URLs such as `https://tracker-0.dray:7880`;
    /// `identity` is the node's certificate, presented to them.
    pub fn new(replicas: Vec<String>, identity: &Identity) -> Self {
        crate::pull::registry::install_crypto_provider();
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
            health: Mutex::new(HashMap::new()),
            next_request: Default::default(),
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, HashMap<String, Health>> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a request to `replica` as outstanding until the guard drops.
    fn pending<'a>(&'a self, replica: &'a str) -> Pending<'a> {
        let id = self
            .next_request
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.health()
            .entry(replica.to_string())
            .or_default()
            .pending
            .insert(id, Instant::now());
        Pending {
            client: self,
            replica,
            id,
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
        let mut health = self.health();
        let h = health.entry(replica.to_string()).or_default();
        h.down_until = Some(Instant::now() + DOWN_FOR);
        h.failing = true;
    }

    fn mark_answered(&self, replica: &str) {
        self.health()
            .entry(replica.to_string())
            .or_default()
            .failing = false;
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
        let _pending = self.pending(replica);
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
        match &result {
            Err((false, _)) => self.mark_down(replica),
            // A refusal is an answer.
            _ => self.mark_answered(replica),
        }
        result.map_err(|(_, e)| TrackerUnavailable(e))
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

    /// Whether no replica answers now (none configured: false): each one's
    /// last request failed with none answered since, or one has been
    /// outstanding for [`HUNG_AFTER`].
    pub fn all_down(&self) -> bool {
        let now = Instant::now();
        let health = self.health();
        self.is_configured()
            && self.replicas.iter().all(|r| {
                health
                    .get(r)
                    .is_some_and(|h| h.failing || h.hung(now) || h.down_until > Some(now))
            })
    }

    /// Whether `replica` is skipped for routing now: it failed within
    /// [`DOWN_FOR`], or it hangs.
    fn is_down(&self, replica: &str) -> bool {
        let now = Instant::now();
        self.health()
            .get(replica)
            .is_some_and(|h| h.down_until > Some(now) || h.hung(now))
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

    #[tokio::test]
    async fn a_replica_that_accepts_and_never_answers_is_down_once_a_request_hangs_until_it_answers()
     {
        // A stopped tracker's kernel still accepts connections; nothing answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let replica = format!("https://{}", listener.local_addr().unwrap());
        let _held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                conns.push(c);
            }
        });
        let id = crate::identity::ClusterCa::generate()
            .unwrap()
            .issue("node-a")
            .unwrap();
        let client = std::sync::Arc::new(TrackerClient::new(vec![replica.clone()], &id));
        assert!(!client.all_down(), "never asked: not down");
        let c = client.clone();
        let leave = Body::Leave(pb::Leave {
            peer_id: "node-a".into(),
        });
        let request = tokio::spawn(async move { c.send(&replica, leave).await });
        tokio::time::sleep(HUNG_AFTER / 3).await;
        assert!(!client.all_down(), "a request just sent is no hang");
        tokio::time::sleep(HUNG_AFTER).await;
        assert!(client.all_down(), "a request outstanding past HUNG_AFTER");
        assert!(request.await.unwrap().is_err(), "the request times out");
        tokio::time::sleep(DOWN_FOR).await;
        assert!(
            client.all_down(),
            "a replica whose last request failed stays down for the DHT until it answers"
        );
    }
}
