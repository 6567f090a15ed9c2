//! The agent's local API: HTTP on a unix socket that only root (and the
//! socket's group) can open, for the processes on this node that need more
//! than the registry API:
//!
//! - `POST /v1/layers/unpack`: the snapshotter shim asks for one layer of an
//!   image to be pulled through the swarm and unpacked into a directory. The
//!   unpacker reads the blob's verified prefix as it grows, so unpacking
//!   overlaps the download; the answer comes once the blob matched its digest
//!   and the tar its diffID. On failure the directory is removed.
//! - `POST /v1/layers/describe`: a layer's size and media type, from the
//!   image's manifest (the shim sets its deadline for the unpack by the size).
//! - `POST /v1/images/pull`: pulls every layer of an image into the store,
//!   answering with one JSON progress line per tick (`dray pull`).
//! - `GET /v1/status`: what the node is doing now (`dray status`; see
//!   [`crate::serving::status`]).
//! - `POST /v1/gc`: one garbage collection now, or a dry run (`dray gc`).
//! - `GET`, `POST`, `DELETE /v1/pins`: the images pinned at run time, whose
//!   config and layers are never evicted (`dray pin`, `dray unpin`).
//!
//! The same pulls run the preheat jobs the tracker hands the node
//! ([`LocalApi::run_preheats`]). Every pull here is held to the mirror's
//! rules: images of the registries the mirror serves only, sizes the
//! manifest and the registry agree on, and no blob held from another
//! registry unless this one proves it has the same bytes
//! ([`LocalApi::start_pull`]).
//!
//! A unix socket rather than TCP because the unpack call writes where it is
//! told as root: only local, privileged clients may make it, and only into
//! a new directory under `local_api.unpack_roots` (the snapshotter's root).

use crate::pull::registry::RegistryClient;
use crate::pull::{OriginError, PullState, Pulls};
use crate::serving::image::{self, Image, ImageError, ImageRef, Layer};
use crate::serving::mirror::MirrorConfig;
use crate::unpack::{
    Compression, ReadAt, UnpackLimits, Unpacked, cores, memory_cap, unpack_gzip_parallel_within,
    unpack_layer_within,
};
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dray_protocol::BlobDigest;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

/// How often `POST /v1/images/pull` reports progress.
const TICK: Duration = Duration::from_millis(250);

/// Local API settings; every key optional.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalApiConfig {
    /// The unix socket (created with mode 0660; a stale file is replaced).
    pub socket: PathBuf,
    /// Layers unpacked at once; 0 means one per core.
    pub unpack_concurrency: usize,
    /// Directories an unpack target must lie under, symlinks resolved: the
    /// snapshotter's root. The unpack writes as root wherever it is told, so
    /// a target anywhere else (`/etc/...`) is refused.
    pub unpack_roots: Vec<PathBuf>,
}

impl Default for LocalApiConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from("/run/dray/agent.sock"),
            unpack_concurrency: 0,
            // The snapshotter's default root.
            unpack_roots: vec![PathBuf::from("/var/lib/dray/snapshotter")],
        }
    }
}

use dray_protocol::local_api::{DESCRIBE_PATH, UNPACK_PATH};
pub use dray_protocol::local_api::{
    DescribeRequest, LayerDescription, UnpackRequest, UnpackResponse,
};

/// `POST /v1/images/pull` request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullRequest {
    pub image: String,
}

/// One line of the `POST /v1/images/pull` answer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PullProgress {
    pub image: String,
    pub layers: Vec<LayerProgress>,
    /// Every layer is complete and verified.
    pub done: bool,
    /// Why the pull stopped, on the last line.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LayerProgress {
    pub digest: String,
    pub size: u64,
    /// Verified bytes on disk.
    pub have: u64,
    pub complete: bool,
    pub bytes_from_peers: u64,
    pub bytes_from_registry: u64,
}

/// An error answered as `{"error": "..."}`.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl From<ImageError> for ApiError {
    fn from(e: ImageError) -> Self {
        let status = match &e {
            ImageError::Reference { .. } => StatusCode::BAD_REQUEST,
            _ => StatusCode::BAD_GATEWAY,
        };
        ApiError(status, e.to_string())
    }
}

