//! The demo's embedded OCI registry: one image (manifest, config, layers)
//! served with the pull API the agent's `RegistryClient` speaks (`/v2/` ping,
//! HEAD and GET of manifests and blobs, single Range GETs).
//!
//! It counts every byte it sends, in total and per client, and paces them all
//! through one token bucket, as a registry's uplink would be shared by every
//! connection. Clients are told apart by a path prefix: client `i` uses the
//! base URL `http://ADDR/node-i`, so the per-node counts are the registry's
//! own, not the agents' claims.

use super::image::Image;
use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use dray_agent::peer::rate::ByteRate;
use dray_protocol::BlobDigest;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// The repository and tag the image is served as.
pub const REPO: &str = "dray-demo";
pub const TAG: &str = "latest";

/// Bytes read from disk and paced per step of a body.
const PIECE: usize = 128 << 10;

struct Served {
    image: Arc<Image>,
    rate: ByteRate,
    total: AtomicU64,
    by_client: Vec<AtomicU64>,
}

impl Served {
    fn count(&self, client: Option<usize>, n: usize) {
        self.total.fetch_add(n as u64, Ordering::Relaxed);
        if let Some(c) = client.and_then(|c| self.by_client.get(c)) {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

/// The registry, serving on 127.0.0.1 until dropped.
pub struct DemoRegistry {
    addr: SocketAddr,
    served: Arc<Served>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl DemoRegistry {
    /// Serves `image` to `clients` counted clients, sending at most
    /// `bytes_per_s` in all.
    pub async fn start(image: Arc<Image>, clients: usize, bytes_per_s: u64) -> Result<Self> {
        let served = Arc::new(Served {
            image,
            rate: ByteRate::new(Some(bytes_per_s)),
            total: AtomicU64::new(0),
            by_client: (0..clients).map(|_| AtomicU64::new(0)).collect(),
        });
        let app = axum::Router::new()
            .route("/v2/", get(ping))
            .route("/v2/{repo}/manifests/{reference}", get(manifest))
            .route("/v2/{repo}/blobs/{digest}", get(blob))
            .route("/{client}/v2/", get(ping))
            .route(
                "/{client}/v2/{repo}/manifests/{reference}",
                get(client_manifest),
            )
            .route("/{client}/v2/{repo}/blobs/{digest}", get(client_blob))
            .with_state(served.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the demo registry to 127.0.0.1")?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(Self { addr, served, task })
    }

    /// The base URL client `i` uses, so that what it is sent is counted as its.
    pub fn url_for(&self, client: usize) -> String {
        format!("http://{}/node-{client}", self.addr)
    }

    /// Bytes sent so far, to every client.
    pub fn egress(&self) -> u64 {
        self.served.total.load(Ordering::Relaxed)
    }

    /// Bytes sent so far to client `i`.
    pub fn egress_to(&self, client: usize) -> u64 {
        self.served
            .by_client
            .get(client)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

impl Drop for DemoRegistry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An OCI error response.
fn error(status: StatusCode, code: &str, message: String) -> Response {
    let body = serde_json::json!({"errors": [{"code": code, "message": message}]});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn client_index(prefix: &str) -> Option<usize> {
    prefix.strip_prefix("node-")?.parse().ok()
}

async fn ping() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], "{}")
}

async fn manifest(
    State(s): State<Arc<Served>>,
    method: Method,
    Path((repo, reference)): Path<(String, String)>,
) -> Response {
    serve_manifest(&s, None, method, &repo, &reference)
}

async fn client_manifest(
    State(s): State<Arc<Served>>,
    method: Method,
    Path((client, repo, reference)): Path<(String, String, String)>,
) -> Response {
    serve_manifest(&s, client_index(&client), method, &repo, &reference)
}

async fn blob(
    State(s): State<Arc<Served>>,
    method: Method,
    headers: HeaderMap,
    Path((repo, digest)): Path<(String, String)>,
) -> Response {
    serve_blob(s, None, method, &headers, &repo, &digest).await
}

async fn client_blob(
    State(s): State<Arc<Served>>,
    method: Method,
    headers: HeaderMap,
    Path((client, repo, digest)): Path<(String, String, String)>,
) -> Response {
    serve_blob(s, client_index(&client), method, &headers, &repo, &digest).await
}

fn serve_manifest(
    s: &Served,
    client: Option<usize>,
    method: Method,
    repo: &str,
    reference: &str,
) -> Response {
    let image = &s.image;
    if repo != REPO || (reference != TAG && reference != image.manifest_digest.to_string()) {
        return error(
            StatusCode::NOT_FOUND,
            "MANIFEST_UNKNOWN",
            format!("this registry serves {REPO}:{TAG} only, not {repo}:{reference}"),
        );
    }
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        // A manifest is a few hundred bytes: counted, not worth pacing.
        s.count(client, image.manifest_bytes.len());
        Body::from(image.manifest_bytes.clone())
    };
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&image.manifest_media_type).expect("media types are ascii"),
    );
    h.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(image.manifest_bytes.len()),
    );
    h.insert(
        "docker-content-digest",
        HeaderValue::from_str(&image.manifest_digest.to_string()).expect("ascii"),
    );
    resp
}

async fn serve_blob(
    s: Arc<Served>,
    client: Option<usize>,
    method: Method,
    headers: &HeaderMap,
    repo: &str,
    digest: &str,
) -> Response {
    let known = digest
        .parse::<BlobDigest>()
        .ok()
        .filter(|_| repo == REPO)
        .and_then(|d| Some((d, s.image.blob_size(&d)?)));
    let Some((digest, size)) = known else {
        return error(
            StatusCode::NOT_FOUND,
            "BLOB_UNKNOWN",
            format!("no blob {digest} in {repo}"),
        );
    };
    let range = match headers.get(header::RANGE).map(|r| parse_range(r, size)) {
        None => None,
        Some(Some(r)) => Some(r),
        Some(None) => {
            return error(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "RANGE_INVALID",
                format!(
                    "range {:?} does not fit {digest} ({size} bytes)",
                    headers[header::RANGE]
                ),
            );
        }
    };
    let (start, end) = range.unwrap_or((0, size));
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        let path = s.image.blob_path(&digest);
        let mut file = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "UNKNOWN",
                    format!("opening {}: {e}", path.display()),
                );
            }
        };
        if let Err(e) = file.seek(std::io::SeekFrom::Start(start)).await {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "UNKNOWN",
                format!("seeking in {}: {e}", path.display()),
            );
        }
        paced_body(s, client, file.take(end - start))
    };
    let mut resp = Response::new(body);
    if range.is_some() {
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        resp.headers_mut().insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&format!("bytes {start}-{}/{size}", end - 1)).expect("ascii"),
        );
    }
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(end - start));
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(
        "docker-content-digest",
        HeaderValue::from_str(&digest.to_string()).expect("ascii"),
    );
    resp
}

