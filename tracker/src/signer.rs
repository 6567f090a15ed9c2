//! The signer: `POST /v1/certificate` issues an agent its certificate, so that
//! the cluster CA's key lives in the tracker only (one Secret), never on a node.
//!
//! A caller sends a certificate signing request (PEM) and, as
//! `Authorization: Bearer`, a Kubernetes projected service-account token. The
//! token is checked with the API server's TokenReview API (as SPIRE's
//! `k8s_psat` attestor does), with the tracker's own service-account token and
//! the cluster's CA bundle. The signer requires: the token authenticated, for
//! the configured audience, of a service account on its allow-list
//! (`nodes`: role node; `preheaters`: role preheater), and for a node the node
//! name a bound token carries in `extra["authentication.kubernetes.io/node-name"]`
//! (Kubernetes 1.30 and later). A node's certificate names that node and
//! nothing else: a request naming another name is refused, and of the request
//! only the public key is used (its self-signature checked). A preheater's
//! names its service account, `<name>.<namespace>`. Certificates are short-lived
//! (`lifetime`, 24 h by default) and carry their role (see
//! `dray_protocol::identity`); agents renew them (`dray_agent::identity::enroll`).
//!
//! Bounded: request bodies and tokens are capped before they are read, at most
//! [`MAX_IN_FLIGHT`] requests are checked at once (the rest are told to retry),
//! and the API server's answers are read up to [`MAX_REVIEW_BYTES`].

use dray_protocol::identity::{Authority, Role};
use dray_protocol::settings::duration;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use dray_protocol::identity::CERTIFICATE_PATH;
/// Longest certificate signing request body (an ECDSA or RSA-4096 request is
/// well under 4 KiB).
pub const MAX_REQUEST_BYTES: usize = 16 << 10;
/// Longest bearer token (a projected token is 1-2 KiB).
pub const MAX_TOKEN_BYTES: usize = 16 << 10;
/// Longest TokenReview answer read from the API server.
pub const MAX_REVIEW_BYTES: usize = 64 << 10;
/// Requests checked at once; more are answered 429.
pub const MAX_IN_FLIGHT: usize = 16;
/// The TokenReview user-info key of the node a bound token's pod runs on.
pub const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";

/// The signer's settings (`[signer]` in the tracker's TOML; absent: off).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SignerConfig {
    /// The cluster CA's private key (PEM); its certificate is the tracker's `ca`.
    pub ca_key: PathBuf,
    /// The Kubernetes API server's base URL.
    pub api_server: String,
    /// The CA bundle the API server's certificate chains to.
    pub api_ca: PathBuf,
    /// The tracker's own service-account token, read again for every review
    /// (the kubelet rotates it); it needs `create` on `tokenreviews`.
    pub api_token: PathBuf,
    /// The audience the agents' projected tokens must be issued for.
    pub audience: String,
    /// Service accounts whose tokens get a node certificate, as
    /// `system:serviceaccount:<namespace>:<name>`.
    pub nodes: Vec<String>,
    /// Service accounts whose tokens get a preheater certificate.
    pub preheaters: Vec<String>,
    /// How long an issued certificate is valid; agents renew it after two
    /// thirds of that.
    #[serde(with = "duration")]
    pub lifetime: Duration,
    /// Longest wait for the API server's answer.
    #[serde(with = "duration")]
    pub review_timeout: Duration,
}

impl Default for SignerConfig {
    fn default() -> Self {
        Self {
            ca_key: "/etc/dray/ca/ca.key".into(),
            api_server: "https://kubernetes.default.svc".into(),
            api_ca: "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt".into(),
            api_token: "/var/run/secrets/kubernetes.io/serviceaccount/token".into(),
            audience: "dray".into(),
            nodes: Vec::new(),
            preheaters: Vec::new(),
            lifetime: Duration::from_secs(24 * 3_600),
            review_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a certificate was not issued; each reads as a sentence to the caller.
#[derive(Debug, thiserror::Error)]
pub enum SignerError {
    #[error("the signer is off: this tracker has no [signer] configured")]
    Off,
    #[error(
        "a certificate request needs a projected service-account token as `Authorization: Bearer`"
    )]
    NoToken,
    #[error("the bearer token is {0} bytes, more than {MAX_TOKEN_BYTES}")]
    TokenTooLarge(usize),
    #[error("the signer is checking {MAX_IN_FLIGHT} requests already: retry shortly")]
    Busy,
    #[error("the token was not accepted: {0}")]
    Unauthenticated(String),
    #[error(
        "the token's service account {0:?} may not get a dray certificate (not in the signer's `nodes` or `preheaters`)"
    )]
    NotAllowed(String),
    #[error(
        "the token of {account:?} names no node ({NODE_NAME_KEY}): agents need a token bound to their pod (Kubernetes 1.30 or later)"
    )]
    NoNodeName { account: String },
    #[error("{0}")]
    Refused(String),
    #[error("the Kubernetes API server's TokenReview failed: {0}")]
    Review(String),
    #[error("configuration: {0}")]
    Config(String),
}

