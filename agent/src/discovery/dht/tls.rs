//! The DHT's security upgrade: mutual TLS 1.3 against the cluster CA, the same
//! check as the peer plane's, in place of libp2p's self-signed TLS. A node
//! whose certificate the CA did not sign, or one that is not a node's (the
//! tracker's allows no client authentication), fails the handshake, so it can
//! neither join the DHT nor publish a record in it.
//!
//! A node's libp2p [`PeerId`] is the SHA-256 multihash of its dray peer id
//! (the certificate's name, see [`crate::identity`]): the handshake proves
//! it, and any member can compute it from the name.

use crate::identity::{Identity, peer_id_of};
use libp2p::PeerId;
use libp2p::core::UpgradeInfo;
use libp2p::core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};
use libp2p::futures::future::BoxFuture;
use libp2p::futures::{AsyncRead, AsyncWrite, FutureExt};
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::ServerName;
use sha2::Digest;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// The protocol name the upgrade is negotiated under.
const PROTOCOL: &str = "/dray/cluster-tls/1";

/// The libp2p id of the node whose certificate names `peer_id`.
pub fn libp2p_id(peer_id: &str) -> PeerId {
    let digest = sha2::Sha256::digest(peer_id.as_bytes());
    let hash = libp2p::multihash::Multihash::<64>::wrap(0x12, &digest)
        .expect("a SHA-256 digest fits a multihash");
    PeerId::from_multihash(hash).expect("SHA-256 multihashes are peer ids")
}

/// Mutual TLS against the cluster CA, as a libp2p security upgrade; the
/// streams it makes count their bytes.
#[derive(Clone)]
pub struct ClusterTls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    /// Bytes read and written, inside TLS.
    traffic: (Counter, Counter),
}

impl ClusterTls {
    pub fn new(identity: &Identity, traffic: (Counter, Counter)) -> crate::error::Result<Self> {
        Ok(Self {
            server: Arc::new(identity.dht_server_tls()?),
            client: Arc::new(identity.dht_client_tls()?),
            traffic,
        })
    }

    fn counted<S>(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            read: self.traffic.0.clone(),
            written: self.traffic.1.clone(),
        }
    }
}

/// A stream that counts the bytes read from and written to it.
pub struct Counted<S> {
    inner: S,
    read: Counter,
    written: Counter,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.read.inc_by(n as u64);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.written.inc_by(n as u64);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// Why a DHT handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("TLS handshake with a DHT node failed: {0}")]
    Handshake(#[from] std::io::Error),
    #[error("a DHT node's certificate: {0}")]
    Certificate(String),
}

/// The libp2p id proven by a finished handshake.
fn proven_id(state: &rustls::CommonState) -> Result<PeerId, UpgradeError> {
    let leaf = state
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or_else(|| UpgradeError::Certificate("none presented".into()))?;
    let name = peer_id_of(leaf).map_err(|e| UpgradeError::Certificate(e.to_string()))?;
    Ok(libp2p_id(&name))
}

impl UpgradeInfo for ClusterTls {
    type Info = &'static str;
    type InfoIter = std::iter::Once<Self::Info>;

    fn protocol_info(&self) -> Self::InfoIter {
        std::iter::once(PROTOCOL)
    }
}

impl<C> InboundConnectionUpgrade<C> for ClusterTls
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, Counted<futures_rustls::TlsStream<C>>);
    type Error = UpgradeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            let stream = futures_rustls::TlsAcceptor::from(self.server.clone())
                .accept(socket)
                .await?;
            let id = proven_id(stream.get_ref().1)?;
            Ok((id, self.counted(stream.into())))
        }
        .boxed()
    }
}

impl<C> OutboundConnectionUpgrade<C> for ClusterTls
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, Counted<futures_rustls::TlsStream<C>>);
    type Error = UpgradeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_outbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            // The dialler may not know whom it reaches (a bootstrap address):
            // the verifier accepts any member, and libp2p checks the proven
            // id against the one dialled when there is one.
            let name = ServerName::try_from("dht.dray.invalid").expect("a valid DNS name");
            let stream = futures_rustls::TlsConnector::from(self.client.clone())
                .connect(name, socket)
                .await?;
            let id = proven_id(stream.get_ref().1)?;
            Ok((id, self.counted(stream.into())))
        }
        .boxed()
    }
}