/// `[start, end)` of a `Range` header, parsed as the agent's mirror does.
fn parse_range(h: &HeaderValue, size: u64) -> Option<(u64, u64)> {
    dray_agent::serving::mirror::byte_range(h.to_str().ok()?, size)
}

/// A body that reads `reader` piece by piece, waiting for the shared token
/// bucket before each piece and counting it as sent.
fn paced_body(
    s: Arc<Served>,
    client: Option<usize>,
    reader: tokio::io::Take<tokio::fs::File>,
) -> Body {
    let stream = futures_util::stream::unfold((s, reader), move |(s, mut reader)| async move {
        let mut buf = vec![0u8; PIECE];
        let n = match reader.read(&mut buf).await {
            Ok(0) => return None,
            Ok(n) => n,
            Err(e) => return Some((Err(e), (s, reader))),
        };
        buf.truncate(n);
        s.rate.take(n).await;
        s.count(client, n);
        Some((Ok(bytes::Bytes::from(buf)), (s, reader)))
    });
    Body::from_stream(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_single_and_within_the_blob() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(parse_range(&h("bytes=0-9"), 100), Some((0, 10)));
        assert_eq!(parse_range(&h("bytes=90-"), 100), Some((90, 100)));
        assert_eq!(parse_range(&h("bytes=100-120"), 100), None);
        assert_eq!(parse_range(&h("bytes=0-1,5-6"), 100), None);
        assert_eq!(client_index("node-7"), Some(7));
        assert_eq!(client_index("v3"), None);
    }
}
