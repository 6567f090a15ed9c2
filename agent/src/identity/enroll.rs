//! Enrollment: in signer mode (`[enroll] signer`), the agent obtains its
//! certificate from the tracker's signer (`dray_tracker::signer`) instead of
//! reading one the operator placed, so that no node holds the CA's key.
//!
//! The agent makes a fresh key on the node (it never leaves it), sends a
//! certificate signing request with its projected service-account token
//! (`[enroll] token`, read again for every request: the kubelet rotates it),
//! and writes the certificate and key to `cert` and `key`. The signer names
//! the certificate after the node the token is bound to. The certificate is
//! short-lived: after two thirds of the time it had left when it arrived, the
//! agent asks again with a new key and [`Identity::renew`]s in place: every
//! TLS configuration the agent made (peer plane, DHT, tracker client)
//! presents the new certificate at its next handshake, with no restart.

use crate::agent::Agent;
use crate::config::AgentConfig;
use crate::error::{Error, Result};
use crate::identity::{Identity, enrollment_tls, unix_now};
use crate::serving::metrics::AgentMetrics;
use dray_protocol::identity::CERTIFICATE_PATH;
use dray_protocol::settings::duration;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Longest answer read from the signer (a certificate is about 1 KiB).
const MAX_ANSWER_BYTES: usize = 64 << 10;

/// The signer's settings (`[enroll]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnrollConfig {
    /// Base URL of a tracker replica serving the signer, e.g.
    /// `https://dray-tracker.dray.svc:7880`; empty (the default): off, and
    /// `cert` and `key` are files the operator placed.
    pub signer: String,
    /// The projected service-account token, issued for the signer's audience.
    pub token: PathBuf,
    /// Longest wait for the signer's answer to one request.
    #[serde(with = "duration")]
    pub request_timeout: Duration,
    /// How long a starting agent keeps asking for its first certificate
    /// before it exits (and Kubernetes restarts it).
    #[serde(with = "duration")]
    pub first_timeout: Duration,
}

impl Default for EnrollConfig {
    fn default() -> Self {
        Self {
            signer: String::new(),
            token: "/var/run/secrets/dray/token".into(),
            request_timeout: Duration::from_secs(30),
            first_timeout: Duration::from_secs(300),
        }
    }
}

/// Opens the agent of `cfg` as `dray agent` does: its identity from the
/// signer and kept renewed (`[enroll] signer` set), or from the configured
/// files; counting into `metrics`.
pub async fn open_agent(cfg: &AgentConfig, metrics: Arc<AgentMetrics>) -> Result<Agent> {
    if cfg.enroll.signer.is_empty() {
        let identity = Identity::load(&cfg.cert, &cfg.key, &cfg.ca)?;
        return Agent::open(cfg, identity, metrics);
    }
    let enrollment = Enrollment::new(cfg)?;
    let (identity, renew_at) = enrollment.first().await?;
    let mut agent = Agent::open(cfg, identity.clone(), metrics.clone())?;
    agent.keep_running(tokio::spawn(
        enrollment.renew_forever(identity, renew_at, metrics),
    ));
    Ok(agent)
}

/// What an agent in signer mode needs to ask for certificates.
pub struct Enrollment {
    url: String,
    token: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    ca_pem: String,
    first_timeout: Duration,
    client: reqwest::Client,
}

impl Enrollment {
    pub fn new(cfg: &AgentConfig) -> Result<Self> {
        let e = &cfg.enroll;
        if !e.signer.starts_with("https://") {
            return Err(Error::Config(format!(
                "[enroll] signer {:?} must be an https:// URL: the request carries a token",
                e.signer
            )));
        }
        let ca_pem = std::fs::read_to_string(&cfg.ca)
            .map_err(|err| Error::io(format!("reading {}", cfg.ca.display()), err))?;
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(enrollment_tls(&ca_pem)?)
            .timeout(e.request_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|err| Error::Tls(format!("the signer's client: {err}")))?;
        Ok(Self {
            url: format!("{}{CERTIFICATE_PATH}", e.signer.trim_end_matches('/')),
            token: e.token.clone(),
            cert: cfg.cert.clone(),
            key: cfg.key.clone(),
            ca_pem,
            first_timeout: e.first_timeout,
            client,
        })
    }

