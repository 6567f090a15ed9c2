//! The peer plane: one QUIC endpoint per agent that serves verified chunks to
//! other agents and fetches chunks from them.
//!
//! Connections use mutual TLS against the cluster CA ([`crate::identity`]). The
//! first stream of a connection carries a `Hello` each way (protocol version and
//! peer id, which must match the certificate). Every later stream is one request:
//! a `ChunkRequest` answered by a `PieceHeader` and the raw chunk bytes per chunk,
//! or a `BitfieldRequest` answered by a `Bitfield`; a `Reject` ends either.
//! A bitfield request may be a long poll ([`PeerNode::bitfield_after`]): the
//! server holds the answer until it stores a chunk beyond what the asker has
//! seen (or the blob completes or fails, or the capped wait ends), so a
//! downloader learns of a peer's new chunk when it lands, as from a
//! BitTorrent HAVE, while every exchange stays one request and one answer.
//! Without a tracker to vouch for chunk hashes (a swarm found through the
//! DHT), a bitfield request may also ask for the hashes of the held chunks
//! the asker lacks ([`PeerNode::bitfield_with_hashes`]): the holder's word,
//! which the blob's digest checks at the end.
//! Chunk bytes travel raw after their header, not inside protobuf frames, so the
//! receiver reads them straight into the buffer it hashes and writes.

mod client;
pub mod rate;
mod server;
pub mod udp;

use crate::error::{Error, Result};
use crate::identity::{Identity, connection_peer_id};
use crate::peer::rate::ByteRate;
use crate::serving::metrics::AgentMetrics;
use crate::store::ChunkStore;
use bytes::Bytes;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::framing::{self, FrameError, MAX_PEER_FRAME, PeerRequest};
use dray_protocol::identity::Role;
use dray_protocol::pb::{self, peer_message::Body, reject::Reason};
use dray_protocol::{BlobDigest, PROTOCOL_VERSION};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, TryAcquireError};

/// Bytes of a chunk sent per take from the upload budget: small against a
/// chunk, so a capped upload streams instead of starting late.
const PACE_SLICE: usize = 64 << 10;

pub use dray_protocol::pull::deadline::MIN_CHUNK_DEADLINE;

/// QUIC transport settings for the peer plane. The defaults are the measured
/// best on this project's benchmark (see `dray bench peer`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportTuning {
    /// Per-stream flow-control window, bytes.
    pub stream_window: u32,
    /// Per-connection receive and send windows, bytes.
    pub connection_window: u32,
    /// Largest UDP payload MTU discovery may reach (loopback and jumbo-frame
    /// links allow far more than 1500-byte Ethernet).
    pub max_udp_payload: u16,
    /// Let the kernel segment large sends (GSO) and coalesce receives (GRO).
    pub segmentation_offload: bool,
    /// UDP socket send and receive buffers, bytes. The kernel default (about
    /// 200 KiB) holds three 64 KiB datagrams; a burst beyond that is dropped and
    /// retransmitted.
    pub socket_buffer: u32,
}

impl Default for TransportTuning {
    fn default() -> Self {
        Self {
            stream_window: 16 << 20,
            connection_window: 64 << 20,
            max_udp_payload: 65_527,
            segmentation_offload: true,
            socket_buffer: 8 << 20,
        }
    }
}

impl TransportTuning {
    fn transport(&self) -> Arc<quinn::TransportConfig> {
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(quinn::VarInt::from_u32(self.stream_window))
            .receive_window(quinn::VarInt::from_u32(self.connection_window))
            .send_window(u64::from(self.connection_window))
            .max_concurrent_bidi_streams(quinn::VarInt::from_u32(256))
            .max_concurrent_uni_streams(quinn::VarInt::from_u32(0))
            .keep_alive_interval(Some(Duration::from_secs(5)))
            .max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
                30_000,
            ))))
            .enable_segmentation_offload(self.segmentation_offload);
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.max_udp_payload);
        t.mtu_discovery_config(Some(mtu));
        Arc::new(t)
    }
}

