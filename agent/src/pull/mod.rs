//! Blob pulls shared by everything on the node that reads layers: the
//! registry mirror (containerd's downloads) and the local API (the snapshotter
//! shim's unpacks, `dray pull`).
//!
//! One swarm pull runs per blob however many readers want it; each reader
//! follows the blob's verified in-order prefix as it grows, so bytes flow on
//! to the client (or into the unpacker) while later chunks are still being
//! fetched, and no unverified byte is ever handed out. Upstream registry
//! clients (connection pools, cached tokens) are kept per registry, a bounded
//! number of them.
//!
//! Every pull records the registry it pulls from with the blob (its origin,
//! kept by the store). The mirror and the local API join a pull, or read a
//! stored blob, only for a caller asking through that same registry
//! ([`Pulls::admit`], their one way in): the access check is a HEAD there,
//! and a HEAD at another registry (one a client, or a pod's image, may
//! name) proves nothing about this blob.
//!
//! The folder is the pull: [`swarm`] joins a blob's swarm and drives the
//! pull (announces, the pull engine, DHT coordination and the registry runs
//! it is assigned), [`fetch`] moves chunks from peers and ranges from the
//! registry ([`registry`]), and [`events`] keeps the recent fallbacks and
//! bans for `dray status`. Every decision they act on is the sans-IO pull
//! core's ([`dray_protocol::pull`]).

pub mod events;
pub mod fetch;
pub mod registry;
pub mod swarm;

use crate::bounded::BoundedMap;
use crate::pull::registry::{ReaderGuard, Readers, RegistryClient, RegistryConfig, RegistryError};
use crate::pull::swarm::{PullReport, Swarm};
use crate::store::{Blob, ChunkStore, Progress};
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
/// Upstream clients kept; past it the oldest is dropped (its pool and cached
/// tokens with it). A node mirrors a handful of registries; with `*` the
/// names come from clients.
const MAX_UPSTREAMS: usize = 64;
/// Swarm pulls of a blob per shared pull, should the collector evict the
/// blob as each ends.
const PULL_ATTEMPTS: usize = 3;
/// Bytes of each range a registry reads back to prove it holds a blob.
const PROBE: u64 = 4096;

/// How a shared pull is going.
#[derive(Clone)]
pub enum PullState {
    Running,
    /// The pull's report, and the blob, complete: held here for as long as
    /// anyone waits on the pull, so that the collector (which evicts no
    /// blob in use) cannot take it between the pull's end and a reader's
    /// open, which would then find an empty blob that nobody fills.
    Done(Arc<PullReport>, Arc<Blob>),
    Failed(String),
}

impl std::fmt::Debug for PullState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Running => f.write_str("Running"),
            Self::Done(report, _) => f.debug_tuple("Done").field(report).finish(),
            Self::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
        }
    }
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

/// Why a mirror client may not have a blob from this node.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    #[error(
        "blob {digest} on this node came from {held}, not from {asked}: it is not handed out on the strength of another registry's answer"
    )]
    Elsewhere {
        digest: BlobDigest,
        asked: String,
        held: String,
    },
    #[error("looking up where blob {digest} came from: {detail}")]
    Store { digest: BlobDigest, detail: String },
}

/// A pull in progress and the registry it reads from.
struct Running {
    state: watch::Receiver<PullState>,
    origin: String,
    /// The credentials of the callers waiting on it, which it fetches with
    /// (none for the local API's: the agent's own, anonymous).
    readers: Arc<Readers>,
}

impl Running {
    fn is_running(&self) -> bool {
        matches!(*self.state.borrow(), PullState::Running)
    }
}