/// The local API's state.
pub struct LocalApi {
    pulls: Arc<Pulls>,
    mirror: MirrorConfig,
    unpacks: Semaphore,
    started: Instant,
    /// Images resolved by manifest digest (immutable content), so that the
    /// unpack of each of an image's layers does not fetch its manifest and
    /// config again.
    resolved: Mutex<HashMap<(String, String, BlobDigest), Image>>,
    unpack_roots: Vec<PathBuf>,
    /// What one layer may ask of the unpacker (the agent's `[unpack]`).
    limits: UnpackLimits,
}

/// Resolved images kept at most; the cache is emptied when it is full.
const RESOLVED_CACHE: usize = 256;

impl LocalApi {
    pub(crate) fn new(
        pulls: Arc<Pulls>,
        mirror: MirrorConfig,
        config: &LocalApiConfig,
        limits: UnpackLimits,
    ) -> Arc<Self> {
        let slots = match config.unpack_concurrency {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        Arc::new(Self {
            pulls,
            mirror,
            unpacks: Semaphore::new(slots),
            started: Instant::now(),
            resolved: Mutex::new(HashMap::new()),
            unpack_roots: config.unpack_roots.clone(),
            limits,
        })
    }

    pub(crate) fn router(self: &Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route(UNPACK_PATH, axum::routing::post(unpack))
            .route(DESCRIBE_PATH, axum::routing::post(describe))
            .route("/v1/images/pull", axum::routing::post(pull))
            .route("/v1/status", axum::routing::get(status))
            .route("/v1/gc", axum::routing::post(collect))
            .route("/v1/pins", axum::routing::get(pins).post(pin).delete(unpin))
            .with_state(self.clone())
    }

    /// The registry client of an image reference, for a registry the
    /// mirror serves only (the mirror's allow-list, checked before any
    /// connection): any pod's image reaches this API through the
    /// snapshotter, and must not make the agent connect where it names.
    fn client(&self, image: &ImageRef) -> Result<Arc<RegistryClient>, ApiError> {
        if !self.mirror.serves(&image.registry) {
            return Err(ApiError(
                StatusCode::FORBIDDEN,
                format!(
                    "registry {} is not one this node's mirror serves (mirror.registries, mirror.upstreams, mirror.default_registry): the agent pulls nothing from it",
                    image.registry
                ),
            ));
        }
        self.pulls
            .upstream(&self.mirror.upstream(&image.registry))
            .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, e.to_string()))
    }

    /// Starts or joins the swarm pull of one blob an image's manifest lists
    /// with `size`, from the image's registry, under the mirror's rules:
    /// the registry's own answer (a HEAD, the access check) must give the
    /// manifest's size, so no more disk is reserved than both agree on;
    /// that size must pass the store's limit; and a blob held from another
    /// registry is refused unless this one proves it holds the same bytes
    /// ([`Pulls::admit`]). Every pull the local API starts comes through here.
    async fn start_pull(
        &self,
        image: &ImageRef,
        client: &RegistryClient,
        (digest, size): (BlobDigest, u64),
    ) -> Result<watch::Receiver<PullState>, ApiError> {
        let stored = client
            .blob_size(&image.repo, &digest)
            .await
            .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, format!("blob {digest}: {e}")))?;
        if stored != size {
            return Err(ApiError(
                StatusCode::BAD_GATEWAY,
                format!(
                    "blob {digest}: the registry holds {stored} bytes, the manifest says {size}"
                ),
            ));
        }
        let store = self.pulls.swarm().node().store();
        store
            .check_size(&digest, size)
            .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, e.to_string()))?;
        let named = self.mirror.names(&image.registry);
        let (pull, _) = self
            .pulls
            .admit(client, named, &image.repo, digest, size)
            .await
            .map_err(|e| match e {
                OriginError::Elsewhere { .. } => ApiError(StatusCode::FORBIDDEN, e.to_string()),
                OriginError::Store { .. } => ApiError(StatusCode::BAD_GATEWAY, e.to_string()),
            })?;
        Ok(pull)
    }

    async fn resolve(
        &self,
        image_ref: &str,
        reference: Option<&str>,
    ) -> Result<(ImageRef, Arc<RegistryClient>, Image), ApiError> {
        let image: ImageRef = image_ref.parse()?;
        let client = self.client(&image)?;
        let reference = reference.unwrap_or(&image.reference);
        // Only a digest names content that cannot change; tags are resolved anew.
        let key = reference
            .parse::<BlobDigest>()
            .ok()
            .map(|d| (client.base().to_string(), image.repo.clone(), d));
        let cache = || self.resolved.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(hit) = key.as_ref().and_then(|k| cache().get(k).cloned()) {
            return Ok((image, client, hit));
        }
        let resolved = image::resolve(&client, &image.repo, reference).await?;
        if let Some(k) = key {
            let mut c = cache();
            if c.len() >= RESOLVED_CACHE {
                c.clear();
            }
            c.insert(k, resolved.clone());
        }
        Ok((image, client, resolved))
    }

    /// The manifest's entry for one layer, with the image and its registry client.
    async fn layer(
        &self,
        image_ref: &str,
        manifest_digest: &str,
        digest: BlobDigest,
    ) -> Result<(ImageRef, Arc<RegistryClient>, Layer), ApiError> {
        let (image, client, resolved) = self.resolve(image_ref, Some(manifest_digest)).await?;
        let layer = resolved.layer(&digest).cloned().ok_or_else(|| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("layer {digest} is not in manifest {manifest_digest} of {image_ref}"),
            )
        })?;
        Ok((image, client, layer))
    }

    async fn describe(&self, req: DescribeRequest) -> Result<LayerDescription, ApiError> {
        let digest = layer_digest(&req.layer_digest)?;
        let (_, _, layer) = self
            .layer(&req.image_ref, &req.manifest_digest, digest)
            .await?;
        Ok(LayerDescription {
            layer_digest: digest.to_string(),
            size: layer.size,
            media_type: layer.media_type,
        })
    }

    async fn unpack(&self, mut req: UnpackRequest) -> Result<UnpackResponse, ApiError> {
        let started = Instant::now();
        let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
        let digest = layer_digest(&req.layer_digest)?;
        req.target = check_target(&req.target, &self.unpack_roots)?;
        let (image, client, layer) = self
            .layer(&req.image_ref, &req.manifest_digest, digest)
            .await?;
        // An artifact's blob has no diffID to check a tar against.
        let diff_id = layer.diff_id.clone().ok_or_else(|| {
            bad(format!(
                "blob {digest} ({}) of {} belongs to an artifact, not an image: it is pulled, never unpacked",
                layer.media_type, req.image_ref
            ))
        })?;
        let compression = Compression::from_media_type(&layer.media_type)
            .map_err(|e| bad(format!("layer {digest}: {e}")))?;
        // The download starts now; the unpack waits for a slot (it catches up
        // with what has arrived meanwhile).
        let pull = self
            .start_pull(&image, &client, (digest, layer.size))
            .await?;
        let _slot = self.unpacks.acquire().await.expect("never closed");
        // Dropped with this future when the caller hangs up (the shim's
        // deadline passed): the unpacker then fails and removes its target
        // instead of writing on into a directory nobody waits for.
        let gone = CancellationToken::new();
        let _hung_up = gone.clone().drop_guard();
        let target = req.target.clone();
        let limits = self.limits.clone();
        let gzip_threads = match compression {
            Compression::Gzip => limits.parallel_gzip.threads_for(layer.size, cores()),
            _ => 1,
        };
        tracing::info!(%digest, target = %req.target.display(), compressed_bytes = layer.size, ?compression, gzip_threads, memory_cap_bytes = (gzip_threads > 1).then(|| memory_cap(gzip_threads)), "unpacking layer");
        let unpack = if gzip_threads > 1 {
            let blob = StoreRange {
                pulls: self.pulls.clone(),
                digest,
                size: layer.size,
                pull: pull.clone(),
                gone,
                runtime: tokio::runtime::Handle::current(),
            };
            tokio::task::spawn_blocking(move || {
                unpack_gzip_parallel_within(
                    blob,
                    layer.size,
                    gzip_threads,
                    &target,
                    Some(&diff_id),
                    &limits,
                )
            })
        } else {
            let reader = self
                .pulls
                .open(digest, layer.size, 0, layer.size, pull.clone())
                .await
                .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, e.to_string()))?;
            let stream =
                tokio_util::io::StreamReader::new(until_cancelled(reader.into_stream(), gone));
            let bridge = tokio_util::io::SyncIoBridge::new(stream);
            tokio::task::spawn_blocking(move || {
                unpack_layer_within(bridge, compression, &target, Some(&diff_id), &limits)
            })
        };
        let unpacked: Unpacked = unpack
            .await
            .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(|e| {
                ApiError(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!("layer {digest}: {e}"),
                )
            })?;
        // The tar ended; the blob's last chunk and its digest must still hold.
        let verified = match self
            .pulls
            .open(digest, layer.size, layer.size, layer.size, pull)
            .await
        {
            Ok(r) => r.verified().await,
            Err(e) => Err(std::io::Error::other(e.to_string())),
        };
        if let Err(e) = verified {
            let _ = std::fs::remove_dir_all(&req.target);
            return Err(ApiError(
                StatusCode::BAD_GATEWAY,
                format!("layer {digest}: {e}"),
            ));
        }
        let metrics = self.pulls.swarm().node().metrics();
        metrics.unpacked(unpacked.uncompressed_bytes);
        tracing::info!(%digest, target = %req.target.display(), seconds = started.elapsed().as_secs_f64(), "layer unpacked");
        Ok(UnpackResponse {
            layer_digest: digest.to_string(),
            diff_id: unpacked.diff_id,
            compressed_bytes: layer.size,
            uncompressed_bytes: unpacked.uncompressed_bytes,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// A layer blob as the store has it, read where the parallel gzip decoder
/// asks: a read waits until its range is verified (today that is when the
/// in-order prefix reaches it), and fails once the caller hung up.
struct StoreRange {
    pulls: Arc<Pulls>,
    digest: BlobDigest,
    size: u64,
    pull: watch::Receiver<PullState>,
    gone: CancellationToken,
    runtime: tokio::runtime::Handle,
}

impl ReadAt for StoreRange {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.size)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let end = self.size.min(offset.saturating_add(buf.len() as u64));
        if offset >= end {
            return Ok(0);
        }
        // Called on the decoder's own threads (never a runtime worker).
        self.runtime.block_on(async {
            let reader = self
                .pulls
                .open(self.digest, self.size, offset, end, self.pull.clone())
                .await
                .map_err(std::io::Error::other)?;
            let mut frames = until_cancelled(reader.into_stream(), self.gone.clone());
            let mut n = 0;
            while let Some(frame) = frames.next().await {
                let frame = frame?;
                buf[n..n + frame.len()].copy_from_slice(&frame);
                n += frame.len();
            }
            Ok(n)
        })
    }
}