/// Peer-plane settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerConfig {
    /// Upload limit in bytes per second; unset means unlimited.
    pub upload_bytes_per_s: Option<u64>,
    /// Download limit in bytes per second; unset means unlimited.
    pub download_bytes_per_s: Option<u64>,
    /// Chunk requests served at once; more are answered `BUSY`. Few uploads
    /// at full speed beat many sharing a link until each one times out, and
    /// finish (so can be forwarded) sooner (figures: `docs/results.md`).
    pub max_uploads: usize,
    /// Chunk requests in flight at once per blob transfer, over all peers.
    pub max_downloads: usize,
    /// Peers a swarm transfer fetches from at once. Each costs a connection,
    /// its request lanes and a long-polled bitfield that the peer must answer
    /// at every chunk it gains; the tracker names new peers at every announce.
    /// When it names one past this many, the oldest is retired (after the
    /// chunks it is sending; `dray_protocol::peers`): nearly as good as no
    /// cap, where keeping the first ones is not (figures: `docs/results.md`).
    /// Fetches from a fixed list of peers are not capped.
    pub max_peers_per_blob: usize,
    /// Long-polled bitfield requests (watchers) held open at once per blob;
    /// more are answered `BUSY` and the asker retires this peer, to hear of
    /// others at its next announce. A swarm's first holders are named to
    /// almost everyone, and each watcher is a stream to answer at every
    /// chunk the node gains (figures: `docs/results.md`).
    pub max_watchers_per_blob: usize,
    /// A request unanswered, or a chunk transfer that moves no byte, for this
    /// long is abandoned.
    #[serde(with = "dray_protocol::settings::duration")]
    pub request_timeout: Duration,
    /// The slowest rate, bytes per second, a chunk is waited for, both ways.
    /// Downloading, until a transfer has seen how fast its peers send (see
    /// `fetch`), a chunk request gets its length at this rate (at least
    /// [`MIN_CHUNK_DEADLINE`]) plus `request_timeout`. Serving, a chunk holds an upload slot for at most its length
    /// at this rate plus `request_timeout`, so a requester that does not read
    /// cannot keep a slot. 256 KiB/s: 16 s for a 4 MiB chunk, a tenth of the
    /// per-upload share of a 100 Mbit/s link serving 8 uploads.
    pub min_chunk_bytes_per_s: u64,
    /// Connections accepted at once from one peer id; one more is closed at
    /// its handshake, naming the cap. A node dials a peer once per blob it
    /// pulls from it (an image pulls its layers at once).
    pub max_connections_per_peer: usize,
    /// Connections open at once, dialled and accepted; an incoming one past
    /// this is refused before its handshake. Each may hold up to
    /// `transport.connection_window` bytes of a peer's data in flight.
    pub max_connections: usize,
    pub transport: TransportTuning,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            upload_bytes_per_s: None,
            download_bytes_per_s: None,
            max_uploads: DEFAULTS.max_uploads,
            max_downloads: DEFAULTS.max_downloads,
            max_peers_per_blob: DEFAULTS.max_peers_per_blob,
            max_watchers_per_blob: DEFAULTS.max_watchers_per_blob,
            request_timeout: dray_protocol::pull::deadline::REQUEST_TIMEOUT,
            min_chunk_bytes_per_s: dray_protocol::pull::deadline::MIN_CHUNK_BYTES_PER_S,
            max_connections_per_peer: 16,
            max_connections: 8_192,
            transport: TransportTuning::default(),
        }
    }
}

/// An agent's QUIC endpoint, serving its chunk store and dialling peers.
pub struct PeerNode {
    endpoint: quinn::Endpoint,
    identity: Identity,
    store: Arc<ChunkStore>,
    upload: ByteRate,
    download: ByteRate,
    upload_slots: Semaphore,
    /// Long polls held open, per blob (see `max_watchers_per_blob`).
    watchers: Mutex<HashMap<BlobDigest, usize>>,
    /// Accepted connections, per peer id (see `max_connections_per_peer`).
    accepted: Mutex<HashMap<String, usize>>,
    metrics: Arc<AgentMetrics>,
    pub config: PeerConfig,
}

/// A place among a blob's watchers, given back when dropped.
struct WatchSlot<'a> {
    node: &'a PeerNode,
    digest: BlobDigest,
}

impl PeerNode {
    /// A place among `digest`'s watchers, if one is free.
    fn watch_slot(&self, digest: BlobDigest) -> Option<WatchSlot<'_>> {
        let mut watchers = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        let n = watchers.entry(digest).or_insert(0);
        if !dray_protocol::peers::may_watch(*n, self.config.max_watchers_per_blob) {
            return None;
        }
        *n += 1;
        Some(WatchSlot { node: self, digest })
    }
}

/// A place among one peer's accepted connections, given back when dropped.
struct ConnectionSlot {
    node: Arc<PeerNode>,
    peer: String,
}

impl PeerNode {
    /// A place among `peer`'s accepted connections, if one is free.
    fn connection_slot(self: &Arc<Self>, peer: &str) -> Option<ConnectionSlot> {
        let mut accepted = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
        let n = accepted.entry(peer.to_string()).or_insert(0);
        if *n >= self.config.max_connections_per_peer {
            return None;
        }
        *n += 1;
        Some(ConnectionSlot {
            node: self.clone(),
            peer: peer.to_string(),
        })
    }

