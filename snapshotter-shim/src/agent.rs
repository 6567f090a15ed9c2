//! The agent's local API, the shim's only way out: `POST /v1/layers/unpack`
//! over HTTP/1.1 on the agent's unix socket. The agent fetches one layer,
//! unpacks it into a directory that does not exist yet and verifies blob
//! digest and diff ID before it answers; on failure it answers 4xx/5xx with
//! `{"error": ...}` and leaves no directory behind.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::path::{Path, PathBuf};

/// What the shim asks for: one layer of one image, unpacked into `target`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnpackRequest {
    /// The image reference the layer belongs to (`registry/repo:tag@...`).
    pub image_ref: String,
    pub manifest_digest: String,
    /// The compressed blob's digest.
    pub layer_digest: String,
    /// An absolute directory that does not exist yet.
    pub target: PathBuf,
}

/// The agent's answer once the layer is unpacked and verified.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnpackReport {
    pub layer_digest: String,
    pub diff_id: String,
    pub compressed_bytes: u64,
    pub uncompressed_bytes: u64,
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
}

/// Something that unpacks layers: the agent, or a fake in tests.
pub trait LayerSource: Send + Sync + 'static {
    /// Fetches, verifies and unpacks one layer into `request.target`.
    fn unpack(
        &self,
        request: &UnpackRequest,
    ) -> impl Future<Output = Result<UnpackReport, AgentError>> + Send;
}

/// The HTTP client for the agent's unix socket (one connection per layer:
/// calls are few and long).
#[derive(Clone, Debug)]
pub struct AgentClient {
    socket: PathBuf,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
}

impl AgentClient {
    pub fn new(socket: &Path) -> AgentClient {
        AgentClient {
            socket: socket.to_path_buf(),
        }
    }
}

impl LayerSource for AgentClient {
    async fn unpack(&self, request: &UnpackRequest) -> Result<UnpackReport, AgentError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| AgentError::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let connection = tokio::spawn(connection);
        let body = serde_json::to_vec(request)?;
        let http_request = hyper::Request::post("/v1/layers/unpack")
            .header(hyper::header::HOST, "dray-agent")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("a static request is well-formed");
        // No timeout: a large layer takes minutes and the agent bounds its own work.
        let response = sender.send_request(http_request).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        connection.abort();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot HTTP server on a unix socket that records the request and
    /// sends a canned response.
    async fn one_shot(socket: &Path, response: &'static str) -> tokio::task::JoinHandle<String> {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        tokio::spawn(async move {
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
            s.write_all(response.as_bytes()).await.unwrap();
            String::from_utf8(got).unwrap()
        })
    }

    fn request() -> UnpackRequest {
        UnpackRequest {
            image_ref: "127.0.0.1:5000/test/busybox:1".into(),
            manifest_digest: "sha256:m".into(),
            layer_digest: "sha256:l".into(),
            target: "/var/lib/dray/snapshotter/staging/x".into(),
        }
    }

    #[tokio::test]
    async fn the_client_posts_json_and_reads_the_report() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let body = r#"{"layer_digest":"sha256:l","diff_id":"sha256:d","compressed_bytes":10,"uncompressed_bytes":20}"#;
        let response: &'static str = Box::leak(
            format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
                .into_boxed_str(),
        );
        let server = one_shot(&socket, response).await;
        let report = AgentClient::new(&socket).unpack(&request()).await.unwrap();
        assert_eq!(report.diff_id, "sha256:d");
        assert_eq!(report.uncompressed_bytes, 20);
        let sent = server.await.unwrap();
        assert!(
            sent.starts_with("POST /v1/layers/unpack HTTP/1.1\r\n"),
            "{sent}"
        );
        let json = sent.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(
            serde_json::from_str::<UnpackRequest>(json).unwrap(),
            request()
        );
    }

    #[tokio::test]
    async fn an_agent_error_carries_its_message() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let body = r#"{"error":"blob sha256:l failed its digest"}"#;
        let response: &'static str = Box::leak(
            format!(
                "HTTP/1.1 502 Bad Gateway\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_boxed_str(),
        );
        let _server = one_shot(&socket, response).await;
        let e = AgentClient::new(&socket)
            .unpack(&request())
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "agent answered 502: blob sha256:l failed its digest"
        );
        let missing = AgentClient::new(&dir.path().join("none.sock"))
            .unpack(&request())
            .await;
        assert!(matches!(missing, Err(AgentError::Connect { .. })));
    }
}
