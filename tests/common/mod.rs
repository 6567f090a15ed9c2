//! Test harness: the real distribution registry from Debian behind a counting
//! (and optionally throttling) TCP relay, a tracker and agents in this process.

#![allow(dead_code, unused_imports)] // each test binary uses a different part of the harness

#[path = "../../src/testbed.rs"]
mod testbed;
pub use testbed::{Registry, file_digest};

use dray_agent::identity::ClusterCa;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::registry::{Credentials, RegistryClient};
use dray_agent::store::ChunkStore;
use dray_agent::swarm::{Swarm, SwarmConfig};
use dray_tracker::{Tracker, TrackerConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// Logs to the test's stderr, filtered by `DRAY_LOG` (e.g. `dray_agent=debug`).
pub fn init_logs() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("DRAY_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// `size` random bytes from the kernel into `path`.
pub fn random_file(path: &Path, size: u64) {
    let status = Command::new("head")
        .args(["-c", &size.to_string(), "/dev/urandom"])
        .stdout(std::fs::File::create(path).unwrap())
        .status()
        .unwrap();
    assert!(status.success());
}

/// A tracker served from this process.
pub struct TrackerProc {
    pub tracker: Arc<Tracker>,
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TrackerProc {
    pub async fn start(config: &TrackerConfig, addr: &str) -> TrackerProc {
        init_logs();
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tracker = Tracker::new(config);
        let task = tokio::spawn(dray_tracker::serve(listener, tracker.clone()));
        TrackerProc {
            tracker,
            addr,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving, as a crash would: every connection is dropped.
    pub fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for TrackerProc {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Tracker settings that react within a test's patience.
pub fn quick_tracker() -> TrackerConfig {
    TrackerConfig {
        announce_interval_ms: 500,
        min_fetch_timeout_ms: 1_000,
        ..TrackerConfig::default()
    }
}

/// Swarm settings that react within a test's patience.
pub fn quick_swarm(trackers: Vec<String>) -> SwarmConfig {
    SwarmConfig {
        trackers,
        pull_announce_ms: 150,
        idle_announce_ms: 300,
        tracker_grace_ms: 1_500,
        stall_ms: 4_000,
        ..SwarmConfig::default()
    }
}

/// An agent in this process.
pub struct Agent {
    pub swarm: Arc<Swarm>,
    pub dir: PathBuf,
    announcer: tokio::task::JoinHandle<()>,
}

impl Agent {
    pub fn start(
        ca: &ClusterCa,
        id: &str,
        root: &Path,
        config: SwarmConfig,
        peer: PeerConfig,
    ) -> Agent {
        let dir = root.join(id);
        let store = Arc::new(ChunkStore::open(&dir).unwrap());
        let node = PeerNode::bind(
            ca.issue(id).unwrap(),
            store,
            "127.0.0.1:0".parse().unwrap(),
            peer,
        )
        .unwrap();
        let swarm = Swarm::new(node, config);
        let announcer = swarm.spawn_announcer();
        Agent {
            swarm,
            dir,
            announcer,
        }
    }

    /// Path of a blob's file in this agent's store.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// Stops the agent as a crash would: no more announces, answers or uploads.
    pub fn kill(&self) {
        self.announcer.abort();
        self.swarm.node().close();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn registry_client(url: &str, creds: Option<(&str, &str)>) -> Arc<RegistryClient> {
    let creds = creds.map(|(u, p)| Credentials {
        username: u.into(),
        password: p.into(),
    });
    Arc::new(RegistryClient::new(url, creds).unwrap())
}
