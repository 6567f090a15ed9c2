//! The registry mirror: the OCI distribution pull API on localhost, which
//! containerd (through `hosts.toml`) and any other registry client use.
//!
//! Manifests and tag lists are passed through to the upstream registry
//! (chosen by containerd's `?ns=` parameter) with the client's own
//! credentials; a manifest fetched by digest is checked against it. Blobs
//! come from the swarm and are streamed to the client as the verified
//! in-order prefix grows, not after the blob completes.
//!
//! What a read-only OCI distribution endpoint serves, for clients other than
//! containerd too (skopeo, crane, pull-through caches): `GET /v2/` answers
//! `{}` as JSON; `GET /v2/<name>/tags/list` with `n` and `last` is the
//! registry's answer (at most [`MAX_TAG_LIST`] bytes, its `Link` to the next
//! page kept on the mirror); a registry's 4xx on a manifest or a tag list
//! (an unacceptable `Accept`, 403, 404) reaches the client with its status
//! and error body (at most [`MAX_ERROR_BODY`] bytes), so it reads the
//! registry's reason; a blob request of up to [`MAX_RANGES`] ranges is
//! answered 206, a multi-range one as `multipart/byteranges`. Not served:
//! pushes, deletes, the catalog and referrers (a mirror of pulls, read only;
//! the catalog lists what a registry holds, which is not the node's to tell).
//!
//! Access: every request is first made (manifests) or checked with a HEAD
//! (blobs) upstream with the client's own `Authorization` header, and an
//! upstream 401 is handed back with its challenge, so the client authenticates
//! exactly as it would directly and nothing private reaches a client that could
//! not read it upstream. The cost is one HEAD round trip per blob request.
//!
//! Which registries: only those the node is configured to mirror
//! (`mirror.registries`, `mirror.upstreams`, `mirror.default_registry`); a
//! request naming any other `ns` is answered 404 before anything is sent
//! anywhere, so a local client cannot make the agent connect to a host of
//! its choosing, and containerd goes to the registry itself. `*` serves any
//! registry containerd names, reached as containerd would reach it
//! (`https://<ns>`, certificates checked). A blob the node holds, or is
//! pulling, is handed out only to a client whose access check passed at the
//! registry the blob came from, or at another the operator named that proves
//! it holds the same bytes (see [`Pulls::admit`]).
//!
//! When the mirror cannot serve a blob (upstream and swarm both failing for it)
//! it answers 502 before sending any byte, so containerd moves on to the next
//! host in `hosts.toml`, the real registry.

use crate::pull::registry::{RegistryClient, RegistryError};
use crate::pull::{OpenError, OriginError, Pulls};
use crate::serving::image::MAX_MANIFEST;
use crate::serving::metrics::MirrorRequest;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dray_protocol::BlobDigest;
use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// Bytes of a registry's error body passed to a client at most.
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// Bytes of a tag list passed to a client at most (10,000 tags of the
/// longest name fit).
pub const MAX_TAG_LIST: usize = 4 << 20;
/// Tags a client may ask for per page (`n`).
pub const MAX_TAGS_PER_PAGE: u32 = 10_000;
/// Ranges one blob request may name; more are answered 416.
pub const MAX_RANGES: usize = 16;
/// The boundary between the parts of a multi-range answer: blob bytes may
/// hold it, which RFC 9110 allows (a part's length is its Content-Range).
const BOUNDARY: &str = "dray-byteranges-3d6f0b5e9a4c";

/// Mirror settings; every key optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MirrorConfig {
    /// Where the mirror listens; loopback, since containerd runs on the node.
    pub listen: SocketAddr,
    /// Registries served, by the name containerd gives (`ns`), besides those
    /// in `upstreams` and `default_registry`. `"*"`: any well-formed name,
    /// reached at `https://<name>`. Others are answered 404.
    pub registries: Vec<String>,
    /// Upstream base URL by registry name (containerd's `ns`), for registries
    /// not reached at `https://<name>`, e.g. `"127.0.0.1:5000" = "http://127.0.0.1:5000"`.
    pub upstreams: BTreeMap<String, String>,
    /// Registry name used when a request has no `ns` parameter.
    pub default_registry: Option<String>,
}

