//! A swarm in this process: a tracker and N agents on loopback, each with
//! its own chunk store under one root directory and its own certificate from
//! one in-memory cluster CA (the tracker's too: they speak TLS to it as in a
//! cluster). Each agent runs its garbage collector, as `dray agent` does.
//! Shared by `dray bench swarm` and `dray demo`.

use anyhow::{Context, Result};
use dray_agent::identity::ClusterCa;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::store::ChunkStore;
use dray_agent::swarm::{Swarm, SwarmConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// A tracker and its agents; dropping it stops them all.
pub struct LocalCluster {
    /// The agents, `node-0` to `node-{N-1}`, each announcing to the tracker.
    pub agents: Vec<Arc<Swarm>>,
    /// Each agent's announcer and garbage collector.
    tasks: Vec<JoinHandle<()>>,
    tracker: JoinHandle<std::io::Result<()>>,
}

impl LocalCluster {
    /// Starts a tracker on 127.0.0.1 and `nodes` agents with their stores in
    /// [`Self::node_dir`]`(root, i)`, collecting garbage under `gc`;
    /// `swarm.trackers` is set to the tracker.
    pub async fn start(
        root: &Path,
        nodes: usize,
        swarm: SwarmConfig,
        gc: &dray_agent::gc::GcConfig,
    ) -> Result<LocalCluster> {
        let ca = ClusterCa::generate()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the tracker to 127.0.0.1")?;
        let tracker_url = format!("https://{}", listener.local_addr()?);
        let config = dray_tracker::TrackerConfig::default();
        let tls = ca
            .issue_tracker(&["localhost".into(), "127.0.0.1".into()], 1)?
            .tracker_server_tls()?;
        let tracker = tokio::spawn(dray_tracker::serve(
            listener,
            dray_tracker::Tracker::new(&config),
            dray_tracker::Transport::Tls {
                config: Arc::new(tls),
                max_connections: config.max_connections,
            },
        ));
        let mut cluster = LocalCluster {
            agents: Vec::new(),
            tasks: Vec::new(),
            tracker,
        };
        for i in 0..nodes {
            let dir = Self::node_dir(root, i);
            let store = Arc::new(
                ChunkStore::open(&dir)
                    .with_context(|| format!("opening the store in {}", dir.display()))?,
            );
            store.gc().configure(gc.clone(), true);
            cluster.tasks.push(dray_agent::gc::spawn(store.clone()));
            let node = PeerNode::bind(
                ca.issue(&Self::node_id(i))?,
                store,
                "127.0.0.1:0".parse()?,
                PeerConfig::default(),
            )?;
            let swarm = Swarm::new(
                node,
                SwarmConfig {
                    trackers: vec![tracker_url.clone()],
                    ..swarm.clone()
                },
            );
            cluster.tasks.push(swarm.spawn_announcer());
            cluster.agents.push(swarm);
        }
        Ok(cluster)
    }

    /// Agent `i`'s peer id.
    pub fn node_id(i: usize) -> String {
        format!("node-{i}")
    }

    /// Where agent `i` keeps its store.
    pub fn node_dir(root: &Path, i: usize) -> PathBuf {
        root.join(Self::node_id(i))
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for s in &self.agents {
            s.node().close();
        }
        self.tracker.abort();
    }
}