    /// Slowest rate a chunk is waited for, bytes per second: the configured
    /// floor, lowered to half of one slot's share of a configured cap (a cap
    /// this node set must not make its own chunks miss their deadlines).
    fn slowest_rate(&self, cap: Option<u64>, slots: usize) -> u64 {
        let share = cap.map_or(u64::MAX, |c| c / slots.max(1) as u64 / 2);
        self.config.min_chunk_bytes_per_s.min(share).max(1)
    }

    /// How long a chunk request of `len` bytes is waited for before a
    /// transfer has seen any rate: its length at `min_chunk_bytes_per_s` (or
    /// this node's download share), at least [`MIN_CHUNK_DEADLINE`], plus
    /// `request_timeout`. Transfers then take it from observed rates.
    pub fn first_chunk_deadline(&self, len: usize) -> Duration {
        let rate = self.slowest_rate(self.config.download_bytes_per_s, self.config.max_downloads);
        dray_protocol::pull::deadline::first_deadline(len, rate, self.config.request_timeout)
    }

    /// The longest `len` bytes of chunks may hold an upload slot: longer than
    /// a requester waits for them (so an honest one gives up first).
    fn upload_deadline(&self, len: u64) -> Duration {
        let rate = self.slowest_rate(self.config.upload_bytes_per_s, self.config.max_uploads);
        Duration::from_secs_f64(len as f64 / rate as f64).max(MIN_CHUNK_DEADLINE)
            + self.config.request_timeout
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut accepted = self.node.accepted.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = accepted.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                accepted.remove(&self.peer);
            }
        }
    }
}

impl Drop for WatchSlot<'_> {
    fn drop(&mut self) {
        let mut watchers = self.node.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = watchers.get_mut(&self.digest) {
            *n -= 1;
            if *n == 0 {
                watchers.remove(&self.digest);
            }
        }
    }
}

/// A live, authenticated connection to one peer.
#[derive(Clone)]
pub struct PeerLink {
    pub peer_id: String,
    conn: quinn::Connection,
}

impl PeerNode {
    /// Binds the endpoint and starts serving, with metrics of its own.
    pub fn bind(
        identity: Identity,
        store: Arc<ChunkStore>,
        addr: SocketAddr,
        config: PeerConfig,
    ) -> Result<Arc<Self>> {
        Self::bind_with_metrics(identity, store, addr, config, Arc::default())
    }

    /// Binds the endpoint and starts serving; this agent's transfers, pulls,
    /// uploads and mirror count into `metrics`.
    pub fn bind_with_metrics(
        identity: Identity,
        store: Arc<ChunkStore>,
        addr: SocketAddr,
        config: PeerConfig,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Arc<Self>> {
        identity.require_role(Role::Node, "an agent's peer endpoint")?;
        match identity.warn_if_expiring("agent") {
            Ok((not_before, not_after)) => metrics.certificate_valid(not_before, not_after),
            Err(e) => tracing::warn!(error = %e, "could not read when the agent certificate ends"),
        }
        let endpoint = quic_endpoint(&identity, addr, &config.transport)?;
        let node = Arc::new(Self {
            endpoint,
            identity,
            store,
            upload: ByteRate::new(config.upload_bytes_per_s),
            download: ByteRate::new(config.download_bytes_per_s),
            upload_slots: Semaphore::new(config.max_uploads),
            watchers: Mutex::default(),
            accepted: Mutex::default(),
            metrics,
            config,
        });
        tokio::spawn(server::accept_loop(node.clone()));
        Ok(node)
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.endpoint
            .local_addr()
            .map_err(|e| Error::io("reading the endpoint address", e))
    }

    /// The certificate this node speaks with, to peers and to the tracker.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn peer_id(&self) -> &str {
        &self.identity.peer_id
    }

    /// Chunk requests being served now.
    pub fn active_uploads(&self) -> u32 {
        (self.config.max_uploads - self.upload_slots.available_permits()) as u32
    }

    pub fn store(&self) -> &Arc<ChunkStore> {
        &self.store
    }

    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// Open connections with other agents, dialled or accepted.
    pub fn connected_peers(&self) -> usize {
        self.endpoint.open_connections()
    }

    /// Takes no more chunk requests (they are answered BUSY, so askers turn
    /// to other peers) while those under way finish: the first half of a
    /// graceful stop, [`close`](Self::close) once `active_uploads` is 0.
    pub fn drain(&self) {
        self.upload_slots.close();
    }