impl Default for MirrorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:5050".parse().expect("valid address"),
            registries: Vec::new(),
            upstreams: BTreeMap::new(),
            default_registry: None,
        }
    }
}

impl MirrorConfig {
    /// Whether the operator named this registry (not only through `*`).
    pub fn names(&self, registry: &str) -> bool {
        self.registries.iter().any(|r| r == registry)
            || self.upstreams.contains_key(registry)
            || self.default_registry.as_deref() == Some(registry)
    }

    /// Whether the mirror serves requests for `registry`.
    pub fn serves(&self, registry: &str) -> bool {
        self.names(registry)
            || (self.registries.iter().any(|r| r == "*") && is_registry_host(registry))
    }

    /// The upstream base URL for a registry name, as containerd resolves it.
    pub fn upstream(&self, registry: &str) -> String {
        self.upstreams
            .get(registry)
            .cloned()
            .unwrap_or_else(|| crate::serving::containerd::default_server(registry))
    }
}

/// A registry name as containerd passes it in `ns`: `host` or `host:port`,
/// host a DNS name or an IP literal. Nothing that would change the URL
/// (`/`, `@`, `?`, `#`) gets into `https://<ns>`.
fn is_registry_host(name: &str) -> bool {
    let (host, port) = match name.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.ends_with(']') => (h, Some(p)),
        _ => (name, None),
    };
    let port_ok =
        port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host.len() <= 253
                && host.split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                        && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                })
        }
    };
    host_ok && port_ok
}

/// The mirror's shared state.
pub struct Mirror {
    pulls: Arc<Pulls>,
    config: MirrorConfig,
}

/// An error answered in the distribution spec's JSON shape.
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    challenge: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            challenge: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            serde_json::json!({ "errors": [{ "code": self.code, "message": self.message }] });
        let mut resp = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
        if let Some(c) = self.challenge.and_then(|c| HeaderValue::from_str(&c).ok()) {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, c);
        }
        resp
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Challenge {
                challenge, repo, ..
            } => ApiError {
                challenge,
                ..ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "UNAUTHORIZED",
                    format!("authentication required for {repo}"),
                )
            },
            RegistryError::Auth { .. } => {
                ApiError::new(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", e.to_string())
            }
            RegistryError::NotFound { .. } => {
                ApiError::new(StatusCode::NOT_FOUND, "BLOB_UNKNOWN", e.to_string())
            }
            RegistryError::Status { status, .. } if status == reqwest::StatusCode::FORBIDDEN => {
                ApiError::new(StatusCode::FORBIDDEN, "DENIED", e.to_string())
            }
            other => ApiError::new(StatusCode::BAD_GATEWAY, "UNAVAILABLE", other.to_string()),
        }
    }
}

/// Checks a repository name against the distribution spec's grammar.
fn valid_name(name: &str) -> bool {
    let component = |c: &str| {
        let b = c.as_bytes();
        let alnum = |x: &u8| x.is_ascii_lowercase() || x.is_ascii_digit();
        !b.is_empty()
            && alnum(&b[0])
            && alnum(&b[b.len() - 1])
            && b.iter()
                .all(|x| alnum(x) || matches!(x, b'.' | b'_' | b'-'))
            && !c.contains("..")
            && !c.contains("___")
            && !c.contains("._")
            && !c.contains("_.")
    };
    name.len() <= 255 && name.split('/').all(component)
}

/// A tag per the distribution spec.
fn valid_tag(tag: &str) -> bool {
    let b = tag.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|x| x.is_ascii_alphanumeric() || matches!(x, b'_' | b'.' | b'-'))
}

/// What a `/v2/<rest>` path asks for.
enum Target<'a> {
    Manifest { name: &'a str, reference: &'a str },
    Blob { name: &'a str, digest: BlobDigest },
    Tags { name: &'a str },
}

fn invalid_name(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "NAME_INVALID",
        format!("invalid repository name {name:?}"),
    )
}