impl SignerError {
    /// The HTTP status the caller gets.
    pub fn status(&self) -> u16 {
        match self {
            SignerError::Off => 404,
            SignerError::NoToken | SignerError::Unauthenticated(_) => 401,
            SignerError::TokenTooLarge(_) => 413,
            SignerError::Busy => 429,
            SignerError::NotAllowed(_) | SignerError::NoNodeName { .. } => 403,
            SignerError::Refused(_) => 403,
            SignerError::Review(_) => 502,
            SignerError::Config(_) => 500,
        }
    }

    /// The refusal reason counted in the tracker's metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SignerError::Review(_) | SignerError::Config(_) | SignerError::Busy => {
                "signer_unavailable"
            }
            _ => "signer_refused",
        }
    }
}

/// What the API server says of a token.
#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct TokenReview {
    status: ReviewStatus,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct ReviewStatus {
    authenticated: bool,
    user: UserInfo,
    audiences: Vec<String>,
    error: String,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct UserInfo {
    username: String,
    extra: std::collections::HashMap<String, Vec<String>>,
}

/// The signer: the CA's key, the API server's client and the allow-lists.
pub struct Signer {
    config: SignerConfig,
    authority: Authority,
    client: reqwest::Client,
    in_flight: tokio::sync::Semaphore,
}

impl Signer {
    /// The signer of `config`, signing with the CA certificate in `ca_cert`.
    pub fn new(config: &SignerConfig, ca_cert: &Path) -> Result<Self, SignerError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p)
                .map_err(|e| SignerError::Config(format!("reading {}: {e}", p.display())))
        };
        let authority = Authority::from_pem(&read(ca_cert)?, &read(&config.ca_key)?)
            .map_err(|e| SignerError::Config(e.to_string()))?;
        if config.nodes.is_empty() && config.preheaters.is_empty() {
            return Err(SignerError::Config(
                "[signer] lists no service account in `nodes` or `preheaters`: it would issue nothing".into(),
            ));
        }
        for account in config.nodes.iter().chain(&config.preheaters) {
            service_account(account).ok_or_else(|| {
                SignerError::Config(format!(
                    "[signer] {account:?} is not system:serviceaccount:<namespace>:<name>"
                ))
            })?;
        }
        let mut roots = rustls::RootCertStore::empty();
        let bundle = read(&config.api_ca)?;
        for cert in rustls_pemfile::certs(&mut bundle.as_bytes()) {
            let cert =
                cert.map_err(|e| SignerError::Config(format!("{}: {e}", config.api_ca.display())))?;
            roots
                .add(cert)
                .map_err(|e| SignerError::Config(format!("{}: {e}", config.api_ca.display())))?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| SignerError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .timeout(config.review_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| SignerError::Config(e.to_string()))?;
        Ok(Self {
            config: config.clone(),
            authority,
            client,
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
        })
    }

    /// Issues a certificate for `csr_pem` to the holder of `token`, valid
    /// from `now` (Unix seconds): its PEM.
    pub async fn issue(&self, token: &str, csr_pem: &str, now: i64) -> Result<String, SignerError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(SignerError::TokenTooLarge(token.len()));
        }
        let Ok(_slot) = self.in_flight.try_acquire() else {
            return Err(SignerError::Busy);
        };
        let review = self.review(token).await?;
        let (peer_id, role) = self.decide(&review)?;
        let pem = self
            .authority
            .sign_request(csr_pem, &peer_id, role, now, self.config.lifetime)
            .map_err(|e| SignerError::Refused(e.to_string()))?;
        tracing::info!(%peer_id, %role, account = %review.status.user.username, "issued a certificate");
        Ok(pem)
    }

    /// Asks the API server about `token`.
    async fn review(&self, token: &str) -> Result<TokenReview, SignerError> {
        let ours = std::fs::read_to_string(&self.config.api_token).map_err(|e| {
            SignerError::Review(format!(
                "reading the tracker's service-account token {}: {e}",
                self.config.api_token.display()
            ))
        })?;
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": { "token": token, "audiences": [self.config.audience] },
        });
        let url = format!(
            "{}/apis/authentication.k8s.io/v1/tokenreviews",
            self.config.api_server.trim_end_matches('/')
        );
        let review = |e: String| SignerError::Review(format!("{url}: {e}"));
        let mut resp = self
            .client
            .post(&url)
            .bearer_auth(ours.trim())
            .json(&body)
            .send()
            .await
            .map_err(|e| review(e.to_string()))?;
        let status = resp.status();
        let mut answer = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| review(e.to_string()))? {
            if answer.len() + chunk.len() > MAX_REVIEW_BYTES {
                return Err(review(format!("an answer over {MAX_REVIEW_BYTES} bytes")));
            }
            answer.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(review(format!(
                "status {status}: {}",
                String::from_utf8_lossy(&answer[..answer.len().min(512)])
            )));
        }
        serde_json::from_slice(&answer).map_err(|e| review(format!("not a TokenReview: {e}")))
    }

    /// The peer id and role a reviewed token earns, or why none.
    fn decide(&self, review: &TokenReview) -> Result<(String, Role), SignerError> {
        let s = &review.status;
        if !s.authenticated {
            return Err(SignerError::Unauthenticated(if s.error.is_empty() {
                "the API server did not authenticate it".into()
            } else {
                s.error.clone()
            }));
        }
        if !s.audiences.contains(&self.config.audience) {
            return Err(SignerError::Unauthenticated(format!(
                "it is not for the audience {:?} (the API server answered {:?})",
                self.config.audience, s.audiences
            )));
        }
        let account = &s.user.username;
        if self.config.nodes.contains(account) {
            let node = match s.user.extra.get(NODE_NAME_KEY).map(Vec::as_slice) {
                Some([node]) => node.clone(),
                _ => {
                    return Err(SignerError::NoNodeName {
                        account: account.clone(),
                    });
                }
            };
            dray_protocol::identity::check_peer_id(&node).map_err(|e| {
                SignerError::Refused(format!("the node name cannot be a peer id: {e}"))
            })?;
            return Ok((node, Role::Node));
        }
        if self.config.preheaters.contains(account) {
            let (namespace, name) = service_account(account).expect("checked at start");
            let id = format!("{name}.{namespace}");
            dray_protocol::identity::check_peer_id(&id).map_err(|e| {
                SignerError::Refused(format!("the service account cannot be a peer id: {e}"))
            })?;
            return Ok((id, Role::Preheater));
        }
        Err(SignerError::NotAllowed(account.clone()))
    }
}

