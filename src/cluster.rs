//! A swarm in this process: a tracker and N agents on loopback, each with
//! its own chunk store under one root directory and its own certificate from
//! one in-memory cluster CA (the tracker's too: they speak TLS to it as in a
//! cluster). Each agent runs its garbage collector, as `dray agent` does.
//! Shared by `dray bench swarm` and `dray demo`. With `swarm.dht.listen`
//! set, the agents find each other through the DHT alone (the first is the
//! others' seed) and none announces to the tracker.

use anyhow::{Context, Result};
use dray_agent::Agent;
use dray_agent::config::AgentConfig;
use dray_agent::identity::ClusterCa;
use dray_agent::peer::PeerConfig;
use dray_agent::pull::swarm::{Swarm, SwarmConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// How long the agents of a DHT cluster may take to find each other (a
/// fraction of a second on an idle machine).
const JOIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// A tracker and its agents; dropping it stops them all.
pub struct LocalCluster {
    /// The agents, `node-0` to `node-{N-1}`, each announcing to the tracker.
    pub agents: Vec<Arc<Swarm>>,
    /// The CA that issued every certificate of the cluster.
    pub ca: ClusterCa,
    /// The tracker's URL and its state, which the agents reach over TLS.
    pub tracker_url: String,
    #[cfg(feature = "hostile")]
    pub tracker: Arc<dray_tracker::Tracker>,
    /// Every member, the agents and [`Self::join`]'s, to stop.
    members: Vec<Agent>,
    /// The DHT address members join through (the first agent's), when
    /// they find each other through the DHT alone.
    seed: Option<String>,
    server: JoinHandle<std::io::Result<()>>,
}

impl LocalCluster {
    /// Starts a tracker on 127.0.0.1 and `nodes` agents with their stores in
    /// [`Self::node_dir`]`(root, i)`, collecting garbage under `gc`;
    /// `swarm.trackers` is set to the tracker, unless `swarm.dht.listen` is
    /// set: then the agents join one DHT (each on a port of its own at that
    /// address), and this returns once each has the others, or 8 of them, in
    /// its routing table (Kademlia fills a table with the nodes it meets,
    /// not with every node).
    pub async fn start(
        root: &Path,
        nodes: usize,
        swarm: SwarmConfig,
        gc: &dray_agent::store::gc::GcConfig,
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
        let tracker = dray_tracker::Tracker::new(&config);
        let server = tokio::spawn(dray_tracker::serve(
            listener,
            tracker.clone(),
            dray_tracker::Transport::Tls {
                config: Arc::new(tls),
                max_connections: config.max_connections,
            },
        ));
        let mut cluster = LocalCluster {
            agents: Vec::new(),
            ca,
            tracker_url,
            #[cfg(feature = "hostile")]
            tracker,
            members: Vec::new(),
            seed: None,
            server,
        };
        for i in 0..nodes {
            let swarm = cluster.join(
                &Self::node_id(i),
                &Self::node_dir(root, i),
                swarm.clone(),
                PeerConfig::default(),
                Some(gc),
            )?;
            if let (Some(dht), None) = (swarm.dht(), &cluster.seed) {
                cluster.seed = Some(dht.listening().await?.to_string());
            }
            cluster.agents.push(swarm);
        }
        let started = std::time::Instant::now();
        let want = (nodes - 1).min(8);
        for a in &cluster.agents {
            let Some(dht) = a.dht() else { continue };
            while dht.routing_peers().await < want {
                if started.elapsed() > JOIN_WITHIN {
                    let mut held = Vec::new();
                    for a in &cluster.agents {
                        if let Some(d) = a.dht() {
                            held.push(d.routing_peers().await);
                        }
                    }
                    anyhow::bail!(
                        "the agents did not all join the DHT within {JOIN_WITHIN:?}: peers in each agent's routing table {held:?}, {want} wanted"
                    );
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        Ok(cluster)
    }

    /// Starts one more member, `id`, with its store in `dir`, announcing to
    /// the tracker or joining the DHT (see [`Self::start`]), and collecting
    /// garbage under `gc`, if given.
    pub fn join(
        &mut self,
        id: &str,
        dir: &Path,
        swarm: SwarmConfig,
        peer: PeerConfig,
        gc: Option<&dray_agent::store::gc::GcConfig>,
    ) -> Result<Arc<Swarm>> {
        let config = AgentConfig {
            state_dir: dir.to_path_buf(),
            peer_listen: "127.0.0.1:0".parse()?,
            peer,
            swarm: match swarm.dht.listen {
                None => SwarmConfig {
                    trackers: vec![self.tracker_url.clone()],
                    ..swarm
                },
                Some(_) => SwarmConfig {
                    trackers: Vec::new(),
                    dht: dray_agent::discovery::dht::DhtConfig {
                        bootstrap: self.seed.iter().cloned().collect(),
                        ..swarm.dht.clone()
                    },
                    ..swarm
                },
            },
            gc: gc.cloned().unwrap_or_default(),
            ..AgentConfig::default()
        };
        let mut agent = Agent::open(&config, self.ca.issue(id)?, Arc::default())
            .with_context(|| format!("starting agent {id} with its store in {}", dir.display()))?;
        agent.spawn_loops(gc.is_some());
        let swarm = agent.swarm().clone();
        self.members.push(agent);
        Ok(swarm)
    }

    /// Member `i`'s pulls, which its mirror and local API read through.
    pub fn pulls(&self, i: usize) -> &Arc<dray_agent::pull::Pulls> {
        self.members[i].pulls()
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
        for a in &self.members {
            a.kill();
        }
        self.server.abort();
    }
}
