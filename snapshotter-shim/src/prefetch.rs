//! Layers unpacked ahead of their `Prepare`. containerd prepares one layer at
//! a time; when the first remote `Prepare` of an image names the layers after
//! it (`cri.image-layers`), the agent is asked for those too, each into
//! `<root>/staging/<digest>-<n>`, at most `limit` at once. A later `Prepare`
//! claims its layer's result; results nobody claims expire after a TTL.

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

/// A staged layer's outcome: its unpacked directory, or why it failed.
pub type StagedResult = Shared<BoxFuture<'static, Result<PathBuf, String>>>;

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
    staged: Mutex<HashMap<String, Staged>>,
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

    /// Starts unpacking `layer_digest` of the image unless it is staged or
    /// on its way already.
    pub fn start(&self, image_ref: &str, manifest_digest: &str, layer_digest: &str) {
        if !self.enabled {
            return;
        }
        let mut staged = self.staged.lock().expect("staging lock");
        if staged.contains_key(layer_digest) {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}", layer_digest.replace([':', '/'], "-"));
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
                Ok(_) => Ok(request.target),
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
        tracing::debug!(layer = layer_digest, dir = %dir.display(), "prefetching layer");
        staged.insert(
            layer_digest.to_string(),
            Staged {
                started: Instant::now(),
                dir,
                result,
                claimed: false,
            },
        );
    }

    /// The staged result for `layer_digest`, if one was started; the entry
    /// stays (safe from `sweep`) until [`release`](Self::release).
    pub fn claim(&self, layer_digest: &str) -> Option<StagedResult> {
        let mut staged = self.staged.lock().expect("staging lock");
        staged.get_mut(layer_digest).map(|s| {
            s.claimed = true;
            s.result.clone()
        })
    }

    /// Forgets a claimed layer once its directory has moved out of staging.
    pub fn release(&self, layer_digest: &str) {
        self.staged
            .lock()
            .expect("staging lock")
            .remove(layer_digest);
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
