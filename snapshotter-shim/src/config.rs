//! `dray snapshotter`'s configuration: one TOML file, every key optional,
//! flags override it.

use crate::agent::UnpackDeadline;
use dray_protocol::settings::{deprecated_seconds, duration};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The snapshotter's settings; the defaults suit a production node.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapshotterConfig {
    /// The gRPC socket containerd's `[proxy_plugins.dray] address` names
    /// (created with mode 0660). Default `/run/dray/snapshotter.sock`.
    pub socket: PathBuf,
    /// Snapshot directories and metadata. Default `/var/lib/dray/snapshotter`.
    pub root: PathBuf,
    /// The agent's local API socket. Default `/run/dray/agent.sock`.
    pub agent_socket: PathBuf,
    /// Layers of an image unpacked ahead of their `Prepare` at once
    /// (0 disables prefetch). Default 4.
    pub prefetch_limit: usize,
    /// How long a prefetched layer nobody claims is kept. Default 10 minutes.
    #[serde(with = "duration")]
    pub staged_ttl: Duration,
    /// Deprecated: `staged_ttl` in whole seconds; written, it wins.
    pub staged_ttl_s: Option<u64>,
    /// The agent has this long, plus the layer's size at
    /// `unpack_min_bytes_per_s`, to unpack a layer; past that the shim stops
    /// waiting and containerd pulls the layer itself. Default 60 s.
    #[serde(with = "duration")]
    pub unpack_deadline_floor: Duration,
    /// Deprecated: `unpack_deadline_floor` in whole seconds; written, it wins.
    pub unpack_deadline_floor_s: Option<u64>,
    /// The slowest agent unpack waited for, in compressed bytes per second
    /// (queueing for an unpack slot included). Default 4 MiB/s: a 1 GiB
    /// layer gets 60 + 256 s.
    pub unpack_min_bytes_per_s: u64,
}

impl Default for SnapshotterConfig {
    fn default() -> Self {
        SnapshotterConfig {
            socket: "/run/dray/snapshotter.sock".into(),
            root: "/var/lib/dray/snapshotter".into(),
            agent_socket: "/run/dray/agent.sock".into(),
            prefetch_limit: 4,
            staged_ttl: Duration::from_secs(600),
            staged_ttl_s: None,
            unpack_deadline_floor: Duration::from_secs(60),
            unpack_deadline_floor_s: None,
            unpack_min_bytes_per_s: 4 << 20,
        }
    }
}

impl SnapshotterConfig {
    /// How long the agent may take per layer.
    pub fn unpack_deadline(&self) -> UnpackDeadline {
        UnpackDeadline {
            floor: self.unpack_deadline_floor,
            min_bytes_per_s: self.unpack_min_bytes_per_s.max(1),
        }
    }
}

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("snapshotter config {}: {reason}", path.display())]
pub struct ConfigError {
    path: PathBuf,
    reason: String,
}

impl SnapshotterConfig {
    /// Reads a TOML file; unknown keys are errors. A mistake is one line
    /// naming the file, line, column and key, as in the agent's and the
    /// tracker's configs.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let error = |reason: String| ConfigError {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let mut cfg: Self =
            dray_protocol::settings::from_toml(&text).map_err(|e| error(e.to_string()))?;
        let (ttl, ttl_warning) = deprecated_seconds(
            "staged_ttl_s",
            "staged_ttl",
            cfg.staged_ttl_s.take(),
            cfg.staged_ttl,
        );
        let (floor, floor_warning) = deprecated_seconds(
            "unpack_deadline_floor_s",
            "unpack_deadline_floor",
            cfg.unpack_deadline_floor_s.take(),
            cfg.unpack_deadline_floor,
        );
        (cfg.staged_ttl, cfg.unpack_deadline_floor) = (ttl, floor);
        for w in [ttl_warning, floor_warning].into_iter().flatten() {
            tracing::warn!(file = %path.display(), "{w}");
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_overrides_defaults_and_rejects_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.toml");
        std::fs::write(&path, "root = \"/tmp/r\"\nprefetch_limit = 8\n").unwrap();
        let cfg = SnapshotterConfig::load(&path).unwrap();
        assert_eq!(cfg.root, PathBuf::from("/tmp/r"));
        assert_eq!(cfg.prefetch_limit, 8);
        assert_eq!(cfg.socket, PathBuf::from("/run/dray/snapshotter.sock"));
        std::fs::write(&path, "sokcet = \"/x\"\n").unwrap();
        let e = SnapshotterConfig::load(&path).unwrap_err().to_string();
        assert!(e.contains("s.toml") && e.contains("sokcet"), "{e}");
        assert!(e.contains("line 1, column 1"), "{e}");
        std::fs::write(&path, "root = \"/r\"\nprefetch_limit = \"many\"\n").unwrap();
        let e = SnapshotterConfig::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("line 2, column 18: key `prefetch_limit`: invalid type"),
            "{e}"
        );
        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn durations_are_written_with_units_and_the_old_seconds_keys_still_work() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.toml");
        std::fs::write(&path, "staged_ttl = \"2m\"\nunpack_deadline_floor = 1500\n").unwrap();
        let cfg = SnapshotterConfig::load(&path).unwrap();
        assert_eq!(cfg.staged_ttl, Duration::from_secs(120));
        assert_eq!(cfg.unpack_deadline().floor, Duration::from_millis(1500));
        std::fs::write(&path, "staged_ttl_s = 30\nunpack_deadline_floor_s = 5\n").unwrap();
        let cfg = SnapshotterConfig::load(&path).unwrap();
        assert_eq!(cfg.staged_ttl, Duration::from_secs(30));
        assert_eq!(cfg.unpack_deadline().floor, Duration::from_secs(5));
        assert_eq!(
            (cfg.staged_ttl_s, cfg.unpack_deadline_floor_s),
            (None, None)
        );
    }
}
