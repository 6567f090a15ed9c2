//! A client for one OCI distribution registry: blob sizes and byte ranges, with
//! the registry's auth flows (anonymous, basic, bearer token) and retries.
//!
//! Range requests let distinct agents fetch distinct chunks of one blob, so the
//! first copy of each chunk enters the cluster once.

use bytes::Bytes;
use dray_protocol::BlobDigest;
use dray_protocol::defaults::registry_retry_after;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue, RANGE, WWW_AUTHENTICATE};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    #[error("registry {registry} sent more than {limit} bytes for {what}; refused")]
    TooLarge {
        registry: String,
        what: String,
        limit: u64,
    },
    #[error(
        "registry {registry} did not send {what} within {limit:?} (registry.range_floor plus its length at registry.range_min_bytes_per_s); given up"
    )]
    TooSlow {
        registry: String,
        what: String,
        limit: Duration,
    },
    #[error("registry {registry}: {what}: {detail}")]
    Http {
        registry: String,
        what: String,
        detail: String,
    },
}

/// How fast a registry must send what is asked of it (`[registry]`): a
/// range read (a registry run's chunk, a proof read) must end within
/// `range_floor` plus its length at `range_min_bytes_per_s`, retries
/// included. A registry, or something in front of it, that trickles a
/// byte now and then (never idle long enough for the read timeout) would
/// otherwise hold the pull, and the disk reserved for it, forever.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// Time every range read gets, whatever its length. Default 30 s.
    #[serde(with = "dray_protocol::settings::duration")]
    pub range_floor: Duration,
    /// The slowest rate a range read may go at past the floor, bytes per
    /// second. Default 64 KiB/s: a 4 MiB chunk gets 94 s.
    pub range_min_bytes_per_s: u64,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            range_floor: Duration::from_secs(30),
            range_min_bytes_per_s: 64 << 10,
        }
    }
}

impl RegistryConfig {
    /// How long a range read of `len` bytes may take.
    pub fn range_deadline(&self, len: u64) -> Duration {
        let rate = self.range_min_bytes_per_s.max(1);
        self.range_floor + Duration::from_secs_f64(len as f64 / rate as f64)
    }
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
    /// The credentials of the clients waiting on a shared pull.
    readers: Option<Arc<Readers>>,
    /// How fast range reads must go.
    config: RegistryConfig,
    /// Whole-blob answers to range requests, left open where the last read
    /// stopped (see [`OpenBodies`]).
    open: Mutex<OpenBodies>,
    /// The registry answered a range request with the whole blob.
    ranges_ignored: AtomicBool,
    /// Called once, when `ranges_ignored` is first set (clients made from
    /// this one call it too): the swarm announces at once, so the tracker
    /// hears it while the first runs' answers still stream.
    on_ranges_ignored: Option<RangesIgnored>,
}

/// What a client calls when it finds its registry ignores `Range`.
pub type RangesIgnored = Arc<dyn Fn() + Send + Sync>;

/// The whole-blob answers (200) a registry that ignores `Range` gave to
/// range reads, each left open where its read stopped, at most
/// [`OpenBodies::MAX`]: the next range of the blob at or past that point
/// continues the stream instead of asking again, which would read the
/// blob from its first byte once more. A registry run reads its chunks in
/// order, so a blob fetched by runs of consecutive chunks costs about one
/// copy per run under way at once, where a request per chunk cost a copy
/// of the blob's prefix per chunk (quadratic in its chunks). Each client
/// has its own (a pull's client carries its readers' credentials): a
/// stream opened with one client's credentials is never read for another.
#[derive(Default)]
struct OpenBodies(Vec<OpenBody>);

/// What a whole-blob answer has not yet used: bytes read from it and not
/// taken, then the rest of its body.
type Rest = (Bytes, reqwest::Response);

struct OpenBody {
    repo: String,
    digest: BlobDigest,
    /// The blob offset of the rest's first byte.
    at: u64,
    rest: Rest,
}

impl OpenBodies {
    /// Open answers kept at most; beyond, the oldest is dropped (and its
    /// connection closed).
    const MAX: usize = 8;

