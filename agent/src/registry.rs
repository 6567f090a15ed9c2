//! A client for one OCI distribution registry: blob sizes and byte ranges, with
//! the registry's auth flows (anonymous, basic, bearer token) and retries.
//!
//! Range requests let distinct agents fetch distinct chunks of one blob, so the
//! first copy of each chunk enters the cluster once.

use bytes::Bytes;
use dray_protocol::BlobDigest;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue, RANGE, WWW_AUTHENTICATE};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Attempts per request on server errors and broken connections.
const ATTEMPTS: u32 = 5;

/// Why a registry request failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry {registry} refused access to {repo}: {detail}")]
    Auth {
        registry: String,
        repo: String,
        detail: String,
    },
    #[error("registry {registry} asks the client to authenticate for {repo}")]
    Challenge {
        registry: String,
        repo: String,
        challenge: Option<String>,
    },
    #[error("registry {registry} has no blob {digest} in {repo}")]
    NotFound {
        registry: String,
        repo: String,
        digest: BlobDigest,
    },
    #[error("registry {registry} answered {status} for {what}")]
    Status {
        registry: String,
        status: StatusCode,
        what: String,
    },
    #[error("registry {registry}: {what}: {detail}")]
    Http {
        registry: String,
        what: String,
        detail: String,
    },
}

/// Credentials for a registry.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

/// One registry endpoint, e.g. `https://registry.example` or `http://127.0.0.1:5000`.
pub struct RegistryClient {
    http: reqwest::Client,
    base: String,
    credentials: Option<Credentials>,
    /// Bearer tokens by scope.
    tokens: Mutex<HashMap<String, String>>,
    /// A client's Authorization header, forwarded as is (see [`Self::for_client`]).
    forwarded: Option<HeaderValue>,
    /// Hand 401 challenges back to the caller rather than answering them.
    relay_challenges: bool,
}

