//! The agent's configuration: one typed struct, read from TOML, every field
//! defaulted to what a large cluster should run with.

use crate::error::{Error, Result};
use crate::mirror::MirrorConfig;
use crate::peer::PeerConfig;
use crate::swarm::SwarmConfig;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Where blobs and the completion log live.
    pub state_dir: PathBuf,
    /// UDP address of the QUIC peer endpoint. Peers on other nodes must reach
    /// it, so a DaemonSet sets the node address; the default stays on loopback.
    pub peer_listen: SocketAddr,
    /// PEM files: this agent's certificate and key, and the cluster CA.
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    pub peer: PeerConfig,
    pub swarm: SwarmConfig,
    pub mirror: MirrorConfig,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            state_dir: PathBuf::from("/var/lib/dray"),
            peer_listen: "127.0.0.1:7881".parse().expect("valid address"),
            cert: PathBuf::from("/etc/dray/tls/agent.crt"),
            key: PathBuf::from("/etc/dray/tls/agent.key"),
            ca: PathBuf::from("/etc/dray/tls/ca.crt"),
            peer: PeerConfig::default(),
            swarm: SwarmConfig::default(),
            mirror: MirrorConfig::default(),
        }
    }
}

impl AgentConfig {
    /// Reads a TOML file; unknown keys are errors, missing keys take defaults.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        toml::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {}", path.display(), e.message())))
    }
}

/// Serde for durations written as whole milliseconds.
pub mod millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