/// `stream`, cut with an error once `gone` is cancelled.
fn until_cancelled(
    stream: BoxStream<'static, std::io::Result<Bytes>>,
    gone: CancellationToken,
) -> BoxStream<'static, std::io::Result<Bytes>> {
    futures_util::stream::unfold(Some(stream), move |state| {
        let gone = gone.clone();
        async move {
            let mut stream = state?;
            tokio::select! {
                biased;
                _ = gone.cancelled() => Some((
                    Err(std::io::Error::other("the client hung up; unpack abandoned")),
                    None,
                )),
                item = stream.next() => item.map(|i| (i, Some(stream))),
            }
        }
    })
    .boxed()
}

fn layer_digest(text: &str) -> Result<BlobDigest, ApiError> {
    text.parse()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("layer_digest: {e}")))
}

/// The target must be absolute, free of `..`, and not exist yet; its parent
/// must, and with its symlinks resolved lie under one of `roots`. Returns the
/// target with its parent resolved, so that what is checked is what the
/// unpacker creates.
fn check_target(target: &Path, roots: &[PathBuf]) -> Result<PathBuf, ApiError> {
    let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(bad(format!(
            "target {} must be an absolute path without ..",
            target.display()
        )));
    };
    if !target.is_absolute()
        || target
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(bad(format!(
            "target {} must be an absolute path without ..",
            target.display()
        )));
    }
    if target.symlink_metadata().is_ok() {
        return Err(bad(format!("target {} already exists", target.display())));
    }
    let real_parent = match parent.canonicalize() {
        Ok(p) if p.is_dir() => p,
        _ => {
            return Err(bad(format!(
                "the parent directory of target {} does not exist",
                target.display()
            )));
        }
    };
    let real = real_parent.join(name);
    // A root that does not exist holds nothing; one that is a symlink counts
    // as where it points.
    if roots
        .iter()
        .filter_map(|r| r.canonicalize().ok())
        .any(|root| real.starts_with(&root) && real != root)
    {
        return Ok(real);
    }
    let allowed = roots
        .iter()
        .map(|r| r.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let resolved = if real == target {
        String::new()
    } else {
        format!(" (resolved: {})", real.display())
    };
    Err(ApiError(
        StatusCode::FORBIDDEN,
        format!(
            "target {}{resolved} is outside the unpack roots [{allowed}]: the agent unpacks only under local_api.unpack_roots, which should name the snapshotter's root",
            target.display()
        ),
    ))
}