/// The node's blob pulls and upstream clients.
pub struct Pulls {
    swarm: Arc<Swarm>,
    /// One client (connection pool) per upstream base URL.
    upstreams: Mutex<BoundedMap<String, Arc<RegistryClient>>>,
    /// Pulls in progress, so concurrent readers of a blob share one.
    running: Mutex<HashMap<BlobDigest, Running>>,
    /// How fast the upstream clients' range reads must go.
    registry: RegistryConfig,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pulls {
    pub fn new(swarm: Arc<Swarm>, registry: RegistryConfig) -> Arc<Self> {
        Arc::new(Self {
            swarm,
            upstreams: Mutex::new(BoundedMap::new(MAX_UPSTREAMS)),
            running: Mutex::new(HashMap::new()),
            registry,
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
        let swarm = Arc::downgrade(&self.swarm);
        let c = Arc::new(
            RegistryClient::new(base, None)?
                .with_config(self.registry.clone())
                .on_ranges_ignored(Arc::new(move || {
                    if let Some(s) = swarm.upgrade() {
                        s.announce_soon();
                    }
                })),
        );
        ups.insert(base.to_string(), c.clone());
        Ok(c)
    }

    /// Starts or joins the pull of a blob of `size` bytes for a caller
    /// whose access check passed at `client`'s registry (a HEAD there with
    /// the caller's credentials: a mirror client's `Authorization`, or none
    /// for the local API): the one way in, for the mirror and the local
    /// API alike. Refused when the blob, held or being pulled, comes from
    /// another registry, unless `named` (the operator named the asked
    /// registry) and that registry proves it holds the same bytes
    /// ([`Self::prove_shared`]). The pull fetches with the credentials of
    /// the callers waiting on it: the guard keeps this caller's there.
    pub async fn admit(
        self: &Arc<Self>,
        client: &RegistryClient,
        named: bool,
        repo: &str,
        digest: BlobDigest,
        size: u64,
    ) -> Result<(watch::Receiver<PullState>, Option<ReaderGuard>), OriginError> {
        if named {
            self.prove_shared(client, repo, digest, size).await;
        }
        self.ensure_from(client, repo, digest, size)
    }

    /// [`Self::admit`] past the proof: joins a running pull from the same
    /// registry, or starts one, recording that registry as the blob's
    /// origin only when the store holds nothing of it from another.
    fn ensure_from(
        self: &Arc<Self>,
        client: &RegistryClient,
        repo: &str,
        digest: BlobDigest,
        size: u64,
    ) -> Result<(watch::Receiver<PullState>, Option<ReaderGuard>), OriginError> {
        let authorization = client.forwarded().cloned();
        let asked = client.base().to_string();
        let elsewhere = |held: String| OriginError::Elsewhere {
            digest,
            asked: asked.clone(),
            held,
        };
        let mut running = lock(&self.running);
        if let Some(r) = running.get(&digest).filter(|r| r.is_running()) {
            if r.origin != asked {
                return Err(elsewhere(r.origin.clone()));
            }
            return Ok((r.state.clone(), Some(r.readers.join(authorization))));
        }
        let store = self.swarm.node().store();
        let store_err = |e: crate::Error| OriginError::Store {
            digest,
            detail: e.to_string(),
        };
        let origins = store.origins(&digest).map_err(store_err)?;
        if !origins.contains(&asked) && store.knows(&digest).map_err(store_err)? {
            let held = match origins.is_empty() {
                true => "no recorded registry".to_string(),
                false => origins.join(", "),
            };
            return Err(elsewhere(held));
        }
        let readers = Arc::new(Readers::default());
        let guard = readers.join(authorization);
        let client = Arc::new(client.for_readers(readers.clone()));
        let rx = self.start(&mut running, client, repo, (digest, size), readers);
        Ok((rx, Some(guard)))
    }

    /// Lets a complete blob this node holds from another registry be served
    /// for `client`'s registry too, one the operator named, when that registry
    /// proves it has the same bytes: two ranges read there with the client's
    /// credentials (the last [`PROBE`] bytes, which depend on the whole layer,
    /// and [`PROBE`] bytes at an offset it cannot guess; a smaller blob whole)
    /// equal this node's verified copy. A HEAD's word is not enough (a listed
    /// server may answer 200 to anything); a server that has the bytes could
    /// have served them. So a layer two registries share is fetched once.
    /// Anything else leaves the origins as they were (the pull then refuses,
    /// and the caller goes to the registry itself).
    async fn prove_shared(
        &self,
        client: &RegistryClient,
        repo: &str,
        digest: BlobDigest,
        size: u64,
    ) {
        let store = self.swarm.node().store().clone();
        let asked = client.base().to_string();
        let held = {
            let (store, asked) = (store.clone(), asked.clone());
            tokio::task::spawn_blocking(move || -> crate::Result<Option<Arc<Blob>>> {
                if store.origins(&digest)?.contains(&asked) {
                    return Ok(None);
                }
                Ok(store.get(&digest)?.filter(|b| b.is_complete()))
            })
            .await
        };
        let Ok(Ok(Some(blob))) = held else { return };
        if blob.map().size() != size || size == 0 {
            return;
        }
        // A blob no longer than a probe is read back whole.
        let probe = PROBE.min(size);
        let random = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            digest,
        );
        for start in [size - probe, random % (size - probe + 1)] {
            let theirs = client.blob_range(repo, &digest, start, probe).await;
            let blob = blob.clone();
            let ours =
                tokio::task::spawn_blocking(move || blob.read_range(start, probe as usize)).await;
            match (theirs, ours) {
                (Ok(t), Ok(Ok(o))) if t[..] == o[..] => {}
                _ => {
                    tracing::warn!(%digest, registry = %asked, start,
                        "the registry did not prove it holds the blob this node has from another: not served for it");
                    return;
                }
            }
        }
        if let Err(e) = store.add_origin(&digest, &asked) {
            tracing::warn!(%digest, error = %e, "could not record the blob's registry");
        }
    }

    /// Starts a pull of a blob (digest and size) from `client`'s registry,
    /// recording it as the blob's origin.
    fn start(
        self: &Arc<Self>,
        running: &mut HashMap<BlobDigest, Running>,
        client: Arc<RegistryClient>,
        repo: &str,
        (digest, size): (BlobDigest, u64),
        readers: Arc<Readers>,
    ) -> watch::Receiver<PullState> {
        let origin = client.base().to_string();
        let store = self.swarm.node().store().clone();
        if let Err(e) = store.add_origin(&digest, &origin) {
            tracing::warn!(%digest, error = %e, "could not record the blob's registry");
        }
        let (tx, rx) = watch::channel(PullState::Running);
        running.insert(
            digest,
            Running {
                state: rx.clone(),
                origin,
                readers,
            },
        );
        let (pulls, repo, mine) = (self.clone(), repo.to_string(), rx.clone());
        tokio::spawn(async move {
            let mut state = PullState::Running;
            // Bounded: the collector evicting the blob between the swarm
            // pull's end and this take (a complete blob is pulled again from
            // the store at once) is rare; several times in a row is a bug.
            for _ in 0..PULL_ATTEMPTS {
                let report = match pulls.swarm.pull_sized(&client, &repo, digest, size).await {
                    Ok(report) => report,
                    Err(e) => {
                        state = failed(&store, digest, e.to_string()).await;
                        break;
                    }
                };
                let s = store.clone();
                if let Ok(Ok(Some(blob))) =
                    tokio::task::spawn_blocking(move || s.get(&digest)).await
                    && blob.is_complete()
                {
                    state = PullState::Done(Arc::new(report), blob);
                    break;
                }
                tracing::info!(%digest, "the blob was evicted as its pull ended: pulling it again");
            }
            if matches!(state, PullState::Running) {
                let why = format!("evicted as soon as it was pulled, {PULL_ATTEMPTS} times");
                state = failed(&store, digest, why).await;
            }
            let _ = tx.send(state);
            let mut running = lock(&pulls.running);
            // A pull started after this one failed is not this one's to end.
            if running
                .get(&digest)
                .is_some_and(|r| r.state.same_channel(&mine))
            {
                running.remove(&digest);
            }
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
        let map = ChunkMap::unhashed(digest, size, self.swarm.config().chunk_size)
            .map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let store = self.swarm.node().store().clone();
        let blob = tokio::task::spawn_blocking(move || store.blob(&map))
            .await
            .map_err(|e| OpenError::Unavailable(e.to_string()))?
            .map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let mut progress = blob.subscribe();
        // The blob's own chunk size, which may predate today's setting.
        let available = |p: &Progress| {
            if p.complete {
                size
            } else {
                u64::from(p.chunks) * u64::from(blob.chunk_size())
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
            _credentials: None,
            pull_ended: false,
            pos: start,
            end,
            size,
        })
    }
}

/// A failed pull's state, once a file with nothing verified in it has
/// given its reserved disk back (before the failure is told, while no other
/// pull of the blob can start).
async fn failed(store: &Arc<ChunkStore>, digest: BlobDigest, why: String) -> PullState {
    tracing::warn!(%digest, error = %why, "blob pull failed");
    let store = store.clone();
    let discarded = tokio::task::spawn_blocking(move || store.discard_if_empty(&digest)).await;
    if let Ok(Err(e)) = discarded {
        tracing::warn!(%digest, error = %e, "could not remove the empty blob");
    }
    PullState::Failed(why)
}

/// Reads a blob's verified bytes in order as they arrive.
pub struct BlobReader {
    blob: Arc<Blob>,
    progress: watch::Receiver<Progress>,
    pull: watch::Receiver<PullState>,
    /// Keeps this reader's credentials in the pull while it reads.
    _credentials: Option<ReaderGuard>,
    pull_ended: bool,
    pos: u64,
    end: u64,
    size: u64,
}

impl BlobReader {
    /// Keeps `credentials` (from [`Pulls::admit`]) in the pull for as
    /// long as this reader reads.
    pub fn holding(mut self, credentials: Option<ReaderGuard>) -> Self {
        self._credentials = credentials;
        self
    }

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
                    u64::from(p.chunks) * u64::from(self.blob.chunk_size())
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