    /// Stops serving and closes every connection.
    pub fn close(&self) {
        self.endpoint
            .close(quinn::VarInt::from_u32(0), b"shutting down");
    }

    /// Waits (at most `limit`) until every connection has sent its close:
    /// a process that exits right after [`close`](Self::close) leaves its
    /// peers' requests hanging until their timeouts instead.
    pub async fn closed(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.endpoint.wait_idle()).await;
    }
}

/// A QUIC endpoint on `addr` as the peer plane runs one: mutual TLS with
/// `identity`, the `tuning`'s transport settings, and its UDP socket (the
/// buffers grown, sends and receive buffers kept within the kernel's limits,
/// see [`udp`]). `dray bench peer`'s bare quinn baseline runs on one too, so
/// the two differ only in dray's own work.
pub fn quic_endpoint(
    identity: &Identity,
    addr: SocketAddr,
    tuning: &TransportTuning,
) -> Result<quinn::Endpoint> {
    let transport = tuning.transport();
    let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(identity.server_tls()?)
        .map_err(|e| Error::Tls(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());
    let client_crypto = quinn::crypto::rustls::QuicClientConfig::try_from(identity.client_tls()?)
        .map_err(|e| Error::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);
    let mut endpoint_cfg = quinn::EndpointConfig::default();
    endpoint_cfg
        .max_udp_payload_size(tuning.max_udp_payload)
        .map_err(|e| Error::Config(format!("max_udp_payload: {e}")))?;
    let socket =
        std::net::UdpSocket::bind(addr).map_err(|e| Error::io(format!("binding UDP {addr}"), e))?;
    grow_socket_buffers(&socket, tuning.socket_buffer);
    let runtime =
        quinn::default_runtime().ok_or_else(|| Error::Config("no async runtime".into()))?;
    let starting = |e| Error::io(format!("starting QUIC endpoint on {addr}"), e);
    let socket = crate::peer::udp::KernelSizedUdp::wrap(
        runtime.wrap_udp_socket(socket).map_err(starting)?,
        tuning.max_udp_payload,
    );
    let mut endpoint =
        quinn::Endpoint::new_with_abstract_socket(endpoint_cfg, Some(server), socket, runtime)
            .map_err(starting)?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}

/// Sets the socket's buffers, past `net.core.{r,w}mem_max` when allowed
/// (CAP_NET_ADMIN), else as far as the limit lets us.
fn grow_socket_buffers(socket: &std::net::UdpSocket, bytes: u32) {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    let size = bytes.min(i32::MAX as u32) as libc::c_int;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        let set = |opt| {
            // SAFETY: setsockopt with a valid fd and an int-sized option value.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(force) != 0 && set(plain) != 0 {
            tracing::warn!(bytes, "could not set UDP socket buffer size");
        }
    }
}

fn peer_err(peer: &str, e: impl std::fmt::Display) -> Error {
    Error::Peer {
        peer: peer.into(),
        detail: e.to_string(),
    }
}

fn peer_violation(peer: &str, what: &str) -> Error {
    Error::Frame {
        peer: peer.into(),
        source: FrameError::Violation(what.into()),
    }
}

fn reject_text(r: &pb::Reject) -> String {
    format!("{:?}: {}", r.reason(), r.detail)
}

/// The error for `peer`'s refusal `r`: [`Error::Busy`] for a refusal for
/// capacity, which says nothing against the peer.
fn rejected(peer: &str, r: &pb::Reject) -> Error {
    let (peer, reason) = (peer.to_string(), reject_text(r));
    match r.reason() {
        Reason::Busy => Error::Busy { peer, reason },
        _ => Error::Rejected { peer, reason },
    }
}

async fn write_frame<M: prost::Message>(
    send: &mut quinn::SendStream,
    msg: &M,
) -> std::io::Result<()> {
    let frame = framing::encode(msg, MAX_PEER_FRAME).map_err(std::io::Error::other)?;
    send.write_all(&frame).await.map_err(std::io::Error::other)
}