fn parse_target(rest: &str) -> Result<Target<'_>, ApiError> {
    if let Some(name) = rest.strip_suffix("/tags/list") {
        return match valid_name(name) {
            true => Ok(Target::Tags { name }),
            false => Err(invalid_name(name)),
        };
    }
    let (name, kind, reference) = ["/manifests/", "/blobs/"]
        .iter()
        .filter_map(|k| rest.rsplit_once(k).map(|(n, r)| (n, *k, r)))
        .max_by_key(|(n, _, _)| n.len())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "UNSUPPORTED",
                format!("no such endpoint: /v2/{rest}"),
            )
        })?;
    if !valid_name(name) {
        return Err(invalid_name(name));
    }
    let digest = || {
        reference
            .parse::<BlobDigest>()
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "DIGEST_INVALID", e.to_string()))
    };
    match kind {
        "/blobs/" => Ok(Target::Blob {
            name,
            digest: digest()?,
        }),
        _ if reference.contains(':') => digest().map(|_| Target::Manifest { name, reference }),
        _ if valid_tag(reference) => Ok(Target::Manifest { name, reference }),
        _ => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "TAG_INVALID",
            format!("invalid tag {reference:?}"),
        )),
    }
}

/// `[start, end)` of a single-range `Range` value (`bytes=a-b`, `bytes=a-`,
/// `bytes=-n`) against a blob of `size` bytes, an end past the blob clamped
/// as RFC 9110 says; `None` if malformed or unsatisfiable.
pub fn byte_range(value: &str, size: u64) -> Option<(u64, u64)> {
    let (a, b) = value.strip_prefix("bytes=")?.split_once('-')?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => (size.saturating_sub(n.parse().ok()?), size),
        (a, "") => (a.parse().ok()?, size),
        (a, b) => (
            a.parse().ok()?,
            b.parse::<u64>().ok()?.saturating_add(1).min(size),
        ),
    };
    (start < end && start < size).then_some((start, end))
}

