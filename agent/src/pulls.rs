//! Blob pulls shared by everything on the node that reads layers: the
//! registry mirror (containerd's downloads) and the local API (the snapshotter
//! shim's unpacks, `dray pull`).
//!
//! One swarm pull runs per blob however many readers want it; each reader
//! follows the blob's verified in-order prefix as it grows, so bytes flow on
//! to the client (or into the unpacker) while later chunks are still being
//! fetched, and no unverified byte is ever handed out. Upstream registry
//! clients (connection pools, cached tokens) are kept per registry.

use crate::registry::{RegistryClient, RegistryError};
use crate::store::{Blob, Progress};
use crate::swarm::{PullReport, Swarm};
use bytes::Bytes;
use dray_protocol::{BlobDigest, ChunkMap};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Bytes read from disk per frame of a streamed blob.
const FRAME: u64 = 1 << 20;
/// A reader waiting this long for the next verified chunk gives up.
const STALL: Duration = Duration::from_secs(60);

/// How a shared pull is going.
#[derive(Clone, Debug)]
pub enum PullState {
    Running,
    Done(Arc<PullReport>),
    Failed(String),
}

/// Why a blob could not be opened for reading.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The pull failed before the first byte the reader needs.
    #[error("{0}")]
    Unavailable(String),
    /// No verified byte arrived within the stall limit.
    #[error("no verified bytes of {0} within {STALL:?}")]
    Stalled(BlobDigest),
}