    /// The open answer for the blob that has read the most without passing
    /// `start`, and where it is.
    fn take(&mut self, repo: &str, digest: &BlobDigest, start: u64) -> Option<(Rest, u64)> {
        let k = (0..self.0.len())
            .filter(|&k| {
                let b = &self.0[k];
                b.repo == repo && b.digest == *digest && b.at <= start
            })
            .max_by_key(|&k| self.0[k].at)?;
        let b = self.0.remove(k);
        Some((b.rest, b.at))
    }

    fn keep(&mut self, repo: &str, digest: &BlobDigest, at: u64, rest: Rest) {
        // At the body's end: nothing left to continue.
        if rest.0.is_empty() && rest.1.content_length() == Some(0) {
            return;
        }
        if self.0.len() == Self::MAX {
            self.0.remove(0);
        }
        self.0.push(OpenBody {
            repo: repo.into(),
            digest: *digest,
            at,
            rest,
        });
    }
}

/// How reading a body went wrong.
enum Read {
    /// The connection broke: another attempt may do.
    Cut(RegistryError),
    /// The registry sent what was not asked for.
    Refused(RegistryError),
}

/// Reads a response body of at most `limit` bytes, refusing a longer one
/// from its `Content-Length` or as soon as the stream passes the limit, so
/// no more than `limit` bytes are ever held.
pub async fn read_limited(
    mut resp: reqwest::Response,
    limit: usize,
    registry: &str,
    what: &str,
) -> Result<Bytes, RegistryError> {
    let too_large = || RegistryError::TooLarge {
        registry: registry.into(),
        what: what.into(),
        limit: limit as u64,
    };
    let declared = resp
        .headers()
        .get(reqwest::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|l| l > limit as u64) {
        return Err(too_large());
    }
    // The pieces as they came, joined once the body ended within the limit:
    // a refused body costs no buffer of its own.
    let (mut pieces, mut total) = (Vec::new(), 0);
    while let Some(piece) = resp.chunk().await.map_err(|e| RegistryError::Http {
        registry: registry.into(),
        what: what.into(),
        detail: error_chain(&e),
    })? {
        total += piece.len();
        if total > limit {
            return Err(too_large());
        }
        pieces.push(piece);
    }
    Ok(match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => pieces.concat().into(),
    })
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
            readers: None,
            config: RegistryConfig::default(),
            open: Mutex::default(),
            ranges_ignored: AtomicBool::new(false),
            on_ranges_ignored: None,
        })
    }

    /// This client, calling `f` when it first finds the registry ignores
    /// `Range`.
    pub fn on_ranges_ignored(mut self, f: RangesIgnored) -> Self {
        self.on_ranges_ignored = Some(f);
        self
    }

    /// This client with range reads held to `config`'s pace.
    pub fn with_config(mut self, config: RegistryConfig) -> Self {
        self.config = config;
        self
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

    /// Bytes `[start, start + len)` of a blob, read as they stream in: a
    /// registry that ignores the range (200, the whole blob) is read only up
    /// to the range's end, and that answer is kept open for the blob's next
    /// range ([`OpenBodies`]); a 206 longer than the range, or for another
    /// range, is refused. At most `len` bytes are held, and the whole read,
    /// retries included, ends within the range deadline
    /// ([`RegistryConfig::range_deadline`]).
    pub async fn blob_range(
        &self,
        repo: &str,
        digest: &BlobDigest,
        start: u64,
        len: u64,
    ) -> Result<Bytes, RegistryError> {
        let limit = self.config.range_deadline(len);
        let read = self.blob_range_unbounded(repo, digest, start, len);
        tokio::time::timeout(limit, read).await.unwrap_or_else(|_| {
            Err(RegistryError::TooSlow {
                registry: self.base.clone(),
                what: format!("{digest} bytes={start}-{}", start + len - 1),
                limit,
            })
        })
    }

    fn open_bodies(&self) -> std::sync::MutexGuard<'_, OpenBodies> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn blob_range_unbounded(
        &self,
        repo: &str,
        digest: &BlobDigest,
        start: u64,
        len: u64,
    ) -> Result<Bytes, RegistryError> {
        let range = format!("bytes={start}-{}", start + len - 1);
        let what = format!("{digest} {range}");
        let mut attempt = 0;
        loop {
            let open = self.open_bodies().take(repo, digest, start);
            let reused = open.is_some();
            let (rest, skip) = match open {
                Some((rest, at)) => (rest, start - at),
                None => {
                    attempt += 1;
                    let resp = self
                        .send(repo, digest, reqwest::Method::GET, Some(&range))
                        .await?;
                    let status = resp.status();
                    let skip = match status {
                        StatusCode::PARTIAL_CONTENT => {
                            self.check_partial(&resp, start, len, &what)?;
                            0
                        }
                        StatusCode::OK => {
                            if !self.ranges_ignored.swap(true, Ordering::Relaxed)
                                && let Some(f) = &self.on_ranges_ignored
                            {
                                f();
                            }
                            tracing::debug!(registry = %self.base, %what, "the registry ignored the range; reading its whole-blob answer up to the range, and keeping it open for the next");
                            start
                        }
                        _ => {
                            return Err(RegistryError::Status {
                                registry: self.base.clone(),
                                status,
                                what,
                            });
                        }
                    };
                    ((Bytes::new(), resp), skip)
                }
            };
            let body = match self.read_span(rest, skip, len, &what).await {
                // A whole-blob answer with the range read: kept for the next.
                Ok((b, Some(rest))) => {
                    self.open_bodies().keep(repo, digest, start + len, rest);
                    b
                }
                // A kept answer that ended early or broke (the registry
                // closed an idle connection, say) is no failure of this
                // read: it asks the registry afresh.
                Ok(_) | Err(Read::Cut(_)) if reused => continue,
                Ok((b, _)) => b,
                Err(Read::Cut(e)) => match registry_retry_after(attempt) {
                    Some(wait) => {
                        tracing::debug!(error = %e, attempt, "registry body cut short; retrying");
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                    None => return Err(e),
                },
                Err(Read::Refused(e)) => return Err(e),
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
    }

    /// Refuses a 206 whose length or `Content-Range` is not the range asked.
    fn check_partial(
        &self,
        resp: &reqwest::Response,
        start: u64,
        len: u64,
        what: &str,
    ) -> Result<(), RegistryError> {
        let header = |name| {
            resp.headers()
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
        };
        if let Some(l) = header(reqwest::header::CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok())
            && l > len
        {
            return Err(RegistryError::TooLarge {
                registry: self.base.clone(),
                what: format!("{what} (its Content-Length says {l})"),
                limit: len,
            });
        }
        if let Some(cr) = header(reqwest::header::CONTENT_RANGE) {
            let first = cr
                .strip_prefix("bytes ")
                .and_then(|r| r.split_once('-'))
                .and_then(|(a, _)| a.trim().parse::<u64>().ok());
            if first != Some(start) {
                return Err(RegistryError::Http {
                    registry: self.base.clone(),
                    what: what.into(),
                    detail: format!("answered with another range: Content-Range {cr:?}"),
                });
            }
        }
        Ok(())
    }

    /// Reads `len` bytes of a body after skipping `skip`, starting with
    /// `first` (bytes of it read earlier); a whole-blob answer (200) is
    /// handed back as a [`Rest`] with what it has not used, a 206 is read to
    /// its end and more than `skip + len` bytes from it refused. A broken
    /// connection is worth a retry; a refusal is not.
    async fn read_span(
        &self,
        (first, mut resp): (Bytes, reqwest::Response),
        mut skip: u64,
        len: u64,
        what: &str,
    ) -> Result<(Bytes, Option<Rest>), Read> {
        let partial = resp.status() == StatusCode::PARTIAL_CONTENT;
        let mut buf = bytes::BytesMut::with_capacity(len as usize);
        let mut first = Some(first).filter(|f| !f.is_empty());
        loop {
            let mut piece = match first.take() {
                Some(f) => f,
                None => match resp.chunk().await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(e) => return Err(Read::Cut(self.http_err(what, e))),
                },
            };
            let skipped = skip.min(piece.len() as u64);
            let _ = piece.split_to(skipped as usize);
            skip -= skipped;
            let room = (len - buf.len() as u64) as usize;
            if piece.len() > room && partial {
                return Err(Read::Refused(RegistryError::TooLarge {
                    registry: self.base.clone(),
                    what: what.into(),
                    limit: len,
                }));
            }
            buf.extend_from_slice(&piece.split_to(piece.len().min(room)));
            if buf.len() as u64 == len && !partial {
                return Ok((buf.freeze(), Some((piece, resp))));
            }
        }
        Ok((buf.freeze(), None))
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
    /// A shared pull's client goes through its readers' credentials instead
    /// (see [`Readers`]).
    pub async fn request(
        &self,
        repo: &str,
        path: &str,
        method: reqwest::Method,
        headers: reqwest::header::HeaderMap,
    ) -> Result<reqwest::Response, RegistryError> {
        let url = format!("{}/v2/{repo}/{path}", self.base);
        let what = format!("{method} {repo}/{path}");
        if let Some(readers) = &self.readers {
            return self
                .request_as_readers(readers, repo, &url, &what, method, headers)
                .await;
        }
        let mut auth = self.forwarded.clone().or_else(|| {
            self.cached_auth(repo)
                .and_then(|a| HeaderValue::from_str(&a).ok())
        });
        let mut challenged = false;
        loop {
            let resp = self
                .send_retrying(&url, &what, &method, &headers, auth.as_ref())
                .await?;
            if resp.status() != StatusCode::UNAUTHORIZED {
                return Ok(resp);
            }
            let challenge = resp.headers().get(WWW_AUTHENTICATE).cloned();
            if self.relay_challenges {
                // A client that gave Basic credentials where the registry
                // wants a bearer token has the token flow run for it, once,
                // as its own registry client would.
                let basic = self.forwarded.as_ref().filter(|a| is_basic(a));
                if let Some(basic) = basic.filter(|_| !challenged && is_bearer(&challenge)) {
                    challenged = true;
                    if let Ok(token) = self
                        .bearer_token(repo, challenge.as_ref(), Some(basic), false)
                        .await
                    {
                        auth = Some(token);
                        continue;
                    }
                }
                return Err(RegistryError::Challenge {
                    registry: self.base.clone(),
                    repo: repo.into(),
                    challenge: challenge.and_then(|v| v.to_str().ok().map(str::to_string)),
                });
            }
            if challenged {
                return Ok(resp);
            }
            challenged = true;
            auth = Some(self.answer_challenge(repo, challenge.as_ref()).await?);
        }
    }

    /// A shared pull's request: made with the first waiting reader's
    /// credentials that are still accepted; a refused one (an expired token)
    /// is set aside and the next reader's tried, and a Basic credential (or
    /// an anonymous reader) is exchanged for a fresh bearer token when the
    /// registry asks for one. Fails only when no reader's credentials work.
    async fn request_as_readers(
        &self,
        readers: &Readers,
        repo: &str,
        url: &str,
        what: &str,
        method: reqwest::Method,
        headers: reqwest::header::HeaderMap,
    ) -> Result<reqwest::Response, RegistryError> {
        // Each reader gets one fresh token per request, so this ends.
        let mut minted = std::collections::HashSet::new();
        loop {
            let Some(reader) = readers.current() else {
                return Err(RegistryError::Auth {
                    registry: self.base.clone(),
                    repo: repo.into(),
                    detail: "the credentials of every client waiting for the blob were refused"
                        .into(),
                });
            };
            let resp = self
                .send_retrying(url, what, &method, &headers, reader.send.as_ref())
                .await?;
            if resp.status() != StatusCode::UNAUTHORIZED {
                return Ok(resp);
            }
            let challenge = resp.headers().get(WWW_AUTHENTICATE).cloned();
            let can_mint = reader.header.as_ref().is_none_or(is_basic);
            if can_mint && is_bearer(&challenge) && minted.insert(reader.id) {
                match self
                    .bearer_token(repo, challenge.as_ref(), reader.header.as_ref(), false)
                    .await
                {
                    Ok(token) => {
                        readers.set_token(reader.id, token);
                        continue;
                    }
                    Err(e) => {
                        tracing::info!(error = %e, "a waiting client's credentials got no token")
                    }
                }
            }
            tracing::info!(registry = %self.base, %what, "a waiting client's credentials were refused; going on with the next");
            readers.refuse(reader.id);
        }
    }

    /// Sends one request, retrying broken connections, server errors and
    /// 429 with backoff; the last answer is returned whatever its status.
    async fn send_retrying(
        &self,
        url: &str,
        what: &str,
        method: &reqwest::Method,
        headers: &reqwest::header::HeaderMap,
        auth: Option<&HeaderValue>,
    ) -> Result<reqwest::Response, RegistryError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut req = self
                .http
                .request(method.clone(), url)
                .headers(headers.clone());
            if let Some(a) = auth {
                req = req.header(AUTHORIZATION, a);
            }
            let answer = req.send().await;
            let retry = match &answer {
                Ok(r) => {
                    r.status().is_server_error() || r.status() == StatusCode::TOO_MANY_REQUESTS
                }
                Err(_) => true,
            };
            let wait = match registry_retry_after(attempt) {
                Some(wait) if retry => wait,
                _ => return answer.map_err(|e| self.http_err(what, e)),
            };
            match answer {
                Ok(r) => {
                    tracing::debug!(status = %r.status(), attempt, "registry server error; retrying")
                }
                Err(e) => {
                    tracing::debug!(error = %error_chain(&e), attempt, "registry request failed; retrying")
                }
            }
            tokio::time::sleep(wait).await;
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
            readers: None,
            config: self.config.clone(),
            open: Mutex::default(),
            ranges_ignored: AtomicBool::new(false),
            on_ranges_ignored: self.on_ranges_ignored.clone(),
        }
    }

    /// The same registry for a pull shared by several clients: every
    /// request goes with the credentials of one of `readers` (see
    /// [`Readers`]), never with the agent's own.
    pub fn for_readers(&self, readers: Arc<Readers>) -> RegistryClient {
        RegistryClient {
            http: self.http.clone(),
            base: self.base.clone(),
            credentials: None,
            tokens: Mutex::new(HashMap::new()),
            forwarded: None,
            relay_challenges: false,
            readers: Some(readers),
            config: self.config.clone(),
            open: Mutex::default(),
            ranges_ignored: AtomicBool::new(false),
            on_ranges_ignored: self.on_ranges_ignored.clone(),
        }
    }

    /// Whether the registry answered one of this client's range requests
    /// with the whole blob (it ignores `Range`): the pull says so in its
    /// announces, and the tracker then hands out its runs one at a time,
    /// each to the blob's end, so that each whole answer is read once.
    pub fn ignores_ranges(&self) -> bool {
        self.ranges_ignored.load(Ordering::Relaxed)
    }

    /// The client's own `Authorization` this forwards (see [`Self::for_client`]).
    pub fn forwarded(&self) -> Option<&HeaderValue> {
        self.forwarded.as_ref()
    }

    fn cached_auth(&self, repo: &str) -> Option<String> {
        let tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        tokens.get(&pull_scope(repo)).map(|t| format!("Bearer {t}"))
    }

    /// The Authorization value a `WWW-Authenticate` challenge asks for, from
    /// the agent's own credentials (bearer tokens cached by scope).
    async fn answer_challenge(
        &self,
        repo: &str,
        challenge: Option<&HeaderValue>,
    ) -> Result<HeaderValue, RegistryError> {
        let own = self.credentials.as_ref().map(basic);
        let own = own.and_then(|b| HeaderValue::from_str(&b).ok());
        if is_bearer(&challenge.cloned()) {
            return self.bearer_token(repo, challenge, own.as_ref(), true).await;
        }
        let scheme = challenge.and_then(|v| v.to_str().ok()).unwrap_or_default();
        match parse_challenge(scheme).0.to_ascii_lowercase().as_str() {
            "basic" => own.ok_or_else(|| RegistryError::Auth {
                registry: self.base.clone(),
                repo: repo.into(),
                detail: "the registry requires credentials (basic auth) and none are configured"
                    .into(),
            }),
            _ => Err(RegistryError::Auth {
                registry: self.base.clone(),
                repo: repo.into(),
                detail: format!("unsupported auth challenge {scheme:?}"),
            }),
        }
    }

    /// Runs the bearer token flow a challenge names, presenting `basic` (a
    /// Basic Authorization value) to the token server if given; `cache`
    /// keeps the token for the agent's own later requests. The token server
    /// must be HTTPS unless the registry itself is plain HTTP.
    async fn bearer_token(
        &self,
        repo: &str,
        challenge: Option<&HeaderValue>,
        basic: Option<&HeaderValue>,
        cache: bool,
    ) -> Result<HeaderValue, RegistryError> {
        let auth_err = |detail: String| RegistryError::Auth {
            registry: self.base.clone(),
            repo: repo.into(),
            detail,
        };
        let challenge = challenge.and_then(|v| v.to_str().ok()).unwrap_or_default();
        let (_, params) = parse_challenge(challenge);
        let realm = params
            .get("realm")
            .ok_or_else(|| auth_err(format!("bearer challenge without realm: {challenge:?}")))?;
        if !(realm.starts_with("https://")
            || (realm.starts_with("http://") && self.base.starts_with("http://")))
        {
            return Err(auth_err(format!(
                "token server {realm:?} is not HTTPS, and the registry is"
            )));
        }
        let scope = params
            .get("scope")
            .cloned()
            .unwrap_or_else(|| pull_scope(repo));
        let mut req = self.http.get(realm).query(&[("scope", scope.as_str())]);
        if let Some(service) = params.get("service") {
            req = req.query(&[("service", service.as_str())]);
        }
        if let Some(b) = basic {
            req = req.header(AUTHORIZATION, b);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| auth_err(format!("token request to {realm}: {}", error_chain(&e))))?;
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
        let body = read_limited(resp, MAX_TOKEN_ANSWER, realm, "a token answer").await?;
        let t: Token = serde_json::from_slice(&body)
            .map_err(|e| auth_err(format!("token response from {realm}: {e}")))?;
        let token = t
            .token
            .or(t.access_token)
            .ok_or_else(|| auth_err(format!("token server {realm} sent no token")))?;
        let value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| auth_err(format!("token server {realm} sent an unusable token")))?;
        if cache {
            self.tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(pull_scope(repo), token);
        }
        Ok(value)
    }
}