/// The ranges of a request's `Range` header, if any, against `size`: one
/// to [`MAX_RANGES`] of them, each as [`byte_range`] reads it.
fn parse_ranges(h: Option<&HeaderValue>, size: u64) -> Result<Option<Vec<(u64, u64)>>, ApiError> {
    let Some(h) = h else { return Ok(None) };
    let bad = |why: String| ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, "RANGE_INVALID", why);
    let text = h
        .to_str()
        .map_err(|_| bad(format!("range {h:?} is not ASCII")))?;
    let specs = text
        .strip_prefix("bytes=")
        .ok_or_else(|| bad(format!("range {text:?} is not in bytes")))?;
    let count = specs.split(',').count();
    if count > MAX_RANGES {
        return Err(bad(format!(
            "{count} ranges asked for; this mirror answers at most {MAX_RANGES} per request"
        )));
    }
    specs
        .split(',')
        .map(|spec| {
            byte_range(&format!("bytes={}", spec.trim()), size).ok_or_else(|| {
                bad(format!(
                    "unsatisfiable range {:?} for {size} bytes",
                    spec.trim()
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The head of one part of a multi-range answer; every part but the first
/// ends the one before it with a line break.
fn part_head((start, end): (u64, u64), size: u64, first: bool) -> String {
    format!(
        "{}--{BOUNDARY}\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes {start}-{}/{size}\r\n\r\n",
        if first { "" } else { "\r\n" },
        end - 1
    )
}

/// The end of a multi-range answer.
fn multipart_end() -> String {
    format!("\r\n--{BOUNDARY}--\r\n")
}

#[derive(Deserialize)]
struct NsQuery {
    ns: Option<String>,
    /// A tag list's page size and the tag it starts after.
    n: Option<String>,
    last: Option<String>,
}

/// A registry's 4xx answer (a 401 comes back as its challenge instead),
/// passed to the client with its status, content type and error body (at
/// most [`MAX_ERROR_BODY`] bytes): the client reads the registry's own
/// reason, such as a manifest type its `Accept` header leaves out.
async fn refused_upstream(resp: reqwest::Response, registry: &str, what: &str) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_REQUEST);
    let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    match crate::pull::registry::read_limited(resp, MAX_ERROR_BODY, registry, what).await {
        Ok(body) => {
            let mut out = (status, body).into_response();
            if let Some(ct) = content_type {
                out.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            out
        }
        Err(e) => ApiError::new(
            status,
            "UNKNOWN",
            format!("registry {registry} answered {status} for {what}: {e}"),
        )
        .into_response(),
    }
}

impl Mirror {
    pub(crate) fn new(pulls: Arc<Pulls>, config: MirrorConfig) -> Arc<Self> {
        Arc::new(Self { pulls, config })
    }

    /// The router serving the pull API.
    pub(crate) fn router(self: &Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/v2/", axum::routing::get(ping))
            .route("/v2/{*rest}", axum::routing::get(get_or_head))
            .with_state(self.clone())
    }

    fn count(&self, kind: MirrorRequest, resp: &Response) {
        self.pulls
            .swarm()
            .node()
            .metrics()
            .mirror_request(kind, resp.status());
    }

    /// The registry `ns` names (or the default one) and its shared upstream
    /// client; 404 for a registry not served.
    fn upstream<'a>(
        &'a self,
        ns: Option<&'a str>,
    ) -> Result<(&'a str, Arc<RegistryClient>), ApiError> {
        let registry = ns
            .or(self.config.default_registry.as_deref())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "UNSUPPORTED",
                    "no ns parameter and no default registry configured",
                )
            })?;
        if !self.config.serves(registry) {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "NAME_UNKNOWN",
                format!("this mirror does not serve registry {registry:?}; fetch from it directly"),
            ));
        }
        Ok((
            registry,
            self.pulls.upstream(&self.config.upstream(registry))?,
        ))
    }

    async fn manifest(
        &self,
        method: Method,
        ns: Option<&str>,
        headers: &HeaderMap,
        name: &str,
        reference: &str,
    ) -> Result<Response, ApiError> {
        let (registry, shared) = self.upstream(ns)?;
        let client = shared.for_client(headers.get(header::AUTHORIZATION).cloned());
        let mut fwd = reqwest::header::HeaderMap::new();
        for v in headers.get_all(header::ACCEPT) {
            fwd.append(reqwest::header::ACCEPT, v.clone());
        }
        let resp = client
            .request(name, &format!("manifests/{reference}"), method.clone(), fwd)
            .await?;
        let status = resp.status();
        if status.is_client_error() {
            let what = format!("manifest {name}:{reference}");
            return Ok(refused_upstream(resp, client.base(), &what).await);
        }
        if !status.is_success() {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "UNAVAILABLE",
                format!("upstream answered {status} for manifest {name}:{reference}"),
            ));
        }
        let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let upstream_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // Not `content_length()`: for a HEAD response that is the empty body's.
        let length: Option<u64> = resp
            .headers()
            .get(reqwest::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let body = if method == Method::HEAD {
            Bytes::new()
        } else {
            let what = format!("manifest {name}:{reference}");
            crate::pull::registry::read_limited(resp, MAX_MANIFEST, client.base(), &what)
                .await
                .map_err(|e| {
                    tracing::warn!(error = %e, "upstream manifest refused");
                    let code = match e {
                        RegistryError::TooLarge { .. } => "MANIFEST_INVALID",
                        _ => "UNAVAILABLE",
                    };
                    ApiError::new(StatusCode::BAD_GATEWAY, code, e.to_string())
                })?
        };
        let digest = if method == Method::HEAD {
            upstream_digest
        } else {
            let got = BlobDigest::of(&body).to_string();
            if reference.contains(':') && got != reference {
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "MANIFEST_INVALID",
                    format!("upstream manifest hashes to {got}, not {reference}"),
                ));
            }
            if self.config.names(registry) {
                self.vouch_sizes(&body);
            }
            Some(got)
        };
        let mut out = Response::new(Body::from(body.clone()));
        let h = out.headers_mut();
        if let Some(ct) = content_type {
            h.insert(header::CONTENT_TYPE, ct);
        }
        if let Some(d) = digest.and_then(|d| HeaderValue::from_str(&d).ok()) {
            h.insert("docker-content-digest", d);
        }
        let len = if method == Method::HEAD {
            length.unwrap_or(0)
        } else {
            body.len() as u64
        };
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        Ok(out)
    }

    /// Takes the blob sizes of an image manifest whose digest the mirror
    /// checked (its bytes are what the client verifies), from a registry
    /// the operator named: those blobs may reserve that much disk. A
    /// registry admitted only by `*` gets the `max_blob_size` cap instead.
    fn vouch_sizes(&self, body: &[u8]) {
        #[derive(Deserialize)]
        struct Descriptor {
            digest: String,
            size: u64,
        }
        #[derive(Deserialize)]
        struct ImageManifest {
            config: Option<Descriptor>,
            #[serde(default)]
            layers: Vec<Descriptor>,
        }
        let Ok(m) = serde_json::from_slice::<ImageManifest>(body) else {
            return;
        };
        let store = self.pulls.swarm().node().store();
        for d in m.config.iter().chain(&m.layers) {
            if let Ok(digest) = d.digest.parse::<BlobDigest>() {
                store.vouch_size(digest, d.size);
            }
        }
    }

    /// `GET /v2/<name>/tags/list`: the registry's answer, with the client's
    /// credentials, its page (`n`, `last`) checked first.
    async fn tags(
        &self,
        method: Method,
        q: &NsQuery,
        headers: &HeaderMap,
        name: &str,
    ) -> Result<Response, ApiError> {
        let (_, shared) = self.upstream(q.ns.as_deref())?;
        let mut page = Vec::new();
        if let Some(n) = &q.n {
            match n.parse::<u32>() {
                Ok(n) if n <= MAX_TAGS_PER_PAGE => page.push(format!("n={n}")),
                _ => {
                    return Err(ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "PAGINATION_NUMBER_INVALID",
                        format!("n={n:?}: a page is 0 to {MAX_TAGS_PER_PAGE} tags"),
                    ));
                }
            }
        }
        if let Some(last) = &q.last {
            if !valid_tag(last) {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "TAG_INVALID",
                    format!("last={last:?} is not a tag"),
                ));
            }
            page.push(format!("last={last}"));
        }
        let path = match page.is_empty() {
            true => "tags/list".to_string(),
            false => format!("tags/list?{}", page.join("&")),
        };
        let client = shared.for_client(headers.get(header::AUTHORIZATION).cloned());
        let resp = client
            .request(
                name,
                &path,
                method.clone(),
                reqwest::header::HeaderMap::new(),
            )
            .await?;
        let what = format!("the tags of {name}");
        let status = resp.status();
        if status.is_client_error() {
            return Ok(refused_upstream(resp, client.base(), &what).await);
        }
        if !status.is_success() {
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "UNAVAILABLE",
                format!("upstream answered {status} for {what}"),
            ));
        }
        let content_type = resp.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        // The next page's link, on this mirror: a path of the registry's own
        // API, with the client's `ns` kept. Any other link is dropped (it
        // would send the client around the mirror).
        let link = resp
            .headers()
            .get(reqwest::header::LINK)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| mirror_link(v, q.ns.as_deref()));
        let body = match method {
            Method::HEAD => Bytes::new(),
            _ => crate::pull::registry::read_limited(resp, MAX_TAG_LIST, client.base(), &what)
                .await
                .map_err(|e| {
                    ApiError::new(StatusCode::BAD_GATEWAY, "UNAVAILABLE", e.to_string())
                })?,
        };
        let mut out = Response::new(Body::from(body));
        let h = out.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            content_type.unwrap_or(HeaderValue::from_static("application/json")),
        );
        if let Some(link) = link.and_then(|l| HeaderValue::from_str(&l).ok()) {
            h.insert(header::LINK, link);
        }
        Ok(out)
    }

    async fn blob(
        self: &Arc<Self>,
        method: Method,
        ns: Option<&str>,
        headers: &HeaderMap,
        name: &str,
        digest: BlobDigest,
    ) -> Result<Response, ApiError> {
        let (registry, shared) = self.upstream(ns)?;
        let client = shared.for_client(headers.get(header::AUTHORIZATION).cloned());
        // The access check: the client's own credentials must reach the blob upstream.
        let size = client.blob_size(name, &digest).await?;
        // Before any disk is reserved for it: a HEAD's length alone is capped.
        if let Err(e) = self.pulls.swarm().node().store().check_size(&digest, size) {
            tracing::warn!(error = %e, "mirror request refused");
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "SIZE_INVALID",
                e.to_string(),
            ));
        }
        let ranges = parse_ranges(headers.get(header::RANGE), size)?;
        let whole = [(0, size)];
        let parts: &[(u64, u64)] = ranges.as_deref().unwrap_or(&whole);
        let mut resp = if method == Method::HEAD {
            Response::new(Body::empty())
        } else {
            let named = self.config.names(registry);
            let (pull, credentials) = self
                .pulls
                .admit(&client, named, name, digest, size)
                .await
                .map_err(|e| {
                    tracing::warn!(error = %e, "mirror request refused");
                    match e {
                        // Says nothing of where the blob came from.
                        OriginError::Elsewhere { .. } => ApiError::new(
                            StatusCode::NOT_FOUND,
                            "BLOB_UNKNOWN",
                            format!("blob {digest} is not served for this registry by this mirror"),
                        ),
                        OriginError::Store { .. } => {
                            ApiError::new(StatusCode::BAD_GATEWAY, "UNAVAILABLE", e.to_string())
                        }
                    }
                })?;
            let open = |(start, end): (u64, u64)| {
                let (pulls, pull) = (self.pulls.clone(), pull.clone());
                async move {
                    pulls
                        .open(digest, size, start, end, pull)
                        .await
                        .map_err(|e| {
                            let status = match e {
                                OpenError::Unavailable(_) => StatusCode::BAD_GATEWAY,
                                OpenError::Stalled(_) => StatusCode::GATEWAY_TIMEOUT,
                            };
                            ApiError::new(status, "UNAVAILABLE", e.to_string())
                        })
                }
            };
            // Waits for the first verified byte, so a failure is still a 502
            // and the client moves on to the next host.
            let first = open(parts[0]).await?.holding(credentials);
            if parts.len() == 1 {
                Response::new(Body::from_stream(first.into_stream()))
            } else {
                // Each later part opens as the one before it ends; a failure
                // then cuts the body short, as it does a single range.
                let head = |r, first| {
                    let head = part_head(r, size, first).into();
                    futures_util::stream::once(std::future::ready(Ok(head)))
                };
                let mut stream = head(parts[0], true).chain(first.into_stream()).boxed();
                for &range in &parts[1..] {
                    let open = open(range);
                    let part = futures_util::stream::once(async move {
                        open.await
                            .map(|r| r.into_stream())
                            .map_err(|e| std::io::Error::other(e.message))
                    })
                    .try_flatten();
                    stream = stream.chain(head(range, false)).chain(part).boxed();
                }
                let end =
                    futures_util::stream::once(std::future::ready(Ok(multipart_end().into())));
                stream = stream.chain(end).boxed();
                Response::new(Body::from_stream(stream))
            }
        };
        let len = match parts {
            [(a, b)] => b - a,
            _ => {
                let heads: usize = (parts.iter().enumerate())
                    .map(|(i, &r)| part_head(r, size, i == 0).len())
                    .sum();
                let bytes: u64 = parts.iter().map(|(a, b)| b - a).sum();
                heads as u64 + bytes + multipart_end().len() as u64
            }
        };
        *resp.status_mut() = match ranges {
            Some(_) => StatusCode::PARTIAL_CONTENT,
            None => StatusCode::OK,
        };
        let h = resp.headers_mut();
        let content_type = match parts {
            [_] => "application/octet-stream".to_string(),
            _ => format!("multipart/byteranges; boundary={BOUNDARY}"),
        };
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_str(&content_type).expect("ascii"),
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        h.insert(
            "docker-content-digest",
            HeaderValue::from_str(&digest.to_string()).expect("ascii"),
        );
        if let (Some(_), [(a, b)]) = (&ranges, parts) {
            h.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes {a}-{}/{size}", b - 1)).expect("ascii"),
            );
        }
        Ok(resp)
    }
}

