//! Layers unpacked ahead of their `Prepare`. containerd prepares one layer at
//! a time; when the first remote `Prepare` of an image names the layers after
//! it (`cri.image-layers`), the agent is asked for those too, each into
//! `<root>/staging/<digest>-<n>`, at most `limit` at once. A later `Prepare`
//! claims its layer's result; results nobody claims expire after a TTL.
//!
//! A staged layer is known by what it was verified as: the manifest it was
//! asked for, its compressed digest and (once the agent answers) the diffID
//! the agent checked its tar against, which that manifest's config states.
//! Only a `Prepare` of the same manifest and layer finds it, and the
//! snapshotter commits it only where the parent's chain ID and that diffID
//! make the target chain ID (`crate::chain`): a layer staged for one image
//! is never committed under another image's name.

use crate::agent::{LayerSource, UnpackRequest};
use crate::layout::remove_tree;
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// A layer the agent unpacked and verified: where, and against which diffID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unpacked {
    pub dir: PathBuf,
    /// `sha256:<hex>` of the tar, as the agent checked it against the config.
    pub diff_id: String,
}

/// A staged layer's outcome, or why it failed.
pub type StagedResult = Shared<BoxFuture<'static, Result<Unpacked, String>>>;

/// What a staged layer was asked for as: one layer of one manifest.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StageKey {
    pub manifest_digest: String,
    pub layer_digest: String,
}

impl StageKey {
    pub fn new(manifest_digest: &str, layer_digest: &str) -> StageKey {
        StageKey {
            manifest_digest: manifest_digest.to_string(),
            layer_digest: layer_digest.to_string(),
        }
    }
}

struct Staged {
    started: Instant,
    dir: PathBuf,
    result: StagedResult,
    claimed: bool,
}

/// The staging area and the agent requests running into it.
pub struct Prefetcher<A> {
    agent: Arc<A>,
    staging: PathBuf,
    limit: Arc<Semaphore>,
    enabled: bool,
    ttl: Duration,
    next: AtomicU64,
    staged: Mutex<HashMap<StageKey, Staged>>,
}

impl<A: LayerSource> Prefetcher<A> {
    /// Empties `staging` (nothing staged by an earlier run can be claimed).
    pub fn new(agent: Arc<A>, staging: &Path, limit: usize, ttl: Duration) -> Self {
        if let Ok(entries) = std::fs::read_dir(staging) {
            for entry in entries.flatten() {
                remove_tree(&entry.path());
            }
        }
        Prefetcher {
            agent,
            staging: staging.to_path_buf(),
            limit: Arc::new(Semaphore::new(limit)),
            enabled: limit > 0,
            ttl,
            next: AtomicU64::new(0),
            staged: Mutex::default(),
        }
    }

    /// Starts unpacking `layer_digest` of the image's manifest
    /// `manifest_digest` unless it is staged or on its way already.
    pub fn start(&self, image_ref: &str, manifest_digest: &str, layer_digest: &str) {
        if !self.enabled {
            return;
        }
        let key = StageKey::new(manifest_digest, layer_digest);
        let mut staged = self.staged.lock().expect("staging lock");
        if staged.contains_key(&key) {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}", layer_digest.replace([':', '/', '.'], "-"));
        let dir = self.staging.join(name);
        let request = UnpackRequest {
            image_ref: image_ref.to_string(),
            manifest_digest: manifest_digest.to_string(),
            layer_digest: layer_digest.to_string(),
            target: dir.clone(),
        };
        let (agent, limit) = (self.agent.clone(), self.limit.clone());
        let task = tokio::spawn(async move {
            let _permit = limit.acquire_owned().await.map_err(|e| e.to_string())?;
            match agent.unpack(&request).await {
                Ok(report) => Ok(Unpacked {
                    dir: request.target,
                    diff_id: report.diff_id,
                }),
                Err(e) => {
                    remove_tree(&request.target);
                    Err(e.to_string())
                }
            }
        });
        let result = task
            .map(|joined| joined.unwrap_or_else(|e| Err(format!("prefetch task failed: {e}"))))
            .boxed()
            .shared();
        tracing::debug!(layer = layer_digest, manifest = manifest_digest, dir = %dir.display(), "prefetching layer");
        staged.insert(
            key,
            Staged {
                started: Instant::now(),
                dir,
                result,
                claimed: false,
            },
        );
    }

    /// The staged result for `key`, if one was started; the entry stays
    /// (safe from `sweep`) until [`release`](Self::release).
    pub fn claim(&self, key: &StageKey) -> Option<StagedResult> {
        let mut staged = self.staged.lock().expect("staging lock");
        staged.get_mut(key).map(|s| {
            s.claimed = true;
            s.result.clone()
        })
    }

    /// Forgets a claimed layer once its directory has moved out of staging
    /// (or was found unusable: the next sweep removes what is left of it).
    pub fn release(&self, key: &StageKey) {
        self.staged.lock().expect("staging lock").remove(key);
    }

    /// Drops finished results older than the TTL and staging directories
    /// that no running or finished request owns; returns what it removed.
    pub fn sweep(&self, now: Instant) -> Vec<PathBuf> {
        let owned: Vec<PathBuf> = {
            let mut staged = self.staged.lock().expect("staging lock");
            staged.retain(|_, s| {
                // Polling a clone drives the shared future to the task's result.
                let finished = s.result.clone().now_or_never().is_some();
                s.claimed || !finished || now.duration_since(s.started) < self.ttl
            });
            staged.values().map(|s| s.dir.clone()).collect()
        };
        let mut removed = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.staging) {
            for entry in entries.flatten() {
                let path = entry.path();
                if !owned.contains(&path) {
                    remove_tree(&path);
                    removed.push(path);
                }
            }
        }
        removed
    }
}