/// Largest token server answer read (tokens are a few KiB).
const MAX_TOKEN_ANSWER: usize = 1 << 20;

fn is_basic(v: &HeaderValue) -> bool {
    v.as_bytes().len() > 6 && v.as_bytes()[..6].eq_ignore_ascii_case(b"basic ")
}

fn is_bearer(challenge: &Option<HeaderValue>) -> bool {
    challenge.as_ref().is_some_and(|v| {
        v.as_bytes().len() > 7 && v.as_bytes()[..7].eq_ignore_ascii_case(b"bearer ")
    })
}

/// The `Authorization` headers of the clients waiting on one shared pull
/// (each client's access was checked with them first). A pull must not
/// fail for everyone because the credential it happened to use (its first
/// client's bearer token) expired: the request is made again with the next
/// reader's, and a Basic credential, or an anonymous reader, is exchanged
/// for a fresh token whenever the registry asks for one.
#[derive(Default)]
pub struct Readers {
    inner: Mutex<ReaderSet>,
}

#[derive(Default)]
struct ReaderSet {
    next_id: u64,
    entries: Vec<ReaderAuth>,
}

struct ReaderAuth {
    id: u64,
    /// What the client sent; `None`: it sent none.
    header: Option<HeaderValue>,
    /// A bearer token obtained with `header`, sent instead of it.
    token: Option<HeaderValue>,
    /// The registry refused it: not tried again.
    refused: bool,
    /// Its reader left; kept only while no other reader's are.
    left: bool,
}

