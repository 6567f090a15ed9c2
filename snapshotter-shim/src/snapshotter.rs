//! The snapshotter: containerd's overlayfs rules (kinds, parents, mounts,
//! usage, cleanup) over [`MetaStore`] and [`Layout`], and the remote-layer
//! path that asks the agent to unpack a layer and commits it under the chain
//! ID that containerd's `containerd.io/snapshot.ref` label names, once that
//! chain ID is the one the parent's chain ID and the diffID the agent
//! verified the layer's tar against make ([`crate::chain`]).

use crate::agent::{LayerSource, UnpackRequest};
use crate::chain::{chain_id, parent_chain_id};
use crate::error::SnapshotError;
use crate::filter::{Fields, FilterSet};
use crate::layout::{Layout, NewDir, disk_usage, remove_tree};
use crate::meta::{Kind, MetaStore, Record, Usage};
use crate::parents::inherit_implicit_parents;
use crate::pb::types::Mount;
use crate::prefetch::{Prefetcher, StageKey};
use dray_protocol::BlobDigest;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Snapshot labels.
pub type Labels = BTreeMap<String, String>;

/// The committed name containerd expects a remote snapshot under (the chain ID).
pub const LABEL_REF: &str = "containerd.io/snapshot.ref";
/// The layer's compressed blob digest (CRI image service).
pub const LABEL_LAYER_DIGEST: &str = "containerd.io/snapshot/cri.layer-digest";
/// The image reference being pulled.
pub const LABEL_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
/// The image manifest's digest.
pub const LABEL_MANIFEST_DIGEST: &str = "containerd.io/snapshot/cri.manifest-digest";
/// This layer's digest and those of the layers after it, comma-separated.
pub const LABEL_IMAGE_LAYERS: &str = "containerd.io/snapshot/cri.image-layers";

/// A `Prepare` the agent can serve: the layer and where containerd expects it.
#[derive(Debug)]
struct RemoteLayer {
    target: String,
    layer_digest: String,
    image_ref: String,
    manifest_digest: String,
    following: Vec<String>,
}

impl RemoteLayer {
    fn from_labels(labels: &Labels) -> Option<RemoteLayer> {
        let get = |k: &str| labels.get(k).filter(|v| !v.is_empty()).cloned();
        let layer_digest = get(LABEL_LAYER_DIGEST)?;
        let following = get(LABEL_IMAGE_LAYERS)
            .map(|all| {
                let all: Vec<String> = all.split(',').map(|d| d.trim().to_string()).collect();
                let after = all
                    .iter()
                    .position(|d| *d == layer_digest)
                    .map_or(0, |i| i + 1);
                all[after..]
                    .iter()
                    .filter(|d| !d.is_empty() && **d != layer_digest)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        Some(RemoteLayer {
            target: get(LABEL_REF)?,
            image_ref: get(LABEL_IMAGE_REF)?,
            manifest_digest: get(LABEL_MANIFEST_DIGEST)?,
            layer_digest,
            following,
        })
    }
}

/// A snapshot as `Stat` and `List` report it.
#[derive(Clone, Debug)]
pub struct Info {
    pub name: String,
    pub record: Record,
}

impl Fields for Info {
    fn field(&self, path: &[String]) -> Option<String> {
        match path.first()?.as_str() {
            "name" => Some(self.name.clone()),
            "parent" => Some(self.record.parent.clone()),
            "kind" => Some(self.record.kind.as_str().to_string()),
            "labels" => self.record.labels.get(&path[1..].join(".")).cloned(),
            _ => None,
        }
    }
}

/// The snapshotter behind the gRPC service.
pub struct Snapshotter<A> {
    layout: Layout,
    meta: MetaStore,
    agent: Arc<A>,
    prefetch: Prefetcher<A>,
    /// One remote `Prepare` per chain ID at a time (two namespaces may pull
    /// the same image at once).
    remote: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Whether the kernel's overlay has an `index` feature to turn off, as
    /// containerd's overlayfs snapshotter checks.
    index_off: bool,
}

/// Why a remote `Prepare` did not produce a committed snapshot.
#[derive(Debug, thiserror::Error)]
enum RemoteMiss {
    #[error("{0}")]
    NotApplicable(String),
    #[error("agent could not unpack layer {layer}: {reason}")]
    Agent { layer: String, reason: String },
    #[error(transparent)]
    Chain(Box<ChainMismatch>),
    #[error(transparent)]
    Local(#[from] SnapshotError),
}

/// A layer whose verified diffID does not make the chain ID it was asked for.
#[derive(Debug, thiserror::Error)]
#[error(
    "layer {layer} of manifest {manifest} was verified as diffID {diff_id}; on parent chain {parent} that makes chain ID {made}, not {target}, the chain ID containerd asked to commit it under, so it is not committed there"
)]
struct ChainMismatch {
    layer: String,
    manifest: String,
    diff_id: String,
    parent: String,
    made: String,
    target: String,
}

/// What a remote commit writes: the chain ID containerd asked for, on the
/// parent's chain ID (none for an image's first layer).
struct Chain {
    parent: Option<BlobDigest>,
    target: BlobDigest,
}

impl Chain {
    /// Whether a layer verified as `diff_id` belongs under the target.
    fn check(&self, layer: &RemoteLayer, diff_id: &str) -> Result<(), RemoteMiss> {
        let made = diff_id
            .parse::<BlobDigest>()
            .map(|d| chain_id(self.parent.as_ref(), &d));
        if made.as_ref() == Ok(&self.target) {
            return Ok(());
        }
        Err(RemoteMiss::Chain(Box::new(ChainMismatch {
            layer: layer.layer_digest.clone(),
            manifest: layer.manifest_digest.clone(),
            diff_id: diff_id.to_string(),
            parent: self
                .parent
                .map_or_else(|| "(none: the first layer)".to_string(), |p| p.to_string()),
            made: made.map_or_else(
                |_| "(none: not a sha256 diffID)".to_string(),
                |c| c.to_string(),
            ),
            target: self.target.to_string(),
        })))
    }
}

impl<A: LayerSource> Snapshotter<A> {
    /// Opens (or creates) the snapshotter under `root`, asking `agent` for
    /// remote layers, with up to `prefetch_limit` layers unpacked ahead, kept
    /// for `staged_ttl` if nobody claims them.
    pub fn open(
        root: &Path,
        agent: A,
        prefetch_limit: usize,
        staged_ttl: Duration,
    ) -> Result<Arc<Snapshotter<A>>, SnapshotError> {
        let layout = Layout::create(root)?;
        let meta = MetaStore::open(&layout.metadata_db())?;
        let agent = Arc::new(agent);
        let prefetch =
            Prefetcher::new(agent.clone(), &layout.staging(), prefetch_limit, staged_ttl);
        Ok(Arc::new(Snapshotter {
            layout,
            meta,
            agent,
            prefetch,
            remote: Mutex::default(),
            index_off: Path::new("/sys/module/overlay/parameters/index").exists(),
        }))
    }

