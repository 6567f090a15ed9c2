//! The agent's configuration: one typed struct, read from TOML, every field
//! defaulted to what a large cluster should run with.

use crate::error::{Error, Result};
use crate::peer::PeerConfig;
use crate::pull::registry::RegistryConfig;
use crate::pull::swarm::SwarmConfig;
use crate::serving::local_api::LocalApiConfig;
use crate::serving::mirror::MirrorConfig;
use crate::unpack::UnpackLimits;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Where blobs and the completion log live.
    pub state_dir: PathBuf,
    /// The largest blob the store reserves disk for when no manifest verified
    /// by digest gives its size (a registry's `Content-Length` alone), bytes.
    pub max_blob_size: u64,
    /// Idle blobs (complete or partial, not being read, pulled or uploaded)
    /// the store keeps open, one file descriptor each; the least recently
    /// used past this are closed, and reopened from their record on demand.
    pub max_open_idle_blobs: usize,
    /// UDP address of the QUIC peer endpoint. Peers on other nodes must reach
    /// it, so a DaemonSet sets the node address; the default stays on loopback.
    pub peer_listen: SocketAddr,
    /// TCP address of the admin endpoint: `/metrics`, `/healthz`, `/readyz`.
    /// Loopback by default; a DaemonSet sets the node address for scraping.
    pub admin_listen: SocketAddr,
    /// PEM files: this agent's certificate and key, and the cluster CA.
    /// In signer mode (`[enroll] signer`) the agent writes `cert` and `key`
    /// itself.
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// Signer mode (`[enroll]`, see [`crate::identity::enroll`]): the certificate
    /// comes from the tracker's signer and is renewed in place.
    pub enroll: crate::identity::enroll::EnrollConfig,
    pub peer: PeerConfig,
    pub swarm: SwarmConfig,
    pub mirror: MirrorConfig,
    /// How fast registries must send (`[registry]`, see
    /// [`RegistryConfig`]): `range_floor` (30 s) plus a range's length at
    /// `range_min_bytes_per_s` (64 KiB/s) for every range read.
    pub registry: RegistryConfig,
    pub local_api: LocalApiConfig,
    /// Garbage collection of the store (`[gc]`, see [`crate::store::gc`]):
    /// `budget` (bytes; default none, the filesystem's watermarks alone),
    /// `high_watermark` 0.80 and `low_watermark` 0.60 (shares of the budget
    /// and of the store's filesystem: past high, evict down to low),
    /// `critical_watermark` 0.95 (past it the cluster's last copies go too,
    /// and new blobs are refused), `ttl` 6 h (complete blobs unused that
    /// long go first), `partial_ttl` 1 h, `period` 60 s,
    /// `keep_cluster_copies` 3, `pinned` (blob digests never evicted).
    pub gc: crate::store::gc::GcConfig,
    /// What one layer may ask of the unpacker (`[unpack]`): `max_entries`
    /// (default 4,000,000 tar entries, not counting GNU long names and links
    /// and PAX extended headers), `max_layer_bytes` (256 GiB of
    /// uncompressed tar), `max_layer_ratio` (2000 uncompressed bytes per
    /// compressed byte, checked past the first 64 MiB), `max_path_bytes`
    /// (4096). GNU long names and links and PAX headers are capped at 1 MiB,
    /// as in containerd; that cap is not configurable. `[unpack.parallel_gzip]`
    /// says when a gzip layer is decoded on several cores (`threads` 0 =
    /// automatic: one per core on nodes of `min_cores` 4 or more, for layers
    /// of `min_layer_bytes` 256 MiB or more).
    pub unpack: UnpackLimits,
    /// On SIGTERM or SIGINT: how long in-flight unpacks, mirror answers and
    /// uploads may run on before the agent exits anyway. Default 20 s, below
    /// Kubernetes' 30 s `terminationGracePeriodSeconds`, so that the agent
    /// flushes its store and exits 0 before the kubelet kills it.
    #[serde(with = "dray_protocol::settings::duration")]
    pub shutdown_grace: std::time::Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/var/lib/dray"),
            max_blob_size: crate::store::DEFAULT_MAX_BLOB_SIZE,
            max_open_idle_blobs: crate::store::DEFAULT_MAX_OPEN_IDLE_BLOBS,
            peer_listen: "127.0.0.1:7881".parse().expect("valid address"),
            admin_listen: "127.0.0.1:9464".parse().expect("valid address"),
            cert: PathBuf::from("/etc/dray/tls/agent.crt"),
            key: PathBuf::from("/etc/dray/tls/agent.key"),
            ca: PathBuf::from("/etc/dray/tls/ca.crt"),
            enroll: crate::identity::enroll::EnrollConfig::default(),
            peer: PeerConfig::default(),
            swarm: SwarmConfig::default(),
            mirror: MirrorConfig::default(),
            registry: RegistryConfig::default(),
            local_api: LocalApiConfig::default(),
            gc: crate::store::gc::GcConfig::default(),
            unpack: UnpackLimits::default(),
            shutdown_grace: std::time::Duration::from_secs(20),
        }
    }
}