/// A registry's `Link: </v2/...>; rel="next"` as a link on this mirror,
/// carrying the client's `ns`; `None` for a link to anywhere else.
fn mirror_link(link: &str, ns: Option<&str>) -> Option<String> {
    let (target, rest) = link.strip_prefix('<')?.split_once('>')?;
    if !target.starts_with("/v2/") || target.contains("://") {
        return None;
    }
    let target = match ns {
        Some(ns) => {
            let sep = if target.contains('?') { '&' } else { '?' };
            format!("{target}{sep}ns={ns}")
        }
        None => target.to_string(),
    };
    Some(format!("<{target}>{rest}"))
}

async fn ping(
    State(mirror): State<Arc<Mirror>>,
    Query(q): Query<NsQuery>,
    headers: HeaderMap,
) -> Response {
    let resp = match mirror.upstream(q.ns.as_deref()) {
        Ok((_, shared)) => match shared
            .for_client(headers.get(header::AUTHORIZATION).cloned())
            .ping()
            .await
        {
            Ok(()) => (
                [
                    ("docker-distribution-api-version", "registry/2.0"),
                    ("content-type", "application/json"),
                ],
                "{}",
            )
                .into_response(),
            Err(e) => ApiError::from(e).into_response(),
        },
        Err(e) => e.into_response(),
    };
    mirror.count(MirrorRequest::Ping, &resp);
    resp
}

