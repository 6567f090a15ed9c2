//! Durable snapshot metadata, the rules of containerd's `snapshots/storage`
//! over one sled tree: `s/<name>` holds a snapshot's [`Record`] (JSON),
//! `c/<parent>\0<child>` links a parent to each child. Every mutation is one
//! sled batch under a writer lock (checks and writes see the same state) and
//! is flushed before it returns, so an answered call survives a restart.

use crate::error::SnapshotError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::SystemTime;

/// What a snapshot is, as containerd names the kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only, never committed.
    View,
    /// Writable; becomes committed through `Commit`.
    Active,
    /// Immutable; the only kind that can be a parent.
    Committed,
}

impl Kind {
    /// The name containerd's filters use (`kind==committed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// Disk usage: bytes allocated and inodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub size: i64,
    pub inodes: i64,
}

/// One snapshot's metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Names the directory `snapshots/<id>`; allocated monotonically.
    pub id: u64,
    pub kind: Kind,
    /// The parent's name, empty for none.
    pub parent: String,
    pub labels: BTreeMap<String, String>,
    pub created: SystemTime,
    pub updated: SystemTime,
    /// Stored at commit; an active snapshot's usage is measured on demand.
    pub usage: Usage,
}

/// The metadata database.
pub struct MetaStore {
    db: sled::Db,
    tree: sled::Tree,
    writer: Mutex<()>,
}

fn snapshot_key(name: &str) -> Vec<u8> {
    [b"s/", name.as_bytes()].concat()
}

fn children_prefix(parent: &str) -> Vec<u8> {
    [b"c/", parent.as_bytes(), b"\0"].concat()
}

fn child_key(parent: &str, child: &str) -> Vec<u8> {
    [children_prefix(parent), child.as_bytes().to_vec()].concat()
}

impl MetaStore {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<MetaStore, SnapshotError> {
        let db = sled::open(path)?;
        let tree = db.open_tree("snapshots")?;
        Ok(MetaStore {
            db,
            tree,
            writer: Mutex::new(()),
        })
    }

    /// A fresh snapshot id, larger than every id handed out before (also
    /// across restarts).
    pub fn next_id(&self) -> Result<u64, SnapshotError> {
        Ok(self.db.generate_id()? + 1)
    }

    /// The snapshot called `name`, if any.
    pub fn get(&self, name: &str) -> Result<Option<Record>, SnapshotError> {
        self.tree
            .get(snapshot_key(name))?
            .map(|v| decode(name, &v))
            .transpose()
    }

    /// The snapshot called `name`, or `NotFound`.
    pub fn require(&self, name: &str) -> Result<Record, SnapshotError> {
        self.get(name)?
            .ok_or_else(|| SnapshotError::NotFound(format!("snapshot {name:?} does not exist")))
    }

    /// The ids of `name`'s ancestors, nearest first.
    pub fn parent_ids(&self, record: &Record) -> Result<Vec<u64>, SnapshotError> {
        let mut ids = Vec::new();
        let mut parent = record.parent.clone();
        while !parent.is_empty() {
            let p = self.get(&parent)?.ok_or_else(|| {
                SnapshotError::NotFound(format!("parent snapshot {parent:?} does not exist"))
            })?;
            ids.push(p.id);
            parent = p.parent;
        }
        Ok(ids)
    }

    /// Adds a new view or active snapshot (or, for a remote layer, a committed
    /// one). The parent must exist and be committed.
    pub fn create(&self, name: &str, record: &Record) -> Result<(), SnapshotError> {
        let _w = self.writer.lock().expect("metadata writer lock");
        if self.tree.contains_key(snapshot_key(name))? {
            return Err(SnapshotError::AlreadyExists(format!(
                "snapshot {name:?} already exists"
            )));
        }
        let mut batch = sled::Batch::default();
        if !record.parent.is_empty() {
            let parent = self.get(&record.parent)?.ok_or_else(|| {
                SnapshotError::NotFound(format!(
                    "parent snapshot {:?} of {name:?} does not exist",
                    record.parent
                ))
            })?;
            if parent.kind != Kind::Committed {
                return Err(SnapshotError::InvalidArgument(format!(
                    "parent {:?} of {name:?} is not a committed snapshot",
                    record.parent
                )));
            }
            batch.insert(child_key(&record.parent, name), &[]);
        }
        batch.insert(snapshot_key(name), encode(record));
        self.apply(batch)
    }