    /// `Prepare`: a remote layer is committed under its chain ID and the
    /// answer is `AlreadyExists`; anything else (or any agent failure) makes
    /// an active snapshot whose mounts containerd writes the layer into.
    pub async fn prepare(
        self: &Arc<Self>,
        key: &str,
        parent: &str,
        labels: Labels,
    ) -> Result<Vec<Mount>, SnapshotError> {
        if let Some(layer) = RemoteLayer::from_labels(&labels) {
            match self.prepare_remote(parent, &labels, &layer).await {
                Ok(()) => {
                    return Err(SnapshotError::AlreadyExists(format!(
                        "target snapshot {:?} exists",
                        layer.target
                    )));
                }
                Err(miss @ RemoteMiss::Chain(_)) => tracing::warn!(
                    key,
                    "{miss}; containerd pulls the layer and checks it against the image's diffID itself"
                ),
                Err(miss) => tracing::warn!(
                    key,
                    target = %layer.target,
                    reason = %miss,
                    "remote layer unavailable; containerd will pull and apply it"
                ),
            }
        }
        let (this, key, parent) = (self.clone(), key.to_string(), parent.to_string());
        blocking(move || this.create(Kind::Active, &key, &parent, labels)).await
    }

    /// `View`: a read-only snapshot of `parent`.
    pub fn view(
        &self,
        key: &str,
        parent: &str,
        labels: Labels,
    ) -> Result<Vec<Mount>, SnapshotError> {
        self.create(Kind::View, key, parent, labels)
    }

    fn create(
        &self,
        kind: Kind,
        key: &str,
        parent: &str,
        labels: Labels,
    ) -> Result<Vec<Mount>, SnapshotError> {
        let dir = self.layout.new_dir(true, kind == Kind::Active)?;
        if let Some(p) = self.meta.get(parent)?.filter(|_| !parent.is_empty()) {
            // The new upper dir belongs to whoever owns the parent's root, as in containerd.
            let owner = self.layout.fs(p.id);
            let meta =
                std::fs::metadata(&owner).map_err(SnapshotError::io("reading owner of", &owner))?;
            std::os::unix::fs::lchown(dir.fs(), Some(meta.uid()), Some(meta.gid()))
                .map_err(SnapshotError::io("changing owner of", &dir.fs()))?;
        }
        let now = SystemTime::now();
        let record = Record {
            id: self.meta.next_id()?,
            kind,
            parent: parent.to_string(),
            labels,
            created: now,
            updated: now,
            usage: Usage::default(),
        };
        self.insert(dir, key, &record)?;
        self.mounts_of(&record)
    }

    /// Moves `dir` into place as snapshot `record.id` and records it as
    /// `name`; removes the directory again if the record is refused.
    fn insert(&self, dir: NewDir, name: &str, record: &Record) -> Result<(), SnapshotError> {
        let dest = self.layout.snapshot_dir(record.id);
        dir.persist(&dest)?;
        self.meta
            .create(name, record)
            .inspect_err(|_| remove_tree(&dest))
    }

