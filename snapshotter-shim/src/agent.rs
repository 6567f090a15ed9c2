//! The agent's local API, the shim's only way out: HTTP/1.1 on the agent's
//! unix socket. `POST /v1/layers/describe` gives a layer's size from its
//! manifest; `POST /v1/layers/unpack` has the agent fetch the layer, unpack
//! it into a directory that does not exist yet and verify blob digest and
//! diff ID before it answers; on failure it answers 4xx/5xx with
//! `{"error": ...}` and leaves no directory behind.
//!
//! Every call has a deadline ([`UnpackDeadline`]): a floor, plus the layer's
//! size at the slowest rate waited for. Past it the shim hangs up (the agent
//! abandons the unpack and removes its target) and the `Prepare` falls back
//! to containerd's own pull, as on any other agent failure.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dray_protocol::local_api::{DESCRIBE_PATH, DescribeRequest, LayerDescription, UNPACK_PATH};
pub use dray_protocol::local_api::{UnpackRequest, UnpackResponse};

/// How long the agent may take for one layer: `floor` plus its compressed
/// size at `min_bytes_per_s`. Asking for the size has the floor alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnpackDeadline {
    pub floor: Duration,
    pub min_bytes_per_s: u64,
}

impl UnpackDeadline {
    /// The deadline of a layer of `size` compressed bytes.
    pub fn for_size(&self, size: u64) -> Duration {
        self.floor + Duration::from_secs_f64(size as f64 / self.min_bytes_per_s.max(1) as f64)
    }
}

/// Why the agent could not deliver a layer.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent socket {}: {source}", socket.display())]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("agent request failed: {0}")]
    Http(#[from] hyper::Error),
    #[error("agent answered {status}: {message}")]
    Refused { status: u16, message: String },
    #[error("agent answer is not the expected JSON: {0}")]
    BadAnswer(#[from] serde_json::Error),
    #[error(
        "agent did not {what} layer {layer} within {:.1} s (unpack_deadline_floor, plus the layer's size at unpack_min_bytes_per_s); giving up on it",
        deadline.as_secs_f64()
    )]
    Deadline {
        what: &'static str,
        layer: String,
        deadline: Duration,
    },
}

/// Something that unpacks layers: the agent, or a fake in tests.
pub trait LayerSource: Send + Sync + 'static {
    /// Fetches, verifies and unpacks one layer into `request.target`.
    fn unpack(
        &self,
        request: &UnpackRequest,
    ) -> impl Future<Output = Result<UnpackResponse, AgentError>> + Send;
}

/// The HTTP client for the agent's unix socket (one connection per call:
/// calls are few and long).
#[derive(Clone, Debug)]
pub struct AgentClient {
    socket: PathBuf,
    deadline: UnpackDeadline,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
}

impl AgentClient {
    pub fn new(socket: &Path, deadline: UnpackDeadline) -> AgentClient {
        AgentClient {
            socket: socket.to_path_buf(),
            deadline,
        }
    }

    /// POSTs `request` as JSON to `path` and reads the JSON answer.
    async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        request: &impl Serialize,
    ) -> Result<T, AgentError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| AgentError::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // Aborted with this future: a call past its deadline hangs up.
        let connection = AbortOnDrop(tokio::spawn(connection));
        let body = serde_json::to_vec(request)?;
        let http_request = hyper::Request::post(path)
            .header(hyper::header::HOST, "dray-agent")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("a static request is well-formed");
        let response = sender.send_request(http_request).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        drop(connection);
        if !status.is_success() {
            let message = serde_json::from_slice::<ErrorBody>(&bytes)
                .map(|b| b.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).trim().to_string());
            return Err(AgentError::Refused {
                status: status.as_u16(),
                message,
            });
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// `post` of a request about `layer`, given up after `deadline`.
    async fn post_within<T: DeserializeOwned>(
        &self,
        what: &'static str,
        path: &str,
        (layer, request): (&str, &(impl Serialize + Sync)),
        deadline: Duration,
    ) -> Result<T, AgentError> {
        tokio::time::timeout(deadline, self.post(path, request))
            .await
            .unwrap_or_else(|_| {
                Err(AgentError::Deadline {
                    what,
                    layer: layer.to_string(),
                    deadline,
                })
            })
    }
}

