//! The shim's directories, as containerd's overlayfs snapshotter lays them
//! out: `<root>/snapshots/<id>/{fs,work}`, new snapshots built under a
//! `new-*` temporary name and renamed into place, plus `<root>/staging/` for
//! layers unpacked ahead of their `Prepare` and `<root>/metadata.db`.

use crate::error::SnapshotError;
use crate::meta::Usage;
use std::collections::HashSet;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Paths under the shim's root directory.
#[derive(Clone, Debug)]
pub struct Layout {
    root: PathBuf,
    /// Temporary directories being built, which `Cleanup` must not touch
    /// (a remote layer is unpacked into one for minutes).
    building: Arc<Mutex<HashSet<PathBuf>>>,
}

/// A snapshot directory being built; removed on drop unless [`persist`]ed.
///
/// [`persist`]: NewDir::persist
pub struct NewDir {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    building: Arc<Mutex<HashSet<PathBuf>>>,
}

impl NewDir {
    /// Its `fs` directory (the upper dir, or where a layer is unpacked).
    pub fn fs(&self) -> PathBuf {
        self.path.join("fs")
    }

    /// Renames it to `dest`; on failure it is still removed on drop.
    pub fn persist(mut self, dest: &Path) -> Result<(), SnapshotError> {
        std::fs::rename(&self.path, dest).map_err(SnapshotError::io(
            "renaming a new snapshot directory to",
            dest,
        ))?;
        // The directory lives on under its new name: forget the temporary one.
        let _ = self.dir.take().map(tempfile::TempDir::keep);
        Ok(())
    }
}

impl Drop for NewDir {
    fn drop(&mut self) {
        self.building
            .lock()
            .expect("building set lock")
            .remove(&self.path);
    }
}

impl Layout {
    /// Creates the directories under `root` if they are missing.
    pub fn create(root: &Path) -> Result<Layout, SnapshotError> {
        let layout = Layout {
            root: root.to_path_buf(),
            building: Arc::default(),
        };
        for dir in [layout.snapshots(), layout.staging()] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(SnapshotError::io("creating", &dir))?;
        }
        Ok(layout)
    }

    pub fn metadata_db(&self) -> PathBuf {
        self.root.join("metadata.db")
    }

    pub fn snapshots(&self) -> PathBuf {
        self.root.join("snapshots")
    }

    pub fn staging(&self) -> PathBuf {
        self.root.join("staging")
    }

    pub fn snapshot_dir(&self, id: u64) -> PathBuf {
        self.snapshots().join(id.to_string())
    }

    pub fn fs(&self, id: u64) -> PathBuf {
        self.snapshot_dir(id).join("fs")
    }

    pub fn work(&self, id: u64) -> PathBuf {
        self.snapshot_dir(id).join("work")
    }

    /// A temporary snapshot directory: `fs` (unless the agent is to create
    /// it) and, for an active snapshot, `work`.
    pub fn new_dir(&self, with_fs: bool, with_work: bool) -> Result<NewDir, SnapshotError> {
        let snapshots = self.snapshots();
        let dir = tempfile::Builder::new()
            .prefix("new-")
            .tempdir_in(&snapshots)
            .map_err(SnapshotError::io(
                "creating a temporary directory in",
                &snapshots,
            ))?;
        let path = dir.path().to_path_buf();
        self.building
            .lock()
            .expect("building set lock")
            .insert(path.clone());
        let new = NewDir {
            dir: Some(dir),
            path,
            building: self.building.clone(),
        };
        let mut builder = std::fs::DirBuilder::new();
        if with_fs {
            let fs = new.fs();
            builder
                .mode(0o755)
                .create(&fs)
                .map_err(SnapshotError::io("creating", &fs))?;
        }
        if with_work {
            let work = new.path.join("work");
            builder
                .mode(0o711)
                .create(&work)
                .map_err(SnapshotError::io("creating", &work))?;
        }
        Ok(new)
    }

    /// Directories under `snapshots/` whose name is no id in `ids` and that
    /// are not being built (leftovers of a crash, or of a failed delete).
    pub fn orphans(&self, ids: &HashSet<u64>) -> Result<Vec<PathBuf>, SnapshotError> {
        let snapshots = self.snapshots();
        let entries =
            std::fs::read_dir(&snapshots).map_err(SnapshotError::io("listing", &snapshots))?;
        let building = self.building.lock().expect("building set lock").clone();
        let mut orphans = Vec::new();
        for entry in entries {
            let entry = entry.map_err(SnapshotError::io("listing", &snapshots))?;
            let name = entry.file_name();
            let known = name
                .to_str()
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|id| ids.contains(&id));
            if !known && !building.contains(&entry.path()) {
                orphans.push(entry.path());
            }
        }
        Ok(orphans)
    }
}

/// Removes a directory tree, logging rather than failing: a leftover is
/// reclaimed by the next `Cleanup`.
pub fn remove_tree(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove directory; Cleanup will retry");
    }
}

/// Disk usage of a tree as containerd's `fs.DiskUsage` counts it: allocated
/// blocks × 512 and distinct inodes (hard links once).
pub fn disk_usage(root: &Path) -> Result<Usage, SnapshotError> {
    let mut seen = HashSet::new();
    let mut usage = Usage::default();
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta =
            std::fs::symlink_metadata(&path).map_err(SnapshotError::io("measuring", &path))?;
        if seen.insert((meta.dev(), meta.ino())) {
            usage.inodes += 1;
            usage.size += (meta.blocks() * 512) as i64;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(SnapshotError::io("listing", &path))? {
                stack.push(entry.map_err(SnapshotError::io("listing", &path))?.path());
            }
        }
    }
    Ok(usage)
}