    async fn prepare_remote(
        self: &Arc<Self>,
        parent: &str,
        labels: &Labels,
        layer: &RemoteLayer,
    ) -> Result<(), RemoteMiss> {
        for next in &layer.following {
            self.prefetch
                .start(&layer.image_ref, &layer.manifest_digest, next);
        }
        let lock = self
            .remote
            .lock()
            .expect("remote lock")
            .entry(layer.target.clone())
            .or_default()
            .clone();
        let result = {
            let _guard = lock.lock().await;
            self.commit_remote(parent, labels, layer).await
        };
        let mut remote = self.remote.lock().expect("remote lock");
        if Arc::strong_count(&lock) == 2 {
            remote.remove(&layer.target);
        }
        result
    }

    async fn commit_remote(
        self: &Arc<Self>,
        parent: &str,
        labels: &Labels,
        layer: &RemoteLayer,
    ) -> Result<(), RemoteMiss> {
        match self.meta.get(&layer.target)? {
            Some(r) if r.kind == Kind::Committed => return Ok(()),
            Some(r) => {
                return Err(RemoteMiss::NotApplicable(format!(
                    "{:?} exists as a {} snapshot",
                    layer.target,
                    r.kind.as_str()
                )));
            }
            None => {}
        }
        if !parent.is_empty()
            && self
                .meta
                .get(parent)?
                .is_none_or(|p| p.kind != Kind::Committed)
        {
            return Err(RemoteMiss::NotApplicable(format!(
                "parent {parent:?} is not a committed snapshot"
            )));
        }
        let parent_chain = parent_chain_id(parent).map_err(RemoteMiss::NotApplicable)?;
        let target: BlobDigest = layer.target.parse().map_err(|_| {
            RemoteMiss::NotApplicable(format!(
                "the target {:?} is not a sha256 chain ID",
                layer.target
            ))
        })?;
        let chain = Chain {
            parent: parent_chain,
            target,
        };
        let dir = self.layout.new_dir(false, false)?;
        self.fetch_layer(layer, &chain, &dir.fs()).await?;
        let fs = dir.fs();
        let lowers = self.lower_dirs(parent)?;
        let usage = blocking(move || {
            inherit_implicit_parents(&fs, &lowers)?;
            disk_usage(&fs)
        })
        .await?;
        let now = SystemTime::now();
        let record = Record {
            id: self.meta.next_id()?,
            kind: Kind::Committed,
            parent: parent.to_string(),
            labels: labels.clone(),
            created: now,
            updated: now,
            usage,
        };
        self.insert(dir, &layer.target, &record)?;
        tracing::info!(target = %layer.target, layer = %layer.layer_digest, id = record.id, "committed remote layer");
        Ok(())
    }

    /// The directories of `parent` and its ancestors, nearest first.
    fn lower_dirs(&self, parent: &str) -> Result<Vec<PathBuf>, SnapshotError> {
        let Some(record) = self.meta.get(parent)?.filter(|_| !parent.is_empty()) else {
            return Ok(Vec::new());
        };
        let mut ids = vec![record.id];
        ids.extend(self.meta.parent_ids(&record)?);
        Ok(ids.into_iter().map(|id| self.layout.fs(id)).collect())
    }

    /// Puts the unpacked layer at `target`: the copy staged for this layer
    /// of this manifest if there is one that succeeded and its verified
    /// diffID makes `chain`'s target, else a fresh agent request, whose
    /// verified diffID must make it too.
    async fn fetch_layer(
        &self,
        layer: &RemoteLayer,
        chain: &Chain,
        target: &Path,
    ) -> Result<(), RemoteMiss> {
        let key = StageKey::new(&layer.manifest_digest, &layer.layer_digest);
        if let Some(staged) = self.prefetch.claim(&key) {
            let outcome = staged.await;
            let moved = outcome
                .map_err(|e| format!("prefetch failed: {e}"))
                .and_then(|unpacked| match chain.check(layer, &unpacked.diff_id) {
                    Ok(()) => std::fs::rename(&unpacked.dir, target).map_err(|e| {
                        format!(
                            "moving {} to {}: {e}",
                            unpacked.dir.display(),
                            target.display()
                        )
                    }),
                    Err(miss) => {
                        remove_tree(&unpacked.dir);
                        Err(miss.to_string())
                    }
                });
            self.prefetch.release(&key);
            match moved {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::info!(layer = %layer.layer_digest, reason = %e, "staged layer unusable; asking the agent again")
                }
            }
        }
        let request = UnpackRequest {
            image_ref: layer.image_ref.clone(),
            manifest_digest: layer.manifest_digest.clone(),
            layer_digest: layer.layer_digest.clone(),
            target: target.to_path_buf(),
        };
        let report = self
            .agent
            .unpack(&request)
            .await
            .map_err(|e| RemoteMiss::Agent {
                layer: layer.layer_digest.clone(),
                reason: e.to_string(),
            })?;
        chain.check(layer, &report.diff_id)
    }

    /// `Mounts` of an active snapshot or view.
    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, SnapshotError> {
        let record = self.meta.require(key)?;
        if record.kind == Kind::Committed {
            return Err(SnapshotError::FailedPrecondition(format!(
                "snapshot {key:?} is committed, not active or view"
            )));
        }
        self.mounts_of(&record)
    }