async fn describe(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<DescribeRequest>,
) -> Result<Json<LayerDescription>, ApiError> {
    api.describe(req).await.map(Json)
}

async fn unpack(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<UnpackRequest>,
) -> Result<Json<UnpackResponse>, ApiError> {
    match api.unpack(req.clone()).await {
        Ok(r) => Ok(Json(r)),
        Err(e) => {
            tracing::warn!(layer = %req.layer_digest, image = %req.image_ref, error = %e.1, "unpack failed");
            Err(e)
        }
    }
}

async fn status(State(api): State<Arc<LocalApi>>) -> Json<crate::serving::status::Status> {
    Json(crate::serving::status::of(api.pulls.swarm(), api.started).await)
}

#[derive(Debug, Default, Deserialize)]
pub struct GcRequest {
    /// List what would be evicted now, and evict nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// `POST /v1/gc`: one garbage collection now (`dray gc`).
async fn collect(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<GcRequest>,
) -> Result<Json<crate::store::gc::Collection>, ApiError> {
    let store = api.pulls.swarm().node().store().clone();
    tokio::task::spawn_blocking(move || crate::store::gc::collect(&store, req.dry_run))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map(Json)
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `POST /v1/pins` and `DELETE /v1/pins` request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PinRequest {
    pub image: String,
}

/// `GET /v1/pins`: the images pinned at run time.
async fn pins(State(api): State<Arc<LocalApi>>) -> Json<Vec<crate::store::gc::PinnedImage>> {
    Json(api.pulls.swarm().node().store().gc().pinned_images())
}

/// `POST /v1/pins`: resolves the image (an index to this node's platform)
/// and pins its config and layers; answers the image as pinned.
async fn pin(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<PinRequest>,
) -> Result<Json<crate::store::gc::PinnedImage>, ApiError> {
    let (image, _, resolved) = api.resolve(&req.image, None).await?;
    let mut blobs = vec![resolved.config];
    blobs.extend(resolved.layers.iter().map(|l| l.digest));
    let name = image.to_string();
    let store = api.pulls.swarm().node().store().clone();
    store
        .gc()
        .pin(&name, blobs.clone())
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    tracing::info!(image = %name, blobs = blobs.len(), "image pinned");
    Ok(Json(crate::store::gc::PinnedImage {
        image: name,
        blobs: blobs.iter().map(ToString::to_string).collect(),
    }))
}

/// `DELETE /v1/pins`: unpins an image; 404 if it is not pinned.
async fn unpin(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<PinRequest>,
) -> Result<Json<crate::store::gc::PinnedImage>, ApiError> {
    let name = req.image.parse::<ImageRef>()?.to_string();
    let gc = api.pulls.swarm().node().store().gc();
    let was = gc.pinned_images().into_iter().find(|p| p.image == name);
    let removed = gc
        .unpin(&name)
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    match was.filter(|_| removed) {
        Some(p) => {
            tracing::info!(image = %name, "image unpinned");
            Ok(Json(p))
        }
        None => {
            let pinned: Vec<String> = gc.pinned_images().into_iter().map(|p| p.image).collect();
            Err(ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "{name} is not pinned (pinned: {})",
                    if pinned.is_empty() {
                        "none".to_string()
                    } else {
                        pinned.join(", ")
                    }
                ),
            ))
        }
    }
}