/// A task aborted when this is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl LayerSource for AgentClient {
    async fn unpack(&self, request: &UnpackRequest) -> Result<UnpackResponse, AgentError> {
        let layer: LayerDescription = self
            .post_within(
                "describe",
                DESCRIBE_PATH,
                (&request.layer_digest, &DescribeRequest::from(request)),
                self.deadline.floor,
            )
            .await?;
        let deadline = self.deadline.for_size(layer.size);
        self.post_within(
            "unpack",
            UNPACK_PATH,
            (&request.layer_digest, request),
            deadline,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An HTTP server on a unix socket answering one connection per canned
    /// response (`None`: read the request, answer nothing and report whether
    /// the client hung up within 5 s); yields the requests it read.
    async fn server(
        socket: &Path,
        responses: Vec<Option<String>>,
    ) -> tokio::task::JoinHandle<Vec<String>> {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        tokio::spawn(async move {
            let mut requests = Vec::new();
            for response in responses {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                // Headers, then the body announced by Content-Length.
                loop {
                    let n = s.read(&mut buf).await.unwrap();
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_string();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let len: usize = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(|v| v.parse().unwrap())
                            })
                            .unwrap();
                        if body.len() >= len || n == 0 {
                            break;
                        }
                    }
                }
                let mut request = String::from_utf8(got).unwrap();
                match response {
                    Some(r) => s.write_all(r.as_bytes()).await.unwrap(),
                    None => {
                        let eof = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf));
                        let hung_up = matches!(eof.await, Ok(Ok(0)));
                        request.push_str(&format!("\n[client hung up: {hung_up}]"));
                    }
                }
                requests.push(request);
            }
            requests
        })
    }

    fn answer(status: &str, body: &str) -> Option<String> {
        Some(format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ))
    }

    fn request() -> UnpackRequest {
        UnpackRequest {
            image_ref: "127.0.0.1:5000/test/busybox:1".into(),
            manifest_digest: "sha256:m".into(),
            layer_digest: "sha256:l".into(),
            target: "/var/lib/dray/snapshotter/staging/x".into(),
        }
    }

    fn client(socket: &Path, floor_ms: u64) -> AgentClient {
        AgentClient::new(
            socket,
            UnpackDeadline {
                floor: Duration::from_millis(floor_ms),
                min_bytes_per_s: 1 << 20,
            },
        )
    }

    #[test]
    fn the_deadline_is_the_floor_plus_the_size_at_the_slowest_rate() {
        let d = UnpackDeadline {
            floor: Duration::from_secs(60),
            min_bytes_per_s: 4 << 20,
        };
        assert_eq!(d.for_size(0), Duration::from_secs(60));
        assert_eq!(d.for_size(1 << 30), Duration::from_secs(60 + 256));
    }

    #[tokio::test]
    async fn the_client_asks_the_size_then_posts_json_and_reads_the_report() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let described = r#"{"layer_digest":"sha256:l","size":10,"media_type":"application/vnd.oci.image.layer.v1.tar+gzip"}"#;
        let report = r#"{"layer_digest":"sha256:l","diff_id":"sha256:d","compressed_bytes":10,"uncompressed_bytes":20,"seconds":0.5}"#;
        let server = server(
            &socket,
            vec![answer("200 OK", described), answer("200 OK", report)],
        )
        .await;
        let report = client(&socket, 5_000).unpack(&request()).await.unwrap();
        assert_eq!(report.diff_id, "sha256:d");
        assert_eq!(report.uncompressed_bytes, 20);
        let sent = server.await.unwrap();
        let json = |req: &str, path: &str| {
            assert!(
                req.starts_with(&format!("POST {path} HTTP/1.1\r\n")),
                "{req}"
            );
            req.split_once("\r\n\r\n").unwrap().1.to_string()
        };
        let described: DescribeRequest =
            serde_json::from_str(&json(&sent[0], DESCRIBE_PATH)).unwrap();
        assert_eq!(described, DescribeRequest::from(&request()));
        let unpack: UnpackRequest = serde_json::from_str(&json(&sent[1], UNPACK_PATH)).unwrap();
        assert_eq!(unpack, request());
    }

    #[tokio::test]
    async fn an_agent_error_carries_its_message() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let body = r#"{"error":"blob sha256:l failed its digest"}"#;
        let _server = server(&socket, vec![answer("502 Bad Gateway", body)]).await;
        let e = client(&socket, 5_000).unpack(&request()).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "agent answered 502: blob sha256:l failed its digest"
        );
        let missing = client(&dir.path().join("none.sock"), 5_000)
            .unpack(&request())
            .await;
        assert!(matches!(missing, Err(AgentError::Connect { .. })));
    }

    #[tokio::test]
    async fn an_unpack_past_its_deadline_is_given_up_and_the_agent_hung_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        // 1 MiB at 1 MiB/s on top of a 200 ms floor: 1.2 s.
        let described = r#"{"layer_digest":"sha256:l","size":1048576,"media_type":"x"}"#;
        let server = server(&socket, vec![answer("200 OK", described), None]).await;
        let started = std::time::Instant::now();
        let e = client(&socket, 200).unpack(&request()).await.unwrap_err();
        let took = started.elapsed();
        assert!(
            matches!(e, AgentError::Deadline { what: "unpack", .. }),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "agent did not unpack layer sha256:l within 1.2 s (unpack_deadline_floor, plus the layer's size at unpack_min_bytes_per_s); giving up on it"
        );
        assert!(
            (1200..2500).contains(&took.as_millis()),
            "gave up after {took:?}"
        );
        let sent = server.await.unwrap();
        assert!(sent[1].ends_with("[client hung up: true]"), "{}", sent[1]);
    }
}