    fn mounts_of(&self, record: &Record) -> Result<Vec<Mount>, SnapshotError> {
        let parents = self.meta.parent_ids(record)?;
        let bind = |dir: PathBuf, flag: &str| Mount {
            r#type: "bind".into(),
            source: dir.display().to_string(),
            target: String::new(),
            options: vec![flag.into(), "rbind".into()],
        };
        if parents.is_empty() {
            let flag = if record.kind == Kind::View {
                "ro"
            } else {
                "rw"
            };
            return Ok(vec![bind(self.layout.fs(record.id), flag)]);
        }
        let mut options = Vec::new();
        if self.index_off {
            options.push("index=off".to_string());
        }
        if record.kind == Kind::Active {
            options.push(format!("workdir={}", self.layout.work(record.id).display()));
            options.push(format!("upperdir={}", self.layout.fs(record.id).display()));
        } else if parents.len() == 1 {
            return Ok(vec![bind(self.layout.fs(parents[0]), "ro")]);
        }
        let lower: Vec<String> = parents
            .iter()
            .map(|id| self.layout.fs(*id).display().to_string())
            .collect();
        options.push(format!("lowerdir={}", lower.join(":")));
        Ok(vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            target: String::new(),
            options,
        }])
    }

    /// `Commit`: active snapshot `key` becomes committed `name`, with `labels`.
    pub fn commit(&self, name: &str, key: &str, labels: Labels) -> Result<(), SnapshotError> {
        let record = self.meta.require(key)?;
        let usage = disk_usage(&self.layout.fs(record.id))?;
        self.meta.commit(key, name, labels, usage).map(drop)
    }

    /// `Remove`: refuses a snapshot with children.
    pub fn remove(&self, key: &str) -> Result<(), SnapshotError> {
        let record = self.meta.remove(key)?;
        remove_tree(&self.layout.snapshot_dir(record.id));
        Ok(())
    }

    /// `Stat`.
    pub fn stat(&self, key: &str) -> Result<Info, SnapshotError> {
        Ok(Info {
            name: key.to_string(),
            record: self.meta.require(key)?,
        })
    }

    /// `Update`: only labels are mutable (`labels`, `labels.<key>`).
    pub fn update(
        &self,
        name: &str,
        labels: &Labels,
        field_paths: &[String],
    ) -> Result<Info, SnapshotError> {
        Ok(Info {
            name: name.to_string(),
            record: self.meta.update_labels(name, labels, field_paths)?,
        })
    }

    /// `List`: every snapshot that passes any of `filters`.
    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>, SnapshotError> {
        let filters =
            FilterSet::parse(filters).map_err(|e| SnapshotError::InvalidArgument(e.to_string()))?;
        Ok(self
            .meta
            .list()?
            .into_iter()
            .map(|(name, record)| Info { name, record })
            .filter(|info| filters.matches(info))
            .collect())
    }

    /// `Usage`: measured for an active snapshot, stored for the others.
    pub fn usage(&self, key: &str) -> Result<Usage, SnapshotError> {
        let record = self.meta.require(key)?;
        match record.kind {
            Kind::Active => disk_usage(&self.layout.fs(record.id)),
            _ => Ok(record.usage),
        }
    }

    /// `Cleanup`: removes snapshot directories no record names and staged
    /// layers nobody claimed in time.
    pub fn cleanup(&self) -> Result<(), SnapshotError> {
        for dir in self.layout.orphans(&self.meta.ids()?)? {
            tracing::info!(dir = %dir.display(), "removing orphaned snapshot directory");
            remove_tree(&dir);
        }
        self.prefetch.sweep(Instant::now());
        Ok(())
    }

    /// Expires unclaimed staged layers every `period` until dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(this) = this.upgrade() else { return };
                for dir in this.prefetch.sweep(Instant::now()) {
                    tracing::info!(dir = %dir.display(), "removed unclaimed staged layer");
                }
            }
        })
    }
}