/// The namespace and name of `system:serviceaccount:<namespace>:<name>`.
fn service_account(username: &str) -> Option<(&str, &str)> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (namespace, name) = rest.split_once(':')?;
    (!namespace.is_empty() && !name.is_empty() && !name.contains(':')).then_some((namespace, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer(nodes: &[&str], preheaters: &[&str]) -> SignerConfig {
        SignerConfig {
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            preheaters: preheaters.iter().map(|s| s.to_string()).collect(),
            ..SignerConfig::default()
        }
    }

    fn decide(
        config: &SignerConfig,
        review: serde_json::Value,
    ) -> Result<(String, Role), SignerError> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let signer = Signer {
            config: config.clone(),
            authority: Authority::from_pem(&ca.pem(), &key.serialize_pem()).unwrap(),
            client: reqwest::Client::new(),
            in_flight: tokio::sync::Semaphore::new(1),
        };
        signer.decide(&serde_json::from_value(review).unwrap())
    }

    fn review(
        authenticated: bool,
        user: &str,
        node: Option<&str>,
        audiences: &[&str],
    ) -> serde_json::Value {
        let mut extra = serde_json::Map::new();
        if let Some(n) = node {
            extra.insert(NODE_NAME_KEY.into(), serde_json::json!([n]));
        }
        serde_json::json!({"status": {
            "authenticated": authenticated,
            "user": {"username": user, "extra": extra},
            "audiences": audiences,
        }})
    }

    const AGENT: &str = "system:serviceaccount:dray:dray-agent";
    const CI: &str = "system:serviceaccount:ci:preheat";

    #[test]
    fn a_token_earns_a_name_and_role_only_from_the_allow_lists_and_its_node() {
        let cfg = signer(&[AGENT], &[CI]);
        assert_eq!(
            decide(&cfg, review(true, AGENT, Some("node-1"), &["dray"])).unwrap(),
            ("node-1".to_string(), Role::Node)
        );
        assert_eq!(
            decide(&cfg, review(true, CI, None, &["dray"])).unwrap(),
            ("preheat.ci".to_string(), Role::Preheater)
        );
        let refused = |r| decide(&cfg, r).unwrap_err().to_string();
        assert!(refused(review(false, AGENT, Some("node-1"), &["dray"])).contains("not accepted"));
        assert!(refused(review(true, AGENT, Some("node-1"), &["other"])).contains("audience"));
        assert!(
            refused(review(
                true,
                "system:serviceaccount:dray:default",
                Some("node-1"),
                &["dray"]
            ))
            .contains("may not get a dray certificate")
        );
        assert!(refused(review(true, AGENT, None, &["dray"])).contains("names no node"));
        assert!(
            refused(review(true, AGENT, Some("Node_1"), &["dray"])).contains("cannot be a peer id")
        );
    }

    #[test]
    fn service_accounts_are_namespace_and_name() {
        assert_eq!(service_account(AGENT), Some(("dray", "dray-agent")));
        assert_eq!(service_account("system:serviceaccount:dray"), None);
        assert_eq!(service_account("alice"), None);
    }
}