async fn get_or_head(
    State(mirror): State<Arc<Mirror>>,
    method: Method,
    Path(rest): Path<String>,
    Query(q): Query<NsQuery>,
    headers: HeaderMap,
) -> Response {
    let (kind, result) = match parse_target(&rest) {
        Ok(Target::Manifest { name, reference }) => (
            MirrorRequest::Manifest,
            mirror
                .manifest(method, q.ns.as_deref(), &headers, name, reference)
                .await,
        ),
        Ok(Target::Blob { name, digest }) => (
            MirrorRequest::Blob,
            mirror
                .blob(method, q.ns.as_deref(), &headers, name, digest)
                .await,
        ),
        Ok(Target::Tags { name }) => (
            MirrorRequest::Tags,
            mirror.tags(method, &q, &headers, name).await,
        ),
        Err(e) => (MirrorRequest::Invalid, Err(e)),
    };
    let mut resp = result.unwrap_or_else(IntoResponse::into_response);
    mirror.count(kind, &resp);
    resp.headers_mut().insert(
        "docker-distribution-api-version",
        HeaderValue::from_static("registry/2.0"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_only_the_registries_it_is_configured_for() {
        let named = MirrorConfig {
            registries: vec!["docker.io".into()],
            upstreams: [("127.0.0.1:5000".into(), "http://127.0.0.1:5000".into())].into(),
            ..Default::default()
        };
        assert!(named.serves("docker.io") && named.serves("127.0.0.1:5000"));
        assert!(!named.serves("evil.example") && !named.serves("127.0.0.1:5001"));
        assert!(!MirrorConfig::default().serves("docker.io"));
        let any = MirrorConfig {
            registries: vec!["*".into()],
            ..Default::default()
        };
        for ok in [
            "ghcr.io",
            "registry.internal:5000",
            "[::1]:5000",
            "10.0.0.1",
        ] {
            assert!(any.serves(ok), "{ok}");
        }
        for bad in [
            "a/b",
            "user@host",
            "h?x=1",
            "h#f",
            "",
            "h:",
            "h:123456",
            "-a.b",
            "[zz]:1",
        ] {
            assert!(!any.serves(bad), "{bad}");
        }
        assert!(!any.names("ghcr.io"), "`*` is not naming a registry");
        assert_eq!(any.upstream("ghcr.io"), "https://ghcr.io");
        assert_eq!(any.upstream("docker.io"), "https://registry-1.docker.io");
    }

    #[test]
    fn parses_names_references_and_ranges_as_the_spec_says() {
        assert!(valid_name("library/busybox") && valid_name("a/b-c/d__e.f") && valid_name("x"));
        assert!(
            !valid_name("Library/x")
                && !valid_name("a//b")
                && !valid_name("-a")
                && !valid_name("a/")
                && !valid_name("a..b")
        );
        assert!(valid_tag("1.2_rc-3") && !valid_tag(".x") && !valid_tag(""));
        assert!(matches!(
            parse_target("a/b/manifests/latest"),
            Ok(Target::Manifest {
                name: "a/b",
                reference: "latest"
            })
        ));
        assert!(matches!(
            parse_target("a/blobs/manifests/x"),
            Ok(Target::Manifest {
                name: "a/blobs",
                ..
            })
        ));
        assert_eq!(
            parse_target("a/blobs/sha256:12").err().map(|e| e.code),
            Some("DIGEST_INVALID")
        );
        assert_eq!(
            parse_target("A/manifests/x").err().map(|e| e.code),
            Some("NAME_INVALID")
        );
        assert_eq!(
            parse_target("a/manifests/bad tag").err().map(|e| e.code),
            Some("TAG_INVALID")
        );
        assert!(matches!(
            parse_target("a/b/tags/list"),
            Ok(Target::Tags { name: "a/b" })
        ));
        assert_eq!(
            parse_target("A/tags/list").err().map(|e| e.code),
            Some("NAME_INVALID")
        );
        assert_eq!(
            parse_target("a/tags").err().map(|e| e.status),
            Some(StatusCode::NOT_FOUND)
        );
        let r = |s: &str| parse_ranges(Some(&HeaderValue::from_str(s).unwrap()), 100);
        assert_eq!(r("bytes=0-9").ok().flatten(), Some(vec![(0, 10)]));
        assert_eq!(r("bytes=90-").ok().flatten(), Some(vec![(90, 100)]));
        assert_eq!(r("bytes=-5").ok().flatten(), Some(vec![(95, 100)]));
        assert_eq!(r("bytes=0-1000").ok().flatten(), Some(vec![(0, 100)]));
        assert_eq!(
            r("bytes=0-9, 20-29,-1").ok().flatten(),
            Some(vec![(0, 10), (20, 30), (99, 100)])
        );
        assert!(r("bytes=100-").is_err() && r("bytes=5-2").is_err() && r("items=0-1").is_err());
        assert!(
            r("bytes=0-9,100-").is_err(),
            "one unsatisfiable range fails all"
        );
        let sixteen = vec!["0-0"; MAX_RANGES].join(",");
        assert!(r(&format!("bytes={sixteen}")).is_ok());
        let e = r(&format!("bytes={sixteen},1-1")).err().unwrap();
        assert_eq!(e.status, StatusCode::RANGE_NOT_SATISFIABLE);
        assert!(e.message.contains("17 ranges"), "{}", e.message);
        assert_eq!(
            mirror_link("</v2/a/tags/list?last=b&n=1>; rel=\"next\"", Some("r:5000")).as_deref(),
            Some("</v2/a/tags/list?last=b&n=1&ns=r:5000>; rel=\"next\"")
        );
        assert_eq!(
            mirror_link("<https://elsewhere/v2/a/tags/list>; rel=\"next\"", None),
            None
        );
    }
}
