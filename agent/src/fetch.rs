//! Fetching one blob from peers: connects to every peer given, learns what each
//! holds, and keeps several chunk requests in flight per peer, chosen by the
//! shared [`ChunkPicker`]. Each chunk is verified against the chunk map before it
//! is written; a peer that sends a chunk failing its hash is banned for the rest
//! of the transfer and reported in [`FetchReport::bad_peers`]. Completed chunks
//! are made durable in groups while the transfer runs.

use crate::error::{Error, Result};
use crate::peer::{PeerLink, PeerNode};
use crate::store::{Blob, PutOutcome};
use dray_protocol::picker::{ChunkPicker, DEFAULT_WINDOW};
use dray_protocol::{ChunkMap, VerifyError};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Chunk requests in flight per peer.
const DEPTH_PER_PEER: usize = 4;
/// How often completed chunks are synced and recorded while a transfer runs.
const PERSIST_EVERY: Duration = Duration::from_millis(100);

/// A peer to fetch from.
#[derive(Clone, Debug)]
pub struct PeerAddr {
    pub peer_id: String,
    pub addr: SocketAddr,
}

/// What a fetch did.
#[derive(Debug, Default, Serialize)]
pub struct FetchReport {
    /// Chunks already held when the fetch began.
    pub resumed_chunks: u32,
    /// Verified chunks received, by peer.
    pub chunks_by_peer: BTreeMap<String, u32>,
    /// Peers that sent a chunk failing its hash, with the chunk index.
    pub bad_peers: BTreeMap<String, u32>,
    pub bytes_received: u64,
    /// UDP payload size each peer's path reached (MTU discovery), at the end.
    pub path_mtu_by_peer: BTreeMap<String, u16>,
}

struct Shared {
    picker: ChunkPicker<String>,
    report: FetchReport,
    error: Option<Error>,
}

/// What a lane does next.
enum Next {
    Fetch(u32),
    /// Nothing to pick now, but requests in flight elsewhere may fail and
    /// release chunks.
    Wait,
    Stop,
}

/// Fetches the blob of `map` from `peers` into the node's store.
pub async fn fetch_from_peers(
    node: &Arc<PeerNode>,
    map: &ChunkMap,
    peers: &[PeerAddr],
) -> Result<FetchReport> {
    let store = node.store().clone();
    let m = map.clone();
    let blob = tokio::task::spawn_blocking(move || store.blob(&m))
        .await
        .map_err(join_err)??;
    let held = blob.held();
    let shared = Arc::new(Mutex::new(Shared {
        report: FetchReport {
            resumed_chunks: held.count(),
            ..Default::default()
        },
        picker: ChunkPicker::new(held, DEFAULT_WINDOW),
        error: None,
    }));
    let released = Arc::new(Notify::new());
    let persister = tokio::spawn(persist_loop(node.clone(), blob.clone()));

    let mut workers = tokio::task::JoinSet::new();
    for p in peers {
        let (node, map, blob, shared, p) = (
            node.clone(),
            map.clone(),
            blob.clone(),
            Arc::clone(&shared),
            p.clone(),
        );
        let released = released.clone();
        workers.spawn(async move {
            let link = match node.connect(&p.peer_id, p.addr).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping peer");
                    return;
                }
            };
            match node.bitfield(&link, &map).await {
                Ok(bits) => lock(&shared).picker.set_peer(p.peer_id.clone(), bits),
                Err(e) => {
                    tracing::warn!(error = %e, "skipping peer");
                    return;
                }
            }
            let mut lanes = tokio::task::JoinSet::new();
            for _ in 0..DEPTH_PER_PEER {
                lanes.spawn(lane(
                    node.clone(),
                    link.clone(),
                    map.clone(),
                    blob.clone(),
                    shared.clone(),
                    released.clone(),
                ));
            }
            while lanes.join_next().await.is_some() {}
            lock(&shared)
                .report
                .path_mtu_by_peer
                .insert(p.peer_id.clone(), link.path_mtu());
        });
    }
    while workers.join_next().await.is_some() {}
    persister.abort();
    let store = node.store().clone();
    let b = blob.clone();
    tokio::task::spawn_blocking(move || store.persist(&b))
        .await
        .map_err(join_err)??;

    let mut sh = lock(&shared);
    if let Some(e) = sh.error.take() {
        return Err(e);
    }
    if !blob.is_complete() {
        let missing = map.chunk_count() - blob.held().count();
        return Err(Error::Incomplete {
            digest: map.digest(),
            detail: format!("{missing} chunks missing and no peer left that holds them"),
        });
    }
    Ok(std::mem::take(&mut sh.report))
}

fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

fn join_err(e: tokio::task::JoinError) -> Error {
    Error::Db(format!("blocking task failed: {e}"))
}

/// One request slot towards one peer: pick, fetch, verify and store, repeat.
async fn lane(
    node: Arc<PeerNode>,
    link: PeerLink,
    map: ChunkMap,
    blob: Arc<Blob>,
    shared: Arc<Mutex<Shared>>,
    released: Arc<Notify>,
) {
    let peer = link.peer_id.clone();
    loop {
        let next = {
            let mut sh = lock(&shared);
            match sh.picker.pick(&peer) {
                _ if sh.error.is_some() || sh.picker.is_banned(&peer) => Next::Stop,
                Some(i) => Next::Fetch(i),
                None if sh.picker.in_flight() > 0 => Next::Wait,
                None => Next::Stop,
            }
        };
        let index = match next {
            Next::Fetch(i) => i,
            Next::Wait => {
                // The timeout covers a release that happened before we started waiting.
                let _ = tokio::time::timeout(Duration::from_millis(200), released.notified()).await;
                continue;
            }
            Next::Stop => return,
        };
        let bytes = match node.fetch_chunk(&link, &map, index).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, index, "chunk request failed");
                {
                    let mut sh = lock(&shared);
                    sh.picker.failed(index);
                    if link.is_closed() {
                        sh.picker.remove_peer(&peer);
                    }
                }
                released.notify_waiters();
                return;
            }
        };
        let len = bytes.len() as u64;
        let b = blob.clone();
        let put = tokio::task::spawn_blocking(move || b.put_chunk(index, &bytes))
            .await
            .map_err(join_err);
        let mut sh = lock(&shared);
        match put.and_then(|r| r) {
            Ok(PutOutcome::Stored | PutOutcome::Completed) => {
                tracing::debug!(index, %peer, "chunk stored");
                sh.picker.completed(index);
                *sh.report.chunks_by_peer.entry(peer.clone()).or_default() += 1;
                sh.report.bytes_received += len;
            }
            Ok(PutOutcome::Duplicate) => sh.picker.completed(index),
            Err(Error::Verify(VerifyError::ChunkHash { .. } | VerifyError::ChunkLength { .. })) => {
                tracing::warn!(%peer, index, digest = %map.digest(), "peer sent a chunk that fails its hash; banning it");
                sh.picker.failed(index);
                sh.picker.ban(&peer);
                sh.report.bad_peers.insert(peer.clone(), index);
                drop(sh);
                released.notify_waiters();
                return;
            }
            Err(e) => {
                sh.picker.failed(index);
                sh.error.get_or_insert(e);
                drop(sh);
                released.notify_waiters();
                return;
            }
        }
    }
}

async fn persist_loop(node: Arc<PeerNode>, blob: Arc<Blob>) {
    let mut tick = tokio::time::interval(PERSIST_EVERY);
    loop {
        tick.tick().await;
        let (store, b) = (node.store().clone(), blob.clone());
        match tokio::task::spawn_blocking(move || store.persist(&b)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "recording completed chunks failed"),
            Err(e) => tracing::error!(error = %e, "recording completed chunks panicked"),
        }
    }
}