/// The swarm pulls of an image's blobs, started or joined, with their sizes.
type BlobPulls = Vec<(BlobDigest, u64, watch::Receiver<PullState>)>;

impl LocalApi {
    /// Starts (or joins) the swarm pulls of `blobs` of `image` at `client`
    /// ([`Self::start_pull`]), once the store has said the whole image could
    /// fit ([`crate::store::ChunkStore::check_image`]); the first refused
    /// ends it.
    async fn start_pulls(
        &self,
        image: &ImageRef,
        client: &RegistryClient,
        blobs: Vec<(BlobDigest, u64)>,
    ) -> Result<BlobPulls, ApiError> {
        self.pulls
            .swarm()
            .node()
            .store()
            .check_image(&blobs)
            .map_err(|e| ApiError(StatusCode::INSUFFICIENT_STORAGE, e.to_string()))?;
        let mut pulls = Vec::new();
        for (digest, size) in blobs {
            let rx = self.start_pull(image, client, (digest, size)).await?;
            pulls.push((digest, size, rx));
        }
        Ok(pulls)
    }

    /// Runs the preheat jobs the tracker hands this node until `tasks`
    /// closes: each resolves its image (from a registry the mirror serves
    /// only) and pulls the config and layers into the store, through the
    /// swarm, without unpacking them.
    pub async fn run_preheats(
        self: Arc<Self>,
        mut tasks: tokio::sync::mpsc::UnboundedReceiver<crate::discovery::preheat::Task>,
    ) {
        while let Some(task) = tasks.recv().await {
            let api = self.clone();
            tokio::spawn(async move {
                let result = api.preheat(&task).await;
                let swarm = api.pulls.swarm();
                match &result {
                    Ok(()) => {
                        tracing::info!(id = %task.id, image = %task.image, "preheat job done")
                    }
                    Err(e) => {
                        tracing::warn!(id = %task.id, image = %task.image, error = %e, "preheat job failed")
                    }
                }
                swarm.preheats().finish(&task.id, result);
                swarm.announce_soon();
            });
        }
    }