/// Runs file-system and database work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SnapshotError> + Send + 'static,
) -> Result<T, SnapshotError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{AgentError, UnpackResponse};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Writes `/layer` (holding the layer digest) into the target, or fails.
    /// A layer's tar has the diffID [`diff`] of its digest; a manifest's
    /// config states that unless `configs` says otherwise, and, as the real
    /// agent, it refuses a layer whose tar is not what the config states.
    #[derive(Default)]
    struct FakeAgent {
        calls: Mutex<Vec<UnpackRequest>>,
        fail: AtomicBool,
        /// (manifest, layer) -> the diffID that manifest's config states.
        configs: Mutex<HashMap<(String, String), String>>,
    }

    /// The diffID of the fake layer `layer`'s tar.
    fn diff(layer: &str) -> BlobDigest {
        BlobDigest::of(layer.as_bytes())
    }

    /// The chain ID of the fake layers `layers`, bottom first.
    fn chain(layers: &[&str]) -> String {
        let mut c: Option<BlobDigest> = None;
        for l in layers {
            c = Some(chain_id(c.as_ref(), &diff(l)));
        }
        c.expect("a layer").to_string()
    }

    impl LayerSource for Arc<FakeAgent> {
        async fn unpack(&self, request: &UnpackRequest) -> Result<UnpackResponse, AgentError> {
            self.calls.lock().unwrap().push(request.clone());
            if self.fail.load(Ordering::SeqCst) {
                return Err(AgentError::Refused {
                    status: 502,
                    message: "registry unreachable".into(),
                });
            }
            let tar = diff(&request.layer_digest).to_string();
            let stated = self
                .configs
                .lock()
                .unwrap()
                .get(&(
                    request.manifest_digest.clone(),
                    request.layer_digest.clone(),
                ))
                .cloned()
                .unwrap_or_else(|| tar.clone());
            if stated != tar {
                return Err(AgentError::Refused {
                    status: 422,
                    message: format!("layer {}: diffID mismatch", request.layer_digest),
                });
            }
            assert!(!request.target.exists(), "the target must not exist yet");
            std::fs::create_dir(&request.target).unwrap();
            std::fs::write(request.target.join("layer"), &request.layer_digest).unwrap();
            Ok(UnpackResponse {
                layer_digest: request.layer_digest.clone(),
                diff_id: tar,
                compressed_bytes: 1,
                uncompressed_bytes: 1,
                seconds: 0.0,
            })
        }
    }

    impl FakeAgent {
        fn digests(&self) -> Vec<String> {
            self.calls
                .lock()
                .unwrap()
                .iter()
                .map(|c| c.layer_digest.clone())
                .collect()
        }
    }

    fn open(root: &Path, agent: &Arc<FakeAgent>) -> Arc<Snapshotter<Arc<FakeAgent>>> {
        Snapshotter::open(root, agent.clone(), 4, Duration::from_secs(600)).unwrap()
    }

    /// The labels containerd's metadata layer passes on for a CRI pull.
    fn cri_labels(chain_id: &str, layer: &str, layers: &str) -> Labels {
        image_labels("sha256:manifest", chain_id, layer, layers)
    }

    /// [`cri_labels`] of a layer of the image whose manifest is `manifest`.
    fn image_labels(manifest: &str, chain_id: &str, layer: &str, layers: &str) -> Labels {
        [
            (LABEL_REF, chain_id),
            (LABEL_LAYER_DIGEST, layer),
            (LABEL_IMAGE_REF, "127.0.0.1:5000/test/busybox:1"),
            (LABEL_MANIFEST_DIGEST, manifest),
            (LABEL_IMAGE_LAYERS, layers),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn backend_key(n: u32, chain_id: &str) -> String {
        format!("k8s.io/{n}/extract-{n}-abcd {chain_id}")
    }

    /// An active snapshot committed as `name`.
    async fn committed(s: &Arc<Snapshotter<Arc<FakeAgent>>>, name: &str, parent: &str) {
        let key = format!("{name}-active");
        s.prepare(&key, parent, Labels::new()).await.unwrap();
        s.commit(name, &key, Labels::new()).unwrap();
    }

    fn option<'a>(m: &'a Mount, prefix: &str) -> &'a str {
        m.options
            .iter()
            .find_map(|o| o.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {:?}", m.options))
    }

    #[tokio::test]
    async fn remote_prepare_commits_under_the_ref_and_answers_already_exists() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let (c1, c2) = (chain(&["sha256:l1"]), chain(&["sha256:l1", "sha256:l2"]));
        let labels = cri_labels(&c1, "sha256:l1", "sha256:l1");
        let e = s
            .prepare(&backend_key(1, &c1), "", labels.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, SnapshotError::AlreadyExists(_)), "{e}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::AlreadyExists);

        let info = s.stat(&c1).unwrap();
        assert_eq!(info.record.kind, Kind::Committed);
        assert_eq!(info.record.parent, "");
        assert_eq!(info.record.labels, labels);
        assert!(info.record.usage.inodes >= 2, "{:?}", info.record.usage);
        assert_eq!(
            std::fs::read_to_string(s.layout.fs(info.record.id).join("layer")).unwrap(),
            "sha256:l1"
        );
        assert!(
            s.stat(&backend_key(1, &c1)).is_err(),
            "the extract key is not kept"
        );
        // What containerd looks for next.
        let found = s
            .list(&[format!(
                r#"labels."containerd.io/snapshot.ref"=={c1},parent=="""#
            )])
            .unwrap();
        assert_eq!(
            found.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(),
            [c1.as_str()]
        );

        // A second pull of the same chain answers at once.
        let again = s
            .prepare(&backend_key(5, &c1), "", labels)
            .await
            .unwrap_err();
        assert!(matches!(again, SnapshotError::AlreadyExists(_)));
        assert_eq!(agent.digests(), ["sha256:l1"]);

        // Layer 2 on top, then a container: overlay, nearest parent first.
        let e = s
            .prepare(
                &backend_key(2, &c2),
                &c1,
                cri_labels(&c2, "sha256:l2", "sha256:l2"),
            )
            .await;
        assert!(matches!(e, Err(SnapshotError::AlreadyExists(_))));
        assert_eq!(s.stat(&c2).unwrap().record.parent, c1);
        let mounts = s.prepare("k8s.io/3/ctr", &c2, Labels::new()).await.unwrap();
        let (c1, c2) = (
            s.stat(&c1).unwrap().record.id,
            s.stat(&c2).unwrap().record.id,
        );
        assert_eq!(mounts[0].r#type, "overlay");
        assert_eq!(
            option(&mounts[0], "lowerdir="),
            format!(
                "{}:{}",
                s.layout.fs(c2).display(),
                s.layout.fs(c1).display()
            )
        );
        let id = s.stat("k8s.io/3/ctr").unwrap().record.id;
        assert_eq!(
            option(&mounts[0], "upperdir="),
            s.layout.fs(id).display().to_string()
        );
        assert_eq!(
            option(&mounts[0], "workdir="),
            s.layout.work(id).display().to_string()
        );
    }

    #[tokio::test]
    async fn an_agent_failure_falls_back_to_a_plain_active_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        agent.fail.store(true, Ordering::SeqCst);
        let s = open(dir.path(), &agent);
        let c1 = chain(&["sha256:l1"]);
        let key = backend_key(1, &c1);
        let mounts = s
            .prepare(&key, "", cri_labels(&c1, "sha256:l1", "sha256:l1"))
            .await
            .unwrap();
        assert_eq!(agent.digests(), ["sha256:l1"]);
        let info = s.stat(&key).unwrap();
        assert_eq!(info.record.kind, Kind::Active);
        assert_eq!(mounts[0].r#type, "bind");
        assert_eq!(
            mounts[0].source,
            s.layout.fs(info.record.id).display().to_string()
        );
        assert_eq!(mounts[0].options, ["rw", "rbind"]);
        assert!(s.stat(&c1).is_err());
        // containerd applies the layer and commits it under its own name.
        s.commit(&format!("k8s.io/2/{c1}"), &key, Labels::new())
            .unwrap();
        // No temporary directory is left behind.
        let entries: Vec<_> = std::fs::read_dir(s.layout.snapshots())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            entries,
            [std::ffi::OsString::from(info.record.id.to_string())]
        );
    }

    #[tokio::test]
    async fn the_first_remote_prepare_unpacks_the_following_layers_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let layers = "sha256:l1,sha256:l2,sha256:l3";
        let (c1, c2) = (chain(&["sha256:l1"]), chain(&["sha256:l1", "sha256:l2"]));
        let _ = s
            .prepare(
                &backend_key(1, &c1),
                "",
                cri_labels(&c1, "sha256:l1", layers),
            )
            .await;
        // The prefetches run on their own; wait for them (bounded).
        for _ in 0..100 {
            if agent.digests().len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut asked = agent.digests();
        asked.sort();
        assert_eq!(asked, ["sha256:l1", "sha256:l2", "sha256:l3"]);
        let staged = agent
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.target.starts_with(s.layout.staging()))
            .count();
        assert_eq!(staged, 2);

        // Layer 2's Prepare claims the staged copy: no new agent call.
        let later = cri_labels(&c2, "sha256:l2", "sha256:l2,sha256:l3");
        let e = s.prepare(&backend_key(2, &c2), &c1, later).await;
        assert!(matches!(e, Err(SnapshotError::AlreadyExists(_))));
        assert_eq!(agent.digests().len(), 3);
        let c2 = s.stat(&c2).unwrap().record;
        assert_eq!(
            std::fs::read_to_string(s.layout.fs(c2.id).join("layer")).unwrap(),
            "sha256:l2"
        );

        // Layer 3 is never asked for (say the chain was known): Cleanup keeps it
        // within its TTL, the sweep after the TTL removes it.
        s.cleanup().unwrap();
        assert_eq!(std::fs::read_dir(s.layout.staging()).unwrap().count(), 1);
        let removed = s.prefetch.sweep(Instant::now() + Duration::from_secs(601));
        assert_eq!(removed.len(), 1);
        assert_eq!(std::fs::read_dir(s.layout.staging()).unwrap().count(), 0);
    }

    /// Waits (bounded) until the agent was asked `n` times.
    async fn asked(agent: &FakeAgent, n: usize) {
        for _ in 0..200 {
            if agent.digests().len() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the agent was asked {:?}, not {n} times", agent.digests());
    }

    /// Issue 37, finding 1: B2 = [x, l] stages l; B = [u, l] whose config
    /// states the victim's top diffID for l asks for the victim's chain ID.
    #[tokio::test]
    async fn a_layer_staged_for_one_image_is_not_committed_under_another_images_chain_id() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let (b2, b) = ("sha256:b2", "sha256:b");
        let cx = chain(&["sha256:x"]);
        let e = s
            .prepare(
                &backend_key(1, &cx),
                "",
                image_labels(b2, &cx, "sha256:x", "sha256:x,sha256:l"),
            )
            .await;
        assert!(matches!(e, Err(SnapshotError::AlreadyExists(_))));
        asked(&agent, 2).await;
        // l is staged for B2 (and stays: B2's pull went no further).
        let staged = || std::fs::read_dir(s.layout.staging()).unwrap().count();
        for _ in 0..200 {
            if staged() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(staged(), 1);

        agent.configs.lock().unwrap().insert(
            (b.into(), "sha256:l".into()),
            diff("sha256:v-top").to_string(),
        );
        let cu = chain(&["sha256:u"]);
        let e = s
            .prepare(
                &backend_key(2, &cu),
                "",
                image_labels(b, &cu, "sha256:u", "sha256:u,sha256:l"),
            )
            .await;
        assert!(matches!(e, Err(SnapshotError::AlreadyExists(_))));
        let victim = chain(&["sha256:u", "sha256:v-top"]);
        let key = backend_key(3, &victim);
        let mounts = s
            .prepare(&key, &cu, image_labels(b, &victim, "sha256:l", "sha256:l"))
            .await
            .expect("a plain active snapshot: containerd pulls and checks l itself");
        assert_eq!(mounts[0].r#type, "overlay");
        assert_eq!(s.stat(&key).unwrap().record.kind, Kind::Active);
        assert!(
            s.stat(&victim).is_err(),
            "l was committed under V's chain ID"
        );
        // B's own requests for l were refused; B2's staged copy was not touched.
        let for_b = agent
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.manifest_digest == b && c.layer_digest == "sha256:l")
            .count();
        assert_eq!(
            for_b,
            2,
            "B's prefetch and B's Prepare: {:?}",
            agent.digests()
        );
        assert_eq!(staged(), 1);
    }

    #[tokio::test]
    async fn a_layer_is_committed_only_under_the_chain_id_its_verified_diff_id_makes() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let c1 = chain(&["sha256:l1"]);
        let _ = s
            .prepare(
                &backend_key(1, &c1),
                "",
                cri_labels(&c1, "sha256:l1", "sha256:l1,sha256:l2"),
            )
            .await;
        asked(&agent, 2).await;
        // containerd asks for l2 under a chain ID that l2's verified diffID
        // (on c1) does not make: neither the staged copy nor a fresh unpack
        // is committed there, and the staged copy is gone.
        let wrong = chain(&["sha256:l1", "sha256:other"]);
        let key = backend_key(2, &wrong);
        let mounts = s
            .prepare(&key, &c1, cri_labels(&wrong, "sha256:l2", "sha256:l2"))
            .await
            .unwrap();
        assert_eq!(mounts[0].r#type, "overlay");
        assert_eq!(s.stat(&key).unwrap().record.kind, Kind::Active);
        assert!(s.stat(&wrong).is_err());
        assert_eq!(agent.digests(), ["sha256:l1", "sha256:l2", "sha256:l2"]);
        assert_eq!(std::fs::read_dir(s.layout.staging()).unwrap().count(), 0);
        // No unpacked copy is left behind: the active snapshot is the only one new.
        assert_eq!(
            std::fs::read_dir(s.layout.snapshots()).unwrap().count(),
            2,
            "c1 and the active snapshot"
        );

        // A target that is no chain ID, or a parent not named by one, is
        // never asked for.
        committed(&s, "base", "").await;
        let right = chain(&["sha256:l1", "sha256:l2"]);
        for (key, parent, target) in [("k3", "", "not-a-digest"), ("k4", "base", &right)] {
            let mounts = s
                .prepare(key, parent, cri_labels(target, "sha256:l2", "sha256:l2"))
                .await
                .unwrap();
            assert!(!mounts.is_empty());
            assert_eq!(s.stat(key).unwrap().record.kind, Kind::Active);
        }
        assert_eq!(agent.digests().len(), 3);
    }

    #[tokio::test]
    async fn remove_refuses_a_snapshot_with_children() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        committed(&s, "base", "").await;
        s.prepare("child", "base", Labels::new()).await.unwrap();
        let e = s.remove("base").unwrap_err();
        assert!(matches!(e, SnapshotError::FailedPrecondition(_)), "{e}");
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::FailedPrecondition
        );
        let base = s.stat("base").unwrap().record.id;
        s.remove("child").unwrap();
        s.remove("base").unwrap();
        assert!(!s.layout.snapshot_dir(base).exists());
        let missing = s.remove("base").unwrap_err();
        assert_eq!(tonic::Status::from(missing).code(), tonic::Code::NotFound);
    }

    #[tokio::test]
    async fn containerd_error_rules_for_create_commit_and_mounts() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let code = |e: SnapshotError| tonic::Status::from(e).code();
        assert_eq!(
            code(s.prepare("a", "nope", Labels::new()).await.unwrap_err()),
            tonic::Code::NotFound
        );
        s.prepare("a", "", Labels::new()).await.unwrap();
        assert_eq!(
            code(s.prepare("a", "", Labels::new()).await.unwrap_err()),
            tonic::Code::AlreadyExists
        );
        assert_eq!(
            code(s.prepare("b", "a", Labels::new()).await.unwrap_err()),
            tonic::Code::InvalidArgument
        );
        s.view("v", "", Labels::new()).unwrap();
        assert_eq!(
            code(s.commit("vc", "v", Labels::new()).unwrap_err()),
            tonic::Code::FailedPrecondition
        );
        std::fs::write(
            s.layout.fs(s.stat("a").unwrap().record.id).join("f"),
            vec![7u8; 10_000],
        )
        .unwrap();
        let active = s.usage("a").unwrap();
        assert!(active.size >= 10_000 && active.inodes == 2, "{active:?}");
        let labels: Labels = [("k".to_string(), "v".to_string())].into();
        s.commit("a1", "a", labels.clone()).unwrap();
        assert_eq!(s.usage("a1").unwrap(), active);
        assert_eq!(s.stat("a1").unwrap().record.labels, labels);
        assert_eq!(
            code(s.mounts("a1").unwrap_err()),
            tonic::Code::FailedPrecondition
        );
        assert_eq!(
            code(s.commit("a1", "v", Labels::new()).unwrap_err()),
            tonic::Code::AlreadyExists
        );
        // Views: one parent is a read-only bind of it, several an overlay of lowerdirs.
        let v1 = s.view("v1", "a1", Labels::new()).unwrap();
        assert_eq!(
            (v1[0].r#type.as_str(), v1[0].options.clone()),
            ("bind", vec!["ro".to_string(), "rbind".into()])
        );
        assert_eq!(
            v1[0].source,
            s.layout
                .fs(s.stat("a1").unwrap().record.id)
                .display()
                .to_string()
        );
        committed(&s, "a2", "a1").await;
        let v2 = s.view("v2", "a2", Labels::new()).unwrap();
        assert_eq!(v2[0].r#type, "overlay");
        assert!(
            v2[0]
                .options
                .iter()
                .all(|o| !o.starts_with("upperdir=") && !o.starts_with("workdir="))
        );
        assert_eq!(option(&v2[0], "lowerdir=").split(':').count(), 2);
        assert_eq!(s.mounts("v2").unwrap(), v2);
    }

    #[tokio::test]
    async fn metadata_survives_a_reopen_and_ids_keep_growing() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let (before, first_id) = {
            let s = open(dir.path(), &agent);
            committed(&s, "base", "").await;
            s.prepare("top", "base", [("x".to_string(), "y".to_string())].into())
                .await
                .unwrap();
            let list = s.list(&[]).unwrap();
            (
                list.iter()
                    .map(|i| (i.name.clone(), i.record.clone()))
                    .collect::<Vec<_>>(),
                s.stat("top").unwrap().record.id,
            )
        };
        let s = open(dir.path(), &agent);
        let after: Vec<_> = s
            .list(&[])
            .unwrap()
            .into_iter()
            .map(|i| (i.name, i.record))
            .collect();
        assert_eq!(after, before);
        s.prepare("new", "", Labels::new()).await.unwrap();
        assert!(s.stat("new").unwrap().record.id > first_id);
        assert_eq!(s.mounts("top").unwrap()[0].r#type, "overlay");
    }

    #[tokio::test]
    async fn update_changes_only_the_labels_its_field_paths_name() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        let l = |pairs: &[(&str, &str)]| -> Labels {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        s.prepare("a", "", l(&[("a", "1"), ("b", "2")]))
            .await
            .unwrap();
        let created = s.stat("a").unwrap().record;
        let new = l(&[("a", "10"), ("b", "20"), ("c", "30")]);
        let info = s.update("a", &new, &["labels.a".into()]).unwrap();
        assert_eq!(info.record.labels, l(&[("a", "10"), ("b", "2")]));
        assert!(info.record.updated > created.updated);
        assert_eq!(info.record.created, created.created);
        let info = s
            .update("a", &l(&[("c", "3")]), &["labels".into()])
            .unwrap();
        assert_eq!(info.record.labels, l(&[("c", "3")]));
        let info = s.update("a", &l(&[("d", "4")]), &[]).unwrap();
        assert_eq!(info.record.labels, l(&[("d", "4")]));
        let e = s.update("a", &new, &["parent".into()]).unwrap_err();
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        assert_eq!(s.stat("a").unwrap().record.labels, l(&[("d", "4")]));
        let e = s.update("zz", &new, &[]).unwrap_err();
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::NotFound);
    }

    #[tokio::test]
    async fn list_applies_kind_name_and_label_filters() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        committed(&s, "base", "").await;
        s.prepare(
            "top",
            "base",
            [("team".to_string(), "x".to_string())].into(),
        )
        .await
        .unwrap();
        let names = |f: &[&str]| -> Vec<String> {
            let f: Vec<String> = f.iter().map(|s| s.to_string()).collect();
            s.list(&f).unwrap().into_iter().map(|i| i.name).collect()
        };
        assert_eq!(names(&["kind==committed"]), ["base"]);
        assert_eq!(names(&["parent==base"]), ["top"]);
        assert_eq!(names(&["labels.team==x"]), ["top"]);
        assert_eq!(names(&["name==base", "labels.team"]), ["base", "top"]);
        let e = s.list(&["name==".into(), "(".into()]).unwrap_err();
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn cleanup_removes_directories_no_snapshot_names() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Arc::new(FakeAgent::default());
        let s = open(dir.path(), &agent);
        s.prepare("a", "", Labels::new()).await.unwrap();
        let stray = s.layout.snapshots().join("999");
        std::fs::create_dir_all(stray.join("fs")).unwrap();
        let building = s.layout.new_dir(true, true).unwrap();
        s.cleanup().unwrap();
        assert!(!stray.exists());
        assert!(
            building.fs().exists(),
            "a directory being built is left alone"
        );
        assert!(s.layout.fs(s.stat("a").unwrap().record.id).exists());
    }
}