/// The node's blob pulls and upstream clients.
pub struct Pulls {
    swarm: Arc<Swarm>,
    /// One client (connection pool) per upstream base URL.
    upstreams: Mutex<HashMap<String, Arc<RegistryClient>>>,
    /// Pulls in progress, so concurrent readers of a blob share one.
    running: Mutex<HashMap<BlobDigest, watch::Receiver<PullState>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pulls {
    pub fn new(swarm: Arc<Swarm>) -> Arc<Self> {
        Arc::new(Self {
            swarm,
            upstreams: Mutex::new(HashMap::new()),
            running: Mutex::new(HashMap::new()),
        })
    }

    pub fn swarm(&self) -> &Arc<Swarm> {
        &self.swarm
    }

    /// The shared client for the registry at `base` (no client credentials).
    pub fn upstream(&self, base: &str) -> Result<Arc<RegistryClient>, RegistryError> {
        let mut ups = lock(&self.upstreams);
        if let Some(c) = ups.get(base) {
            return Ok(c.clone());
        }
        let c = Arc::new(RegistryClient::new(base, None)?);
        ups.insert(base.to_string(), c.clone());
        Ok(c)
    }

    /// Starts (or joins) the swarm pull of a blob.
    pub fn ensure(
        self: &Arc<Self>,
        client: Arc<RegistryClient>,
        repo: &str,
        digest: BlobDigest,
    ) -> watch::Receiver<PullState> {
        let mut running = lock(&self.running);
        if let Some(rx) = running.get(&digest)
            && matches!(*rx.borrow(), PullState::Running)
        {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(PullState::Running);
        running.insert(digest, rx.clone());
        let (pulls, repo) = (self.clone(), repo.to_string());
        tokio::spawn(async move {
            let state = match pulls.swarm.pull(&client, &repo, digest).await {
                Ok(report) => PullState::Done(Arc::new(report)),
                Err(e) => {
                    tracing::warn!(%digest, error = %e, "blob pull failed");
                    PullState::Failed(e.to_string())
                }
            };
            let _ = tx.send(state);
            lock(&pulls.running).remove(&digest);
        });
        rx
    }

    /// A reader of bytes `start..end` of a blob of `size` bytes that follows
    /// its verified prefix. Waits for the first byte (or the pull's failure)
    /// before returning, so a caller can still answer with an error status.
    pub async fn open(
        &self,
        digest: BlobDigest,
        size: u64,
        start: u64,
        end: u64,
        mut pull: watch::Receiver<PullState>,
    ) -> Result<BlobReader, OpenError> {
        let chunk_size = self.swarm.config().chunk_size;
        let map = ChunkMap::unhashed(digest, size, chunk_size)
            .map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let store = self.swarm.node().store().clone();
        let blob = tokio::task::spawn_blocking(move || store.blob(&map))
            .await
            .map_err(|e| OpenError::Unavailable(e.to_string()))?
            .map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let mut progress = blob.subscribe();
        let available = |p: &Progress| {
            if p.complete {
                size
            } else {
                u64::from(p.chunks) * u64::from(chunk_size)
            }
        };
        loop {
            let p = *progress.borrow_and_update();
            if available(&p) > start || start >= end {
                break;
            }
            if let PullState::Failed(e) = pull.borrow_and_update().clone() {
                return Err(OpenError::Unavailable(e));
            }
            tokio::select! {
                _ = progress.changed() => {}
                _ = pull.changed() => {}
                _ = tokio::time::sleep(STALL) => return Err(OpenError::Stalled(digest)),
            }
        }
        Ok(BlobReader {
            blob,
            progress,
            pull,
            pull_ended: false,
            pos: start,
            end,
            size,
            chunk_size,
        })
    }
}

/// Reads a blob's verified bytes in order as they arrive.
pub struct BlobReader {
    blob: Arc<Blob>,
    progress: watch::Receiver<Progress>,
    pull: watch::Receiver<PullState>,
    pull_ended: bool,
    pos: u64,
    end: u64,
    size: u64,
    chunk_size: u32,
}

impl BlobReader {
    /// The rest of the range as a stream of frames. An error ends it early, so
    /// a reader sees a short read, never unverified bytes.
    pub fn into_stream(self) -> BoxStream<'static, std::io::Result<Bytes>> {
        futures_util::stream::unfold(self, |mut r| async move {
            if r.pos >= r.end {
                return None;
            }
            let next = r.next().await;
            Some((next, r))
        })
        .boxed()
    }

    /// Waits until the blob is complete and matched its digest.
    pub async fn verified(mut self) -> std::io::Result<()> {
        while !self.check()?.complete {
            self.wait().await?;
        }
        Ok(())
    }

    async fn next(&mut self) -> std::io::Result<Bytes> {
        let read = async {
            loop {
                let p = self.check()?;
                let available = if p.complete {
                    self.size
                } else {
                    u64::from(p.chunks) * u64::from(self.chunk_size)
                };
                if available > self.pos {
                    let len = (available.min(self.end) - self.pos).min(FRAME);
                    let (blob, at) = (self.blob.clone(), self.pos);
                    let bytes =
                        tokio::task::spawn_blocking(move || blob.read_range(at, len as usize))
                            .await
                            .map_err(std::io::Error::other)?
                            .map_err(std::io::Error::other)?;
                    self.pos += len;
                    return Ok(Bytes::from(bytes));
                }
                self.wait().await?;
            }
        };
        let result = read.await;
        if result.is_err() {
            self.pos = self.end;
        }
        result
    }

    /// The blob's progress, or why no more bytes will come.
    fn check(&mut self) -> std::io::Result<Progress> {
        let p = *self.progress.borrow_and_update();
        if p.failed {
            return Err(std::io::Error::other(format!(
                "{} failed its digest",
                self.blob.digest()
            )));
        }
        if !p.complete
            && let PullState::Failed(e) = self.pull.borrow_and_update().clone()
        {
            return Err(std::io::Error::other(e));
        }
        Ok(p)
    }

    /// Waits for the blob or its pull to change, at most the stall limit.
    async fn wait(&mut self) -> std::io::Result<()> {
        tokio::select! {
            r = self.progress.changed() => r.map_err(|_| std::io::Error::other("blob closed")),
            r = self.pull.changed(), if !self.pull_ended => {
                // The pull task is gone: its last state is final.
                self.pull_ended = r.is_err();
                Ok(())
            }
            _ = tokio::time::sleep(STALL) => Err(std::io::Error::other(format!(
                "no verified bytes of {} within {STALL:?}",
                self.blob.digest()
            ))),
        }
    }
}