/// Installs rustls' ring provider as the process default (reqwest needs one);
/// harmless when already done.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl RegistryClient {
    pub fn new(base: &str, credentials: Option<Credentials>) -> Result<Self, RegistryError> {
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| RegistryError::Http {
                registry: base.into(),
                what: "client setup".into(),
                detail: e.to_string(),
            })?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            credentials,
            tokens: Mutex::new(HashMap::new()),
            forwarded: None,
            relay_challenges: false,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The blob's size, from a HEAD request.
    pub async fn blob_size(&self, repo: &str, digest: &BlobDigest) -> Result<u64, RegistryError> {
        let resp = self.send(repo, digest, reqwest::Method::HEAD, None).await?;
        // Not `content_length()`: for a HEAD response that is the (empty) body's length.
        resp.headers()
            .get(reqwest::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .ok_or_else(|| RegistryError::Http {
                registry: self.base.clone(),
                what: format!("HEAD {digest}"),
                detail: "no Content-Length".into(),
            })
    }

    /// Bytes `[start, start + len)` of a blob.
    pub async fn blob_range(
        &self,
        repo: &str,
        digest: &BlobDigest,
        start: u64,
        len: u64,
    ) -> Result<Bytes, RegistryError> {
        let range = format!("bytes={start}-{}", start + len - 1);
        let what = format!("{digest} {range}");
        for attempt in 1..=ATTEMPTS {
            let resp = self
                .send(repo, digest, reqwest::Method::GET, Some(&range))
                .await?;
            let status = resp.status();
            let body = match resp.bytes().await {
                Ok(b) => b,
                Err(e) if attempt < ATTEMPTS => {
                    tracing::debug!(error = %e, attempt, "registry body cut short; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
                Err(e) => return Err(self.http_err(&what, e)),
            };
            // A registry that ignores Range sends the whole blob with 200.
            let body = match status {
                StatusCode::PARTIAL_CONTENT => body,
                StatusCode::OK if body.len() as u64 >= start + len => {
                    body.slice(start as usize..(start + len) as usize)
                }
                _ => {
                    return Err(RegistryError::Status {
                        registry: self.base.clone(),
                        status,
                        what,
                    });
                }
            };
            if body.len() as u64 != len {
                return Err(RegistryError::Http {
                    registry: self.base.clone(),
                    what,
                    detail: format!("{} bytes instead of {len}", body.len()),
                });
            }
            return Ok(body);
        }
        unreachable!("the last attempt returns")
    }

    /// Downloads a whole blob to `path` in one GET, as a client without dray
    /// would, checking its digest; returns its size. The baseline of the benches.
    pub async fn download(
        &self,
        repo: &str,
        digest: &BlobDigest,
        path: &std::path::Path,
    ) -> Result<u64, RegistryError> {
        use sha2::Digest as _;
        use std::io::Write as _;
        let what = format!("GET {digest}");
        let mut resp = self.send(repo, digest, reqwest::Method::GET, None).await?;
        if !resp.status().is_success() {
            return Err(RegistryError::Status {
                registry: self.base.clone(),
                status: resp.status(),
                what,
            });
        }
        let io_err = |e: std::io::Error| RegistryError::Http {
            registry: self.base.clone(),
            what: format!("writing {}", path.display()),
            detail: e.to_string(),
        };
        let mut file = std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(path).map_err(io_err)?,
        );
        let mut sha = sha2::Sha256::new();
        let mut size = 0u64;
        while let Some(bytes) = resp.chunk().await.map_err(|e| self.http_err(&what, e))? {
            sha.update(&bytes);
            file.write_all(&bytes).map_err(io_err)?;
            size += bytes.len() as u64;
        }
        file.flush().map_err(io_err)?;
        let got = BlobDigest::from_bytes(sha.finalize().into());
        if got != *digest {
            return Err(RegistryError::Http {
                registry: self.base.clone(),
                what,
                detail: format!("the blob hashes to {got}"),
            });
        }
        Ok(size)
    }

    fn http_err(&self, what: &str, e: reqwest::Error) -> RegistryError {
        RegistryError::Http {
            registry: self.base.clone(),
            what: what.into(),
            detail: error_chain(&e),
        }
    }

    /// Sends a blob request; a missing blob and refused credentials are errors.
    async fn send(
        &self,
        repo: &str,
        digest: &BlobDigest,
        method: reqwest::Method,
        range: Option<&str>,
    ) -> Result<reqwest::Response, RegistryError> {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(r) = range.and_then(|r| HeaderValue::from_str(r).ok()) {
            headers.insert(RANGE, r);
        }
        let resp = self
            .request(repo, &format!("blobs/{digest}"), method, headers)
            .await?;
        match resp.status() {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Err(RegistryError::Auth {
                registry: self.base.clone(),
                repo: repo.into(),
                detail: match &self.credentials {
                    Some(c) => format!(
                        "credentials of {:?} were not accepted ({})",
                        c.username,
                        resp.status()
                    ),
                    None => format!("{} without credentials", resp.status()),
                },
            }),
            StatusCode::NOT_FOUND => Err(RegistryError::NotFound {
                registry: self.base.clone(),
                repo: repo.into(),
                digest: *digest,
            }),
            _ => Ok(resp),
        }
    }

    /// Sends `method` for `/v2/<repo>/<path>`, answering one auth challenge (or,
    /// for a client's own credentials, handing the challenge back) and retrying
    /// server errors and broken connections. Other statuses are the caller's.
    pub async fn request(
        &self,
        repo: &str,
        path: &str,
        method: reqwest::Method,
        headers: reqwest::header::HeaderMap,
    ) -> Result<reqwest::Response, RegistryError> {
        let url = format!("{}/v2/{repo}/{path}", self.base);
        let what = format!("{method} {repo}/{path}");
        let mut auth = self.forwarded.clone().or_else(|| {
            self.cached_auth(repo)
                .and_then(|a| HeaderValue::from_str(&a).ok())
        });
        let mut challenged = false;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut req = self
                .http
                .request(method.clone(), &url)
                .headers(headers.clone());
            if let Some(a) = &auth {
                req = req.header(AUTHORIZATION, a);
            }
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) if attempt < ATTEMPTS => {
                    tracing::debug!(error = %error_chain(&e), attempt, "registry request failed; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
                Err(e) => return Err(self.http_err(&what, e)),
            };
            match resp.status() {
                StatusCode::UNAUTHORIZED if self.relay_challenges => {
                    return Err(RegistryError::Challenge {
                        registry: self.base.clone(),
                        repo: repo.into(),
                        challenge: resp
                            .headers()
                            .get(WWW_AUTHENTICATE)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string),
                    });
                }
                StatusCode::UNAUTHORIZED if !challenged => {
                    challenged = true;
                    let answer = self
                        .answer_challenge(repo, resp.headers().get(WWW_AUTHENTICATE))
                        .await?;
                    auth = HeaderValue::from_str(&answer).ok();
                }
                s if (s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS)
                    && attempt < ATTEMPTS =>
                {
                    tracing::debug!(status = %s, attempt, "registry server error; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                }
                _ => return Ok(resp),
            }
        }
    }

    /// `GET /v2/`: whether the registry answers, and (with a client's
    /// credentials) whether it asks for authentication.
    pub async fn ping(&self) -> Result<(), RegistryError> {
        let url = format!("{}/v2/", self.base);
        let mut req = self.http.get(&url);
        if let Some(a) = &self.forwarded {
            req = req.header(AUTHORIZATION, a);
        }
        let resp = req.send().await.map_err(|e| self.http_err("GET /v2/", e))?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            StatusCode::UNAUTHORIZED => Err(RegistryError::Challenge {
                registry: self.base.clone(),
                repo: String::new(),
                challenge: resp
                    .headers()
                    .get(WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
            }),
            status => Err(RegistryError::Status {
                registry: self.base.clone(),
                status,
                what: "GET /v2/".into(),
            }),
        }
    }

    /// The same registry with a client's own `Authorization` header: used as is,
    /// and a 401 hands the registry's challenge back instead of answering it, so
    /// the client authenticates exactly as it would directly.
    pub fn for_client(&self, authorization: Option<HeaderValue>) -> RegistryClient {
        RegistryClient {
            http: self.http.clone(),
            base: self.base.clone(),
            credentials: None,
            tokens: Mutex::new(HashMap::new()),
            forwarded: authorization,
            relay_challenges: true,
        }
    }

    fn cached_auth(&self, repo: &str) -> Option<String> {
        let tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        tokens.get(&pull_scope(repo)).map(|t| format!("Bearer {t}"))
    }

    /// Builds the Authorization value a `WWW-Authenticate` challenge asks for.
    async fn answer_challenge(
        &self,
        repo: &str,
        challenge: Option<&HeaderValue>,
    ) -> Result<String, RegistryError> {
        let auth_err = |detail: String| RegistryError::Auth {
            registry: self.base.clone(),
            repo: repo.into(),
            detail,
        };
        let challenge = challenge.and_then(|v| v.to_str().ok()).unwrap_or_default();
        let (scheme, params) = parse_challenge(challenge);
        match scheme.to_ascii_lowercase().as_str() {
            "basic" => {
                let c = self.credentials.as_ref().ok_or_else(|| {
                    auth_err(
                        "the registry requires credentials (basic auth) and none are configured"
                            .into(),
                    )
                })?;
                Ok(basic(c))
            }
            "bearer" => {
                let realm = params.get("realm").ok_or_else(|| {
                    auth_err(format!("bearer challenge without realm: {challenge:?}"))
                })?;
                let scope = params
                    .get("scope")
                    .cloned()
                    .unwrap_or_else(|| pull_scope(repo));
                let mut req = self.http.get(realm).query(&[("scope", scope.as_str())]);
                if let Some(service) = params.get("service") {
                    req = req.query(&[("service", service.as_str())]);
                }
                if let Some(c) = &self.credentials {
                    req = req.header(AUTHORIZATION, basic(c));
                }
                let resp = req.send().await.map_err(|e| {
                    auth_err(format!("token request to {realm}: {}", error_chain(&e)))
                })?;
                if !resp.status().is_success() {
                    return Err(auth_err(format!(
                        "token server {realm} answered {}",
                        resp.status()
                    )));
                }
                #[derive(serde::Deserialize)]
                struct Token {
                    token: Option<String>,
                    access_token: Option<String>,
                }
                let t: Token = resp
                    .json()
                    .await
                    .map_err(|e| auth_err(format!("token response from {realm}: {e}")))?;
                let token = t
                    .token
                    .or(t.access_token)
                    .ok_or_else(|| auth_err(format!("token server {realm} sent no token")))?;
                self.tokens
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(pull_scope(repo), token.clone());
                Ok(format!("Bearer {token}"))
            }
            _ => Err(auth_err(format!(
                "unsupported auth challenge {challenge:?}"
            ))),
        }
    }
}

fn pull_scope(repo: &str) -> String {
    format!("repository:{repo}:pull")
}

fn basic(c: &Credentials) -> String {
    use base64::Engine;
    let raw = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100 << attempt.min(6))
}

/// The error and its causes on one line (reqwest hides the cause otherwise).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Splits `Bearer realm="...",service="...",scope="..."` into scheme and params.
fn parse_challenge(h: &str) -> (String, HashMap<String, String>) {
    let (scheme, rest) = h.trim().split_once(' ').unwrap_or((h.trim(), ""));
    let mut params = HashMap::new();
    let mut rest = rest.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"').unwrap_or(quoted.len());
            (&quoted[..end], quoted.get(end + 1..).unwrap_or(""))
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        params.insert(key, value.to_string());
        rest = next.trim_start_matches(',').trim();
    }
    (scheme.to_string(), params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_and_basic_challenges() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        );
        assert_eq!(s, "Bearer");
        assert_eq!(p["realm"], "https://auth.example/token");
        assert_eq!(p["service"], "registry.example");
        assert_eq!(p["scope"], "repository:a/b:pull");
        let (s, p) = parse_challenge(r#"Basic realm="Registry Realm""#);
        assert_eq!(
            (s.as_str(), p["realm"].as_str()),
            ("Basic", "Registry Realm")
        );
    }
}
