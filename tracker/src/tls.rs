//! The tracker's listeners. Over TLS (the default), every connection's
//! handshake runs in a task of its own under a deadline, at most
//! `max_connections` connections are open at once, and each connection carries
//! the [`Caller`] its client certificate proves: a node or a preheater, by
//! the role the certificate carries (see `dray_protocol::identity`). The plain-HTTP listener exists
//! for `insecure_plain_http` only: its callers are [`Caller::InsecurePlainHttp`].

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_rustls::server::TlsStream;

/// A TLS handshake not done within this is dropped, so a client that opens
/// connections and sends nothing cannot hold the connection slots.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is on the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A node's client certificate signed by the cluster CA, for this peer id.
    Node(String),
    /// A preheater's client certificate signed by the cluster CA, for this
    /// peer id: the preheat API only.
    Preheater(String),
    /// TLS without a usable client certificate: probes and scrapers may read
    /// `/healthz`, `/readyz` and `/metrics`, and agents without a
    /// certificate yet may ask the signer for one; nothing else. Says why.
    Anonymous(String),
    /// The plain-HTTP listener: peer ids are taken from the requests.
    InsecurePlainHttp,
}

/// The peer id a TLS session's client certificate proves, or why there is none.
fn caller_of(conn: &rustls::ServerConnection) -> Caller {
    let Some(leaf) = conn.peer_certificates().and_then(|c| c.first()) else {
        return Caller::Anonymous(
            "the tracker API needs a client certificate signed by the cluster CA, and this connection presented none".into(),
        );
    };
    use dray_protocol::identity::{Role, peer_id_of, role_of};
    let unusable = |e: String| {
        Caller::Anonymous(format!(
            "the client certificate is signed by the cluster CA but is not usable here: {e}"
        ))
    };
    match (role_of(leaf), peer_id_of(leaf)) {
        (Ok(Role::Node), Ok(id)) => Caller::Node(id),
        (Ok(Role::Preheater), Ok(id)) => Caller::Preheater(id),
        (Ok(Role::Tracker), _) => {
            unusable("it is a tracker's, and a tracker is no client of another".into())
        }
        (Err(e), _) | (_, Err(e)) => unusable(e.to_string()),
    }
}

/// A TLS connection holding one of the listener's connection slots.
pub struct Connection {
    tls: TlsStream<TcpStream>,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }
}

/// Accepts TCP connections and hands over those whose TLS handshake finished.
pub struct TlsListener {
    ready: mpsc::Receiver<(Connection, Caller)>,
    local: SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        max_connections: usize,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let tls = tokio_rustls::TlsAcceptor::from(tls);
        let slots = Arc::new(Semaphore::new(max_connections.max(1)));
        let acceptor = tokio::spawn(async move {
            loop {
                // Past the cap, connections wait in the kernel's backlog.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, remote) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors, mostly: wait rather than spin.
                        tracing::warn!(error = %e, "the tracker could not accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let caller = caller_of(tls.get_ref().1);
                            let _ = tx.send((Connection { tls, _slot: slot }, caller)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%remote, error = %e, "TLS handshake with the tracker failed")
                        }
                        Err(_) => {
                            tracing::debug!(%remote, "TLS handshake with the tracker timed out")
                        }
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl Listener for TlsListener {
    type Io = Connection;
    type Addr = Caller;

    async fn accept(&mut self) -> (Connection, Caller) {
        match self.ready.recv().await {
            Some(c) => c,
            // The acceptor ended (only when aborted): serve nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Caller> {
        Ok(Caller::Anonymous(format!("the listener on {}", self.local)))
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Caller {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl Connected<IncomingStream<'_, TcpListener>> for Caller {
    fn connect_info(_: IncomingStream<'_, TcpListener>) -> Self {
        Caller::InsecurePlainHttp
    }
}