    /// Turns active snapshot `key` into committed snapshot `name` with
    /// `labels` (containerd replaces the labels on commit) and `usage`.
    pub fn commit(
        &self,
        key: &str,
        name: &str,
        labels: BTreeMap<String, String>,
        usage: Usage,
    ) -> Result<Record, SnapshotError> {
        let _w = self.writer.lock().expect("metadata writer lock");
        if self.tree.contains_key(snapshot_key(name))? {
            return Err(SnapshotError::AlreadyExists(format!(
                "committed snapshot {name:?} already exists"
            )));
        }
        let mut record = self.get(key)?.ok_or_else(|| {
            SnapshotError::NotFound(format!("active snapshot {key:?} does not exist"))
        })?;
        if record.kind != Kind::Active {
            return Err(SnapshotError::FailedPrecondition(format!(
                "snapshot {key:?} is not active"
            )));
        }
        let now = SystemTime::now();
        record.kind = Kind::Committed;
        record.created = now;
        record.updated = now;
        record.labels = labels;
        record.usage = usage;
        let mut batch = sled::Batch::default();
        batch.remove(snapshot_key(key));
        batch.insert(snapshot_key(name), encode(&record));
        if !record.parent.is_empty() {
            batch.remove(child_key(&record.parent, key));
            batch.insert(child_key(&record.parent, name), &[]);
        }
        self.apply(batch)?;
        Ok(record)
    }

    /// Removes `name`, refusing a snapshot that has children.
    pub fn remove(&self, name: &str) -> Result<Record, SnapshotError> {
        let _w = self.writer.lock().expect("metadata writer lock");
        let record = self.require(name)?;
        if let Some(child) = self.tree.scan_prefix(children_prefix(name)).next() {
            let (k, _) = child?;
            let child = String::from_utf8_lossy(&k[children_prefix(name).len()..]).into_owned();
            return Err(SnapshotError::FailedPrecondition(format!(
                "cannot remove snapshot {name:?}: it has child {child:?}"
            )));
        }
        let mut batch = sled::Batch::default();
        batch.remove(snapshot_key(name));
        if !record.parent.is_empty() {
            batch.remove(child_key(&record.parent, name));
        }
        self.apply(batch)?;
        Ok(record)
    }

    /// Replaces `name`'s labels (all of them, or only those the field paths
    /// `labels` / `labels.<key>` select, as containerd's `UpdateInfo` does).
    pub fn update_labels(
        &self,
        name: &str,
        labels: &BTreeMap<String, String>,
        field_paths: &[String],
    ) -> Result<Record, SnapshotError> {
        let _w = self.writer.lock().expect("metadata writer lock");
        let mut record = self.require(name)?;
        if field_paths.is_empty() {
            record.labels = labels.clone();
        }
        for path in field_paths {
            if let Some(key) = path.strip_prefix("labels.") {
                // An absent label sets the empty value, as containerd does.
                let value = labels.get(key).cloned().unwrap_or_default();
                record.labels.insert(key.to_string(), value);
            } else if path == "labels" {
                record.labels = labels.clone();
            } else {
                return Err(SnapshotError::InvalidArgument(format!(
                    "cannot update {path:?} field on snapshot {name:?}"
                )));
            }
        }
        record.updated = SystemTime::now();
        let mut batch = sled::Batch::default();
        batch.insert(snapshot_key(name), encode(&record));
        self.apply(batch)?;
        Ok(record)
    }

    /// Every snapshot, by name.
    pub fn list(&self) -> Result<Vec<(String, Record)>, SnapshotError> {
        self.tree
            .scan_prefix(b"s/")
            .map(|kv| {
                let (k, v) = kv?;
                let name = String::from_utf8_lossy(&k[2..]).into_owned();
                let record = decode(&name, &v)?;
                Ok((name, record))
            })
            .collect()
    }

    /// The ids every snapshot directory should have.
    pub fn ids(&self) -> Result<HashSet<u64>, SnapshotError> {
        Ok(self.list()?.into_iter().map(|(_, r)| r.id).collect())
    }

    fn apply(&self, batch: sled::Batch) -> Result<(), SnapshotError> {
        self.tree.apply_batch(batch)?;
        self.db.flush()?;
        Ok(())
    }
}

fn encode(record: &Record) -> Vec<u8> {
    serde_json::to_vec(record).expect("a record always encodes")
}

fn decode(name: &str, bytes: &[u8]) -> Result<Record, SnapshotError> {
    serde_json::from_slice(bytes).map_err(|source| SnapshotError::Corrupt {
        key: name.to_string(),
        source,
    })
}