    /// Asks the signer for a certificate for a new key; answers the
    /// certificate and key (PEM), written to `cert` and `key`, and when to
    /// renew (Unix seconds): two thirds of the way to its end.
    pub async fn request(&self) -> Result<(String, String, i64)> {
        let failed = |detail: String| Error::Tls(format!("enrolling at {}: {detail}", self.url));
        let token = std::fs::read_to_string(&self.token).map_err(|e| {
            failed(format!(
                "reading the service-account token {}: {e}",
                self.token.display()
            ))
        })?;
        let key = rcgen::KeyPair::generate().map_err(|e| failed(e.to_string()))?;
        // No name at all (rcgen's default common name is one of its own):
        // the signer names the certificate after the token's node.
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let csr = params
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .map_err(|e| failed(e.to_string()))?;
        let mut resp = self
            .client
            .post(&self.url)
            .bearer_auth(token.trim())
            .header(reqwest::header::CONTENT_TYPE, "application/pkcs10")
            .body(csr)
            .send()
            .await
            .map_err(|e| failed(format!("{e:#}")))?;
        let status = resp.status();
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| failed(e.to_string()))? {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(failed(format!("an answer over {MAX_ANSWER_BYTES} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        let body = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            return Err(failed(format!("{status}: {}", body.trim())));
        }
        let key_pem = key.serialize_pem();
        // Checked (it parses, carries a role, matches the key) before it is kept.
        let issued = Identity::from_pem(&body, &key_pem, &self.ca_pem)?;
        let (_, not_after) = issued.validity()?;
        let now = unix_now();
        write_private(&self.key, &key_pem)?;
        write_private(&self.cert, &body)?;
        Ok((body, key_pem, now + (not_after - now).max(0) * 2 / 3))
    }

    /// The agent's first certificate, asked for until one comes or
    /// `first_timeout` passes; and when to renew it.
    pub async fn first(&self) -> Result<(Identity, i64)> {
        let deadline = tokio::time::Instant::now() + self.first_timeout;
        let mut wait = Duration::from_secs(1);
        loop {
            match self.request().await {
                Ok((cert, key, renew_at)) => {
                    let identity = Identity::from_pem(&cert, &key, &self.ca_pem)?;
                    tracing::info!(peer_id = %identity.peer_id, url = %self.url, "enrolled: the signer issued this node's certificate");
                    return Ok((identity, renew_at));
                }
                Err(e) if tokio::time::Instant::now() + wait < deadline => {
                    tracing::warn!(error = %e, retry_in = ?wait, "no certificate from the signer yet");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Renews `identity` at `renew_at` and after each renewal, for as long
    /// as the agent runs; a failed renewal is retried (every tenth of the
    /// time left, between 1 s and 60 s) and logged at warn.
    pub async fn renew_forever(
        self,
        identity: Identity,
        renew_at: i64,
        metrics: Arc<AgentMetrics>,
    ) {
        let mut renew_at = renew_at;
        loop {
            let wait = (renew_at - unix_now()).max(0) as u64;
            tokio::time::sleep(Duration::from_secs(wait)).await;
            let renewed = match self.request().await {
                Ok((cert, key, next)) => identity.renew(&cert, &key).map(|()| next),
                Err(e) => Err(e),
            };
            match renewed {
                Ok(next) => {
                    renew_at = next;
                    if let Ok((not_before, not_after)) = identity.validity() {
                        metrics.certificate_valid(not_before, not_after);
                        tracing::info!(peer_id = %identity.peer_id, not_after, "renewed this node's certificate");
                    }
                }
                Err(e) => {
                    let left = identity.not_after().map_or(0, |end| end - unix_now());
                    let retry = (left / 10).clamp(1, 60);
                    tracing::warn!(error = %e, seconds_left = left, retry_in_s = retry, "could not renew this node's certificate");
                    renew_at = unix_now() + retry;
                }
            }
        }
    }
}

/// Writes `text` to `path` readable by its owner only, beside and renamed,
/// so that a reader never sees half a certificate or key.
fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e| Error::io(format!("writing {}", path.display()), e);
    let tmp = path.with_extension("new");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}