impl AgentConfig {
    /// Reads a TOML file; unknown keys are errors, missing keys take defaults.
    /// A mistake is one line naming the file, line, column and key.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        let cfg: Self = dray_protocol::settings::from_toml(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        cfg.gc
            .validate()
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        Ok(cfg)
    }
}

/// Parses a socket address as `addr:port`, where an IPv6 address may also
/// come without brackets (`fd00::1:7881`, as `$(NODE_IP):7881` in a pod
/// spec expands on an IPv6 node): a socket address always ends in a port,
/// so the last colon splits them.
pub fn parse_socket_addr(s: &str) -> std::result::Result<SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.rsplit_once(':')
        .and_then(|(ip, port)| {
            let ip: IpAddr = ip.parse().ok().filter(IpAddr::is_ipv6)?;
            Some(SocketAddr::new(ip, port.parse().ok()?))
        })
        .ok_or_else(|| {
            format!("{s:?} is not an address and port such as 10.0.0.1:7881, [fd00::1]:7881 or fd00::1:7881")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(text: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.toml");
        std::fs::write(&p, text).unwrap();
        let e = AgentConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()), "{e}");
        assert!(!e.contains('\n'), "{e}");
        e
    }

    #[test]
    fn a_mistake_is_one_line_naming_the_file_position_key_and_problem() {
        let e = error_of("state_dir = \"/x\"\n[swarm]\nstall = \"soon\"\n");
        assert!(
            e.contains("line 3, column 9: key `swarm.stall`: \"soon\" is not a duration"),
            "{e}"
        );
        let e = error_of("[peer]\nrequest_timeout = \"twenty seconds\"\n");
        assert!(
            e.contains("key `peer.request_timeout`: \"twenty seconds\" is not a duration"),
            "{e}"
        );
        let e = error_of("admin_listen = \"localhost\"\n");
        assert!(
            e.contains("key `admin_listen`: invalid socket address syntax"),
            "{e}"
        );
        let e = error_of("[mirror]\nlisten = \"127.0.0.1:5050\"\nupstream = {}\n");
        assert!(
            e.contains("line 3, column 1: key `mirror.upstream`: unknown field `upstream`"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = AgentConfig::load(Path::new("/nonexistent/agent.toml"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "configuration: cannot read /nonexistent/agent.toml: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn durations_take_milliseconds_or_units() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.toml");
        for (written, want) in [("1500", 1500), ("\"1s 500ms\"", 1500), ("\"2m\"", 120_000)] {
            std::fs::write(&p, format!("[peer]\nrequest_timeout = {written}\n")).unwrap();
            let cfg = AgentConfig::load(&p).unwrap();
            assert_eq!(
                cfg.peer.request_timeout,
                std::time::Duration::from_millis(want)
            );
        }
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, "state_dir = \"/x\"\n[peer]\nmax_upload = 3\n").unwrap();
        let err = AgentConfig::load(&p).unwrap_err().to_string();
        assert!(err.contains("unknown field `max_upload`"), "{err}");
        std::fs::write(
            &p,
            "state_dir = \"/x\"\n[peer]\nupload_bytes_per_s = 1000\n",
        )
        .unwrap();
        let cfg = AgentConfig::load(&p).unwrap();
        assert_eq!(cfg.peer.upload_bytes_per_s, Some(1000));
        assert_eq!(cfg.peer.max_uploads, PeerConfig::default().max_uploads);
    }

    #[test]
    fn socket_addresses_take_ipv6_with_or_without_brackets() {
        for (text, want) in [
            ("10.0.0.1:7881", "10.0.0.1:7881"),
            ("[fd00::1]:7881", "[fd00::1]:7881"),
            ("fd00::1:7881", "[fd00::1]:7881"),
            ("::1:5050", "[::1]:5050"),
        ] {
            assert_eq!(parse_socket_addr(text).unwrap().to_string(), want, "{text}");
        }
        for bad in [
            "10.0.0.1",
            "fd00::1",
            "node-a:7881",
            "10.0.0.1:7881:1",
            "[fd00::1]",
        ] {
            let err = parse_socket_addr(bad).unwrap_err();
            assert!(err.contains("is not an address and port"), "{bad}: {err}");
        }
    }
}