/// A reader's credentials, as [`Readers::current`] hands them out.
struct Current {
    id: u64,
    header: Option<HeaderValue>,
    send: Option<HeaderValue>,
}

/// Keeps a reader's credentials in its pull while it waits.
pub struct ReaderGuard {
    readers: Arc<Readers>,
    id: u64,
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        let mut set = self.readers.lock();
        // The last one stays, so that a pull whose readers all left (a
        // client that wanted only a range) can still finish filling the store.
        if set.entries.len() > 1 {
            set.entries.retain(|e| e.id != self.id);
        } else if let Some(e) = set.entries.first_mut() {
            e.left = true;
        }
    }
}

impl Readers {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReaderSet> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a reader's `Authorization` (or none), kept until the guard drops.
    pub fn join(self: &Arc<Self>, header: Option<HeaderValue>) -> ReaderGuard {
        let mut set = self.lock();
        set.next_id += 1;
        let id = set.next_id;
        // A leftover of a reader that left goes once another arrives.
        set.entries.retain(|e| !e.left);
        set.entries.push(ReaderAuth {
            id,
            header,
            token: None,
            refused: false,
            left: false,
        });
        ReaderGuard {
            readers: self.clone(),
            id,
        }
    }

    fn current(&self) -> Option<Current> {
        let set = self.lock();
        let e = set.entries.iter().find(|e| !e.refused)?;
        Some(Current {
            id: e.id,
            header: e.header.clone(),
            send: e.token.clone().or_else(|| e.header.clone()),
        })
    }