    async fn preheat(&self, task: &crate::discovery::preheat::Task) -> Result<(), String> {
        let (image, client, resolved) = self.resolve(&task.image, None).await.map_err(|e| e.1)?;
        let blobs = std::iter::once((resolved.config, resolved.config_size))
            .chain(resolved.layers.iter().map(|l| (l.digest, l.size)))
            .collect();
        let pulls = self
            .start_pulls(&image, &client, blobs)
            .await
            .map_err(|e| e.1)?;
        let store = self.pulls.swarm().node().store().clone();
        let board = self.pulls.swarm().preheats();
        loop {
            tokio::time::sleep(TICK).await;
            let (line, ended) = progress(&task.image, &pulls, &store);
            let have = line.layers.iter().map(|l| l.have).sum();
            let size = line.layers.iter().map(|l| l.size).sum();
            board.progress(&task.id, have, size);
            if ended {
                return line.error.map_or(Ok(()), Err);
            }
        }
    }
}

/// Where the pulls of `blobs` are, as a progress line; and whether every
/// one has ended.
fn progress(
    name: &str,
    blobs: &BlobPulls,
    store: &crate::store::ChunkStore,
) -> (PullProgress, bool) {
    let mut line = PullProgress {
        image: name.to_string(),
        ..Default::default()
    };
    let mut ended = true;
    for (digest, size, rx) in blobs {
        let mut p = LayerProgress {
            digest: digest.to_string(),
            size: *size,
            ..Default::default()
        };
        if let Ok(Some(blob)) = store.get(digest) {
            p.have = blob.held_bytes();
            p.complete = blob.is_complete();
        }
        match &*rx.borrow() {
            PullState::Running => ended = false,
            PullState::Done(r, _) => {
                p.bytes_from_peers = r.bytes_from_peers;
                p.bytes_from_registry = r.bytes_from_registry;
                p.complete = true;
                p.have = *size;
            }
            PullState::Failed(e) => {
                line.error.get_or_insert_with(|| format!("{digest}: {e}"));
            }
        }
        line.layers.push(p);
    }
    line.done = ended && line.error.is_none();
    (line, ended)
}

async fn pull(
    State(api): State<Arc<LocalApi>>,
    Json(req): Json<PullRequest>,
) -> Result<Response, ApiError> {
    let (image, client, resolved) = api.resolve(&req.image, None).await?;
    let store = api.pulls.swarm().node().store().clone();
    let layers = resolved.layers.iter().map(|l| (l.digest, l.size)).collect();
    let blobs = api.start_pulls(&image, &client, layers).await?;
    let name = req.image.clone();
    // One line per tick until every pull has ended.
    let lines = futures_util::stream::unfold(Some(()), move |state| {
        let (blobs, store, name) = (blobs.clone(), store.clone(), name.clone());
        async move {
            state?;
            tokio::time::sleep(TICK).await;
            let (line, ended) = progress(&name, &blobs, &store);
            let mut text = serde_json::to_string(&line).expect("serializable");
            text.push('\n');
            Some((
                Ok::<_, std::io::Error>(Bytes::from(text)),
                (!ended).then_some(()),
            ))
        }
    });
    Ok(Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(lines.boxed()))
        .expect("valid response"))
}

/// Binds the socket: creates its directory, replaces a stale socket file and
/// restricts it to owner and group.
pub(crate) fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path)?
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
