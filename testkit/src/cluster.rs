//! Agents and a tracker in this process, started the one way the benches,
//! `dray demo` and the tests start them: [`InProcessTracker`] serves the
//! real tracker over TLS with a certificate from the cluster's CA, as a
//! cluster's does; [`start_agent`] opens an agent as `dray agent` does (its
//! store, peer endpoint, swarm, and optionally its garbage collector);
//! [`LocalCluster`] is a tracker and N agents on loopback, each with its
//! store under one root directory. With `swarm.dht.listen` set, the agents
//! find each other through the DHT alone (the first is the others' seed)
//! and none announces to the tracker. [`pull_each`] has every agent pull one
//! blob at once and times each.

use anyhow::{Context, Result};
use dray_agent::Agent;
use dray_agent::config::AgentConfig;
use dray_agent::discovery::dht::DhtConfig;
use dray_agent::identity::ClusterCa;
use dray_agent::peer::PeerConfig;
use dray_agent::pull::registry::RegistryClient;
use dray_agent::pull::swarm::{PullReport, Swarm, SwarmConfig};
use dray_agent::store::gc::GcConfig;
use dray_protocol::BlobDigest;
use dray_tracker::{Tracker, TrackerConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How long the agents of a DHT cluster may take to find each other (a
/// fraction of a second on an idle machine).
const JOIN_WITHIN: Duration = Duration::from_secs(60);

/// A tracker served from this process over TLS, with a certificate from the
/// cluster's CA for `localhost` and the loopback addresses; dropping it
/// stops it.
pub struct InProcessTracker {
    /// Its state, for tests and benches to read.
    pub tracker: Arc<Tracker>,
    pub addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl InProcessTracker {
    /// Serves a tracker of `config` on `addr` (a loopback address; port 0
    /// for any).
    pub async fn start(ca: &ClusterCa, config: &TrackerConfig, addr: &str) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the tracker to {addr}"))?;
        let addr = listener.local_addr()?;
        let tracker = Tracker::new(config);
        let tls = ca
            .issue_tracker(&["localhost".into(), "127.0.0.1".into(), "::1".into()], 1)?
            .tracker_server_tls()?;
        let transport = dray_tracker::Transport::Tls {
            config: Arc::new(tls),
            max_connections: config.max_connections,
        };
        let task = tokio::spawn(dray_tracker::serve(listener, tracker.clone(), transport));
        Ok(Self {
            tracker,
            addr,
            task,
        })
    }

    /// The URL agents announce to.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Stops serving, as a crash would: every connection is dropped.
    pub fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for InProcessTracker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts agent `id` as `dray agent` does, with a certificate from `ca`,
/// its store in `dir` and its peer endpoint on `listen`; it collects
/// garbage under `gc`, if given.
pub fn start_agent(
    ca: &ClusterCa,
    id: &str,
    dir: &Path,
    listen: SocketAddr,
    swarm: SwarmConfig,
    peer: PeerConfig,
    gc: Option<&GcConfig>,
) -> Result<Agent> {
    let config = AgentConfig {
        state_dir: dir.to_path_buf(),
        peer_listen: listen,
        peer,
        swarm,
        gc: gc.cloned().unwrap_or_default(),
        ..AgentConfig::default()
    };
    let mut agent = Agent::open(&config, ca.issue(id)?, Arc::default())
        .with_context(|| format!("starting agent {id} with its store in {}", dir.display()))?;
    agent.spawn_loops(gc.is_some());
    Ok(agent)
}

/// A tracker and its agents; dropping it stops them all.
pub struct LocalCluster {
    /// The agents, `node-0` to `node-{N-1}`.
    pub agents: Vec<Arc<Swarm>>,
    /// The CA that issued every certificate of the cluster.
    pub ca: ClusterCa,
    /// The tracker, which the agents reach over TLS (unless they joined a
    /// DHT).
    pub tracker: InProcessTracker,
    /// Every member, the agents and [`Self::join`]'s, to stop.
    members: Vec<Agent>,
    /// The DHT address members join through (the first agent's), when
    /// they find each other through the DHT alone.
    seed: Option<String>,
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
        gc: &GcConfig,
    ) -> Result<LocalCluster> {
        let ca = ClusterCa::generate()?;
        let tracker =
            InProcessTracker::start(&ca, &TrackerConfig::default(), "127.0.0.1:0").await?;
        let mut cluster = LocalCluster {
            agents: Vec::new(),
            ca,
            tracker,
            members: Vec::new(),
            seed: None,
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
        let started = Instant::now();
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
                tokio::time::sleep(Duration::from_millis(50)).await;
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
        gc: Option<&GcConfig>,
    ) -> Result<Arc<Swarm>> {
        let swarm = match swarm.dht.listen {
            None => SwarmConfig {
                trackers: vec![self.tracker.url()],
                ..swarm
            },
            Some(_) => SwarmConfig {
                trackers: Vec::new(),
                dht: DhtConfig {
                    bootstrap: self.seed.iter().cloned().collect(),
                    ..swarm.dht.clone()
                },
                ..swarm
            },
        };
        let agent = start_agent(&self.ca, id, dir, "127.0.0.1:0".parse()?, swarm, peer, gc)?;
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
    }
}

/// Every swarm of `agents` pulls `repo`'s blob `digest` through `registry`
/// at once; each pull's outcome with its seconds from the start, in the
/// order they finished. Fails only if a pull's task panicked.
pub async fn pull_each(
    agents: &[Arc<Swarm>],
    registry: &Arc<RegistryClient>,
    repo: &str,
    digest: BlobDigest,
) -> Result<Vec<(f64, Result<PullReport>)>> {
    let start = Instant::now();
    let mut pulls = tokio::task::JoinSet::new();
    for swarm in agents {
        let (swarm, registry, repo) = (swarm.clone(), registry.clone(), repo.to_string());
        pulls.spawn(async move {
            let outcome = swarm.pull(&registry, &repo, digest).await;
            (start.elapsed().as_secs_f64(), outcome.map_err(Into::into))
        });
    }
    let mut done = Vec::new();
    while let Some(pull) = pulls.join_next().await {
        done.push(pull.context("a pull's task")?);
    }
    Ok(done)
}