/// Reads one frame, refusing oversized ones before reading their bodies.
async fn read_frame<M: prost::Message + Default>(
    recv: &mut quinn::RecvStream,
    peer: &str,
) -> Result<M> {
    let mut header = [0u8; framing::HEADER_LEN];
    recv.read_exact(&mut header)
        .await
        .map_err(|e| peer_err(peer, e))?;
    let len = framing::body_len(header, MAX_PEER_FRAME).map_err(|source| Error::Frame {
        peer: peer.into(),
        source,
    })?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body)
        .await
        .map_err(|e| peer_err(peer, e))?;
    framing::decode(&body).map_err(|source| Error::Frame {
        peer: peer.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::ClusterCa;
    use dray_protocol::chunkmap::MIN_CHUNK_SIZE;
    use dray_protocol::framing::MAX_BITFIELD_WAIT_MS;
    use dray_protocol::{Bitfield, ChunkMap};

    async fn pair() -> (tempfile::TempDir, Arc<PeerNode>, Arc<PeerNode>, ChunkMap) {
        pair_with(PeerConfig::default()).await
    }

    async fn pair_with(
        config: PeerConfig,
    ) -> (tempfile::TempDir, Arc<PeerNode>, Arc<PeerNode>, ChunkMap) {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate().unwrap();
        let any = "127.0.0.1:0".parse().unwrap();
        let bind = |id: &str| {
            let store = Arc::new(ChunkStore::open(&dir.path().join(id)).unwrap());
            PeerNode::bind(ca.issue(id).unwrap(), store, any, config.clone()).unwrap()
        };
        let (a, b) = (bind("a"), bind("b"));
        let src = dir.path().join("src");
        std::fs::write(&src, vec![7u8; 3 * MIN_CHUNK_SIZE as usize]).unwrap();
        let map = a.store().import(&src, MIN_CHUNK_SIZE).unwrap();
        (dir, a, b, map)
    }

    /// A blob of 3 small chunks of which `server` holds chunk 0 only; with its
    /// bytes, so the test can store more chunks while a request waits.
    fn partial_blob(server: &PeerNode) -> (ChunkMap, Arc<crate::store::Blob>, Vec<u8>) {
        let bytes: Vec<u8> = (0..3 * MIN_CHUNK_SIZE).map(|i| (i % 251) as u8).collect();
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let blob = server.store().blob(&map).unwrap();
        blob.put_chunk(0, &bytes[..MIN_CHUNK_SIZE as usize])
            .unwrap();
        (map, blob, bytes)
    }

    /// Stores chunk `index` of `bytes` into `blob` after `delay`.
    fn store_later(blob: &Arc<crate::store::Blob>, bytes: &[u8], index: u32, delay: Duration) {
        let (blob, c) = (blob.clone(), MIN_CHUNK_SIZE as usize);
        let chunk = bytes[index as usize * c..(index as usize + 1) * c].to_vec();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            tokio::task::spawn_blocking(move || blob.put_chunk(index, &chunk).unwrap())
                .await
                .unwrap();
        });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bitfield_asked_with_hashes_carries_those_of_held_chunks_the_asker_lacks() {
        let (_dir, a, b, _) = pair().await;
        let (map, blob, bytes) = partial_blob(&a);
        let c = MIN_CHUNK_SIZE as usize;
        blob.put_chunk(2, &bytes[2 * c..]).unwrap();
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        let unhashed = ChunkMap::unhashed(map.digest(), map.size(), map.chunk_size()).unwrap();
        // Knowing none: the hashes of chunks 0 and 2, the ones a holds.
        let none = Bitfield::new(map.chunk_count());
        let (bits, theirs) = b
            .bitfield_with_hashes(&link, &unhashed, 0, Duration::ZERO, &none)
            .await
            .unwrap();
        assert_eq!(bits.ones().collect::<Vec<_>>(), [0, 2]);
        assert_eq!(theirs.hashes()[0], map.hashes()[0]);
        assert_eq!(theirs.hashes()[1], None);
        assert_eq!(theirs.hashes()[2], map.hashes()[2]);
        // Knowing chunk 0's: only chunk 2's comes.
        let mut known = Bitfield::new(map.chunk_count());
        known.set(0);
        let (_, theirs) = b
            .bitfield_with_hashes(&link, &unhashed, 0, Duration::ZERO, &known)
            .await
            .unwrap();
        assert_eq!(theirs.known().ones().collect::<Vec<_>>(), [2]);
        assert_eq!(theirs.hashes()[2], map.hashes()[2]);
        // A plain ask carries none.
        let plain = b.bitfield(&link, &unhashed).await.unwrap();
        assert_eq!(plain, bits);
        // A blob the peer's store does not know: not a member of its swarm
        // (a plain ask reads that as holding nothing).
        let elsewhere = ChunkMap::unhashed(BlobDigest::of(b"other"), 10, MIN_CHUNK_SIZE).unwrap();
        let err = b
            .bitfield_with_hashes(&link, &elsewhere, 0, Duration::ZERO, &none)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("it neither pulls nor holds it"), "{err}");
        assert_eq!(b.bitfield(&link, &elsewhere).await.unwrap().count(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_polls_past_a_blobs_watcher_cap_are_refused_busy_at_once() {
        let config = PeerConfig {
            max_watchers_per_blob: 1,
            ..PeerConfig::default()
        };
        let (_dir, a, b, _) = pair_with(config).await;
        let (map, _blob, _) = partial_blob(&a);
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        let first = {
            let (b, link, map) = (b.clone(), link.clone(), map.clone());
            tokio::spawn(async move {
                b.bitfield_after(&link, &map, 1, Duration::from_secs(1))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = tokio::time::Instant::now();
        let err = b
            .bitfield_after(&link, &map, 1, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        // A refusal for capacity, which says nothing against the peer.
        assert!(matches!(err, Error::Busy { .. }), "{err:?}");
        let err = err.to_string();
        assert!(
            err.contains("1 watchers of") && err.contains("the most this node serves"),
            "{err}"
        );
        // A plain question is no watcher: answered.
        assert_eq!(b.bitfield(&link, &map).await.unwrap().count(), 1);
        // The first poll ends at its wait and gives its place back.
        assert_eq!(first.await.unwrap().unwrap().count(), 1);
        let again = b
            .bitfield_after(&link, &map, 1, Duration::from_millis(100))
            .await;
        assert_eq!(again.unwrap().count(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_polled_bitfield_answers_on_a_new_chunk_or_at_the_capped_wait() {
        let (_dir, a, b, _) = pair().await;
        let (map, blob, bytes) = partial_blob(&a);
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();

        // The asker has not seen chunk 0 yet: the answer is immediate.
        let t = tokio::time::Instant::now();
        let bits = b
            .bitfield_after(&link, &map, 0, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![0]);
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );

        // Nothing changes: the answer comes after the wait, unchanged.
        let t = tokio::time::Instant::now();
        let bits = b
            .bitfield_after(&link, &map, 1, Duration::from_millis(500))
            .await
            .unwrap();
        let waited = t.elapsed();
        assert_eq!(bits.count(), 1);
        assert!(
            waited >= Duration::from_millis(480) && waited < Duration::from_millis(1_500),
            "{waited:?}"
        );

        // A wait beyond the cap is held only as long as the cap.
        let t = tokio::time::Instant::now();
        b.bitfield_after(&link, &map, 1, Duration::from_secs(60))
            .await
            .unwrap();
        let waited = t.elapsed();
        let cap = Duration::from_millis(MAX_BITFIELD_WAIT_MS.into());
        assert!(
            waited >= cap - Duration::from_millis(20) && waited < cap + Duration::from_secs(1),
            "{waited:?}"
        );

        // The server stores chunk 2 while the request waits: answered at once.
        store_later(&blob, &bytes, 2, Duration::from_millis(200));
        let t = tokio::time::Instant::now();
        let bits = b
            .bitfield_after(&link, &map, 1, Duration::from_secs(2))
            .await
            .unwrap();
        let waited = t.elapsed();
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![0, 2]);
        assert!(
            waited >= Duration::from_millis(150) && waited < Duration::from_millis(800),
            "answered {waited:?} after the ask, the chunk landed at 200 ms"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_bitfield_request_ends_when_the_blob_completes() {
        let (_dir, a, b, _) = pair().await;
        let (map, blob, bytes) = partial_blob(&a);
        store_later(&blob, &bytes, 1, Duration::ZERO);
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        // Asking to hear of nothing short of more than every chunk: only the
        // blob's completion ends the wait early.
        store_later(&blob, &bytes, 2, Duration::from_millis(200));
        let t = tokio::time::Instant::now();
        let bits = b
            .bitfield_after(&link, &map, map.chunk_count(), Duration::from_secs(2))
            .await
            .unwrap();
        let waited = t.elapsed();
        assert!(bits.is_full());
        assert!(blob.is_complete());
        assert!(waited < Duration::from_millis(800), "{waited:?}");
    }

    /// Sends raw bytes on a fresh request stream; returns what the server answered.
    /// Sends a `Hello` naming `peer_id` on a new stream of `conn` (dialled
    /// to node "a"); its answer.
    async fn say_hello(conn: &quinn::Connection, peer_id: &str) -> pb::PeerMessage {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let hello = pb::PeerMessage {
            body: Some(Body::Hello(pb::Hello {
                version: PROTOCOL_VERSION,
                peer_id: peer_id.into(),
            })),
        };
        write_frame(&mut send, &hello).await.unwrap();
        read_frame(&mut recv, "a").await.unwrap()
    }

    async fn raw_request(link: &PeerLink, bytes: &[u8]) -> Vec<u8> {
        let (mut send, mut recv) = link.open().await.unwrap();
        send.write_all(bytes).await.unwrap();
        let _ = send.finish();
        recv.read_to_end(1 << 20).await.unwrap_or_default()
    }

    #[tokio::test]
    async fn hostile_request_streams_get_a_clear_refusal_and_the_server_keeps_serving() {
        let (_dir, a, b, map) = pair().await;
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();

        // A frame header claiming 4 GiB: refused before any body is read.
        assert!(
            raw_request(&link, &[0xff, 0xff, 0xff, 0xff])
                .await
                .is_empty()
        );
        // A body that is not protobuf.
        let reply = raw_request(&link, &[0, 0, 0, 3, 0xff, 0xff, 0xff]).await;
        assert!(reply.is_empty(), "undecodable bodies end the stream");
        // Valid protobuf, invalid request: answered with a reject naming the problem.
        let bad = PeerRequest::Chunks {
            digest: map.digest(),
            first: 0,
            count: 1,
        }
        .to_pb();
        let mut bad = bad;
        if let Some(Body::Request(r)) = bad.body.as_mut() {
            r.count = 1000;
        }
        let reply = raw_request(&link, &framing::encode(&bad, MAX_PEER_FRAME).unwrap()).await;
        let (msg, _) = framing::take::<pb::PeerMessage>(&reply, MAX_PEER_FRAME)
            .unwrap()
            .unwrap();
        match msg.body {
            Some(Body::Reject(r)) => {
                assert_eq!(r.reason(), Reason::BadRequest);
                assert!(r.detail.contains("1000 chunks"), "{}", r.detail);
            }
            other => panic!("expected a reject, got {other:?}"),
        }
        // Random garbage of every length up to 64 bytes never takes the server down.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for len in 0..64 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            raw_request(&link, &junk).await;
        }
        // The same connection still serves honest requests.
        assert!(b.bitfield(&link, &map).await.unwrap().is_full());
        assert_eq!(
            b.fetch_chunk(&link, &map, 2).await.unwrap(),
            vec![7u8; MIN_CHUNK_SIZE as usize]
        );
    }

    /// A withholder: a member with a valid certificate that says hello and
    /// takes chunk requests, and answers none. The request fails
    /// `PeerSilent` after the request timeout, and the caller hears that
    /// no answer came (what the pull reports to the tracker).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_takes_a_request_and_answers_nothing_fails_it_silent() {
        let config = PeerConfig {
            request_timeout: Duration::from_millis(500),
            ..PeerConfig::default()
        };
        let (_dir, a, b, map) = pair_with(config.clone()).await;
        let any = "127.0.0.1:0".parse().unwrap();
        let withholder = quic_endpoint(a.identity(), any, &config.transport).unwrap();
        let addr = withholder.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let conn = withholder.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let _: pb::PeerMessage = read_frame(&mut recv, "b").await.unwrap();
            let hello = pb::PeerMessage {
                body: Some(Body::Hello(pb::Hello {
                    version: PROTOCOL_VERSION,
                    peer_id: "a".into(),
                })),
            };
            write_frame(&mut send, &hello).await.unwrap();
            // Takes every request and keeps it open, unanswered.
            let mut held = Vec::new();
            while let Ok(stream) = conn.accept_bi().await {
                held.push(stream);
            }
        });
        let link = b.connect("a", addr).await.unwrap();
        let received = std::sync::atomic::AtomicUsize::new(0);
        let started = std::time::Instant::now();
        let err = b
            .fetch_chunk_noting(&link, &map, 0, &received)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::PeerSilent { .. }), "{err}");
        assert!(err.to_string().contains("no answer within"), "{err}");
        assert_eq!(received.load(std::sync::atomic::Ordering::Acquire), 0);
        assert!(started.elapsed() >= Duration::from_millis(500));
        // The honest peer answers the same request at once.
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        let received = std::sync::atomic::AtomicUsize::new(0);
        let bytes = b
            .fetch_chunk_noting(&link, &map, 0, &received)
            .await
            .unwrap();
        assert_eq!(
            received.load(std::sync::atomic::Ordering::Acquire),
            bytes.len()
        );
        server.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_requester_that_does_not_read_loses_its_upload_slot_at_the_deadline() {
        let config = PeerConfig {
            max_uploads: 1,
            request_timeout: Duration::from_millis(500),
            ..PeerConfig::default()
        };
        let (_dir, a, b, map) = pair_with(config).await;
        // A requester whose 1 KiB stream window holds back a 64 KiB chunk
        // for as long as it does not read.
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(quinn::VarInt::from_u32(1024));
        let slow = a.identity().clone();
        let crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(slow.client_tls().unwrap()).unwrap();
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::new(transport));
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(client);
        let conn = endpoint
            .connect(a.local_addr().unwrap(), "a")
            .unwrap()
            .await
            .unwrap();
        say_hello(&conn, "a").await;
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let req = PeerRequest::Chunks {
            digest: map.digest(),
            first: 0,
            count: 1,
        }
        .to_pb();
        write_frame(&mut send, &req).await.unwrap();
        let t = tokio::time::Instant::now();
        while a.active_uploads() == 0 {
            assert!(t.elapsed() < Duration::from_secs(2), "never served");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // 64 KiB at 256 KiB/s is under the 2 s floor; plus the 500 ms request timeout.
        let deadline = Duration::from_millis(2_500);
        while a.active_uploads() > 0 {
            assert!(
                t.elapsed() < deadline + Duration::from_secs(2),
                "the slot is still held after {:?}",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let freed = t.elapsed();
        assert!(freed >= deadline - Duration::from_millis(100), "{freed:?}");
        // The slot serves an honest requester again.
        let link = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        assert_eq!(
            b.fetch_chunk(&link, &map, 1).await.unwrap(),
            vec![7u8; MIN_CHUNK_SIZE as usize]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_past_the_per_peer_cap_are_closed_naming_the_cap() {
        let config = PeerConfig {
            max_connections_per_peer: 1,
            ..PeerConfig::default()
        };
        let (_dir, a, b, map) = pair_with(config).await;
        let first = b.connect("a", a.local_addr().unwrap()).await.unwrap();
        let err = b
            .connect("a", a.local_addr().unwrap())
            .await
            .err()
            .expect("a second connection is refused")
            .to_string();
        assert!(
            err.contains(
                "1 connections from peer b already, the most this node accepts from one peer"
            ),
            "{err}"
        );
        // The first one still serves; once it closes, a new one is taken.
        assert!(b.bitfield(&first, &map).await.unwrap().is_full());
        first.conn.close(quinn::VarInt::from_u32(0), b"done");
        let t = tokio::time::Instant::now();
        loop {
            match b.connect("a", a.local_addr().unwrap()).await {
                Ok(link) => {
                    assert!(b.bitfield(&link, &map).await.unwrap().is_full());
                    break;
                }
                Err(e) => assert!(t.elapsed() < Duration::from_secs(5), "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn during_a_ca_rotation_nodes_trusting_both_cas_talk_with_certificates_of_either() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (
            ClusterCa::generate().unwrap(),
            ClusterCa::generate().unwrap(),
        );
        // What `dray ca issue` reads from a CA directory whose ca.crt is a
        // bundle: the CA whose key signs comes first, and the issued node
        // trusts every CA of the bundle.
        let bundled = |signer: &ClusterCa, other: &ClusterCa| ClusterCa {
            cert_pem: format!("{}{}", signer.cert_pem, other.cert_pem),
            key_pem: signer.key_pem.clone(),
        };
        let trusting = |ca: &ClusterCa, id: &str| ca.issue(id).unwrap();
        let bind = |identity: Identity| {
            let store = Arc::new(ChunkStore::open(&dir.path().join(&identity.peer_id)).unwrap());
            let any = "127.0.0.1:0".parse().unwrap();
            PeerNode::bind(identity, store, any, PeerConfig::default()).unwrap()
        };
        // Step 1 done on x and y (both CAs trusted), y already re-issued by
        // the new CA (step 2); z has not had step 1 yet.
        let x = bind(trusting(&bundled(&old, &new), "x"));
        let y = bind(trusting(&bundled(&new, &old), "y"));
        let z = bind(trusting(&old, "z"));
        let addr = |n: &PeerNode| n.local_addr().unwrap();
        x.connect("y", addr(&y)).await.unwrap();
        y.connect("x", addr(&x)).await.unwrap();
        z.connect("x", addr(&x)).await.unwrap();
        x.connect("z", addr(&z)).await.unwrap();
        // A node trusting only the old CA refuses a new certificate: the
        // bundle must reach every node before any certificate is re-issued.
        assert!(z.connect("y", addr(&y)).await.is_err());
    }

    #[tokio::test]
    async fn a_hello_that_lies_about_its_identity_is_refused() {
        let (_dir, a, b, _map) = pair().await;
        let conn = b
            .endpoint
            .connect(a.local_addr().unwrap(), "a")
            .unwrap()
            .await
            .unwrap();
        let reply = say_hello(&conn, "someone-else").await;
        match reply.body {
            Some(Body::Reject(r)) => {
                assert_eq!(r.reason(), Reason::Identity);
                assert!(r.detail.contains("certificate names \"b\""), "{}", r.detail);
            }
            other => panic!("expected a reject, got {other:?}"),
        }
    }
}