    fn set_token(&self, id: u64, token: HeaderValue) {
        if let Some(e) = self.lock().entries.iter_mut().find(|e| e.id == id) {
            e.token = Some(token);
        }
    }

    fn refuse(&self, id: u64) {
        if let Some(e) = self.lock().entries.iter_mut().find(|e| e.id == id) {
            e.refused = true;
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

    /// A registry that answers every GET with the whole blob (200), the
    /// first answer cut off after `cut` bytes; counts requests and bytes sent.
    async fn ignoring_ranges(
        blob: Arc<Vec<u8>>,
        cut: usize,
    ) -> (
        String,
        Arc<std::sync::atomic::AtomicUsize>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (requests, sent) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, s) = (requests.clone(), sent.clone());
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                let (blob, r, s) = (blob.clone(), r.clone(), s.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        let mut b = [0u8; 1];
                        if conn.read(&mut b).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(b[0]);
                    }
                    let end = match r.fetch_add(1, Ordering::SeqCst) {
                        0 => cut,
                        _ => blob.len(),
                    };
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        blob.len()
                    );
                    conn.write_all(answer.as_bytes()).await.unwrap();
                    for piece in blob[..end].chunks(100_000) {
                        if conn.write_all(piece).await.is_err() {
                            return;
                        }
                        s.fetch_add(piece.len(), Ordering::SeqCst);
                    }
                });
            }
        });
        (base, requests, sent)
    }

    #[tokio::test]
    async fn a_registry_that_ignores_ranges_is_read_once_not_once_per_chunk() {
        use std::sync::atomic::Ordering;
        const CHUNK: usize = 256 << 10;
        let blob: Arc<Vec<u8>> = Arc::new((0..64 * CHUNK).map(|i| (i % 251) as u8).collect());
        let digest = BlobDigest::of(&blob);
        // The first answer breaks off inside chunk 20: the next read asks afresh.
        let (base, requests, sent) = ignoring_ranges(blob.clone(), 20 * CHUNK + 12_345).await;
        let told = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = told.clone();
        let client = RegistryClient::new(&base, None)
            .unwrap()
            .on_ranges_ignored(Arc::new(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            }));
        assert!(!client.ignores_ranges());
        // Chunks 40-43 came from peers: the run skips them.
        for i in (0..64).filter(|i| !(40..44).contains(i)) {
            let got = client
                .blob_range("r", &digest, (i * CHUNK) as u64, CHUNK as u64)
                .await
                .unwrap();
            assert!(got[..] == blob[i * CHUNK..(i + 1) * CHUNK], "chunk {i}");
        }
        // The read past the skipped chunks continued the same answer.
        assert_eq!(requests.load(Ordering::SeqCst), 2);
        // Every chunk asked afresh read the blob from its first byte: 60
        // chunks cost about 30 copies of it. Now 1.3: the cut answer (20
        // chunks) and one whole answer, read from its start to chunk 20 and
        // on to the end.
        let copies = sent.load(Ordering::SeqCst) as f64 / blob.len() as f64;
        assert!(copies < 2.0, "{copies} copies of the blob sent");
        // The pull's announces say so, the first at once: the tracker hands
        // out one run at a time.
        assert!(client.ignores_ranges());
        assert_eq!(told.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_range_read_gets_the_floor_plus_its_length_at_the_slowest_rate() {
        let default = RegistryConfig::default();
        assert_eq!(default.range_deadline(4 << 20), Duration::from_secs(94));
        assert_eq!(default.range_deadline(0), Duration::from_secs(30));
        let quick = RegistryConfig {
            range_floor: Duration::from_secs(2),
            range_min_bytes_per_s: 1 << 20,
        };
        assert_eq!(quick.range_deadline(2 << 20), Duration::from_secs(4));
    }

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
