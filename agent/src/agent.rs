//! One way to start an agent. [`Agent::open`] opens the store with the
//! configured limits and collector settings, binds the peer endpoint, joins
//! the swarm and makes the one [`Pulls`] that the mirror and the local API
//! share; [`Agent::spawn_loops`] starts the announcer and the garbage
//! collector. `dray agent`, the in-process clusters of the benches and the
//! tests all start agents here, and serve the mirror and the local API of
//! those [`Pulls`] through [`crate::serving::surfaces::Surfaces`], so what
//! they run is what ships.

use crate::config::AgentConfig;
use crate::discovery::dht::Dht;
use crate::error::Result;
use crate::identity::Identity;
use crate::peer::PeerNode;
use crate::pull::Pulls;
use crate::pull::swarm::Swarm;
use crate::serving::metrics::AgentMetrics;
use crate::store::ChunkStore;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// A running agent's parts. Dropping it stops its loops; [`Agent::kill`]
/// also closes its peer endpoint.
pub struct Agent {
    swarm: Arc<Swarm>,
    pulls: Arc<Pulls>,
    metrics: Arc<AgentMetrics>,
    loops: Vec<JoinHandle<()>>,
}

impl Agent {
    /// Opens the store in `cfg.state_dir` (its limits and `[gc]` from `cfg`,
    /// counting into `metrics`), binds the peer endpoint on `cfg.peer_listen`
    /// as `identity` and joins the swarm of `cfg.swarm` (and its DHT, if
    /// `swarm.dht.listen` is set). No loop runs yet.
    pub fn open(cfg: &AgentConfig, identity: Identity, metrics: Arc<AgentMetrics>) -> Result<Self> {
        let store = Arc::new(ChunkStore::open(&cfg.state_dir)?);
        store.set_max_blob_size(cfg.max_blob_size);
        store.set_max_open_idle_blobs(cfg.max_open_idle_blobs);
        store
            .gc()
            .configure(cfg.gc.clone(), !cfg.swarm.trackers.is_empty());
        store.gc().use_metrics(metrics.gc().clone());
        let node = PeerNode::bind_with_metrics(
            identity,
            store,
            cfg.peer_listen,
            cfg.peer.clone(),
            metrics.clone(),
        )?;
        crate::discovery::advertise::check(&cfg.swarm.advertise, node.local_addr()?)?;
        let dht = match cfg.swarm.dht.listen {
            Some(_) => {
                let address = crate::discovery::advertise::announced(
                    &cfg.swarm.advertise,
                    node.local_addr()?,
                );
                Some(Dht::join(
                    node.identity(),
                    &cfg.swarm.dht,
                    address,
                    metrics.dht().clone(),
                )?)
            }
            None => None,
        };
        let swarm = Swarm::new(node, cfg.swarm.clone(), dht);
        Ok(Self {
            pulls: Pulls::new(swarm.clone(), cfg.registry.clone()),
            swarm,
            metrics,
            loops: Vec::new(),
        })
    }

    /// Starts announcing to the tracker and, with `collect`, collecting
    /// garbage every `gc.period`.
    pub fn spawn_loops(&mut self, collect: bool) {
        self.loops.push(self.swarm.spawn_announcer());
        if collect {
            self.loops
                .push(crate::store::gc::spawn(self.swarm.node().store().clone()));
        }
    }

    /// Runs `task` (the certificate's renewal) until the agent stops.
    pub(crate) fn keep_running(&mut self, task: JoinHandle<()>) {
        self.loops.push(task);
    }

    /// Stops the announcer and the collector (the first step of a stop).
    pub fn stop_loops(&self) {
        for l in &self.loops {
            l.abort();
        }
    }

    /// Stops as a crash would: no more announces, answers, uploads or DHT.
    pub fn kill(&self) {
        self.stop_loops();
        self.swarm.node().close();
        if let Some(dht) = self.swarm.dht() {
            dht.stop();
        }
    }

    pub fn swarm(&self) -> &Arc<Swarm> {
        &self.swarm
    }

    /// The pulls the mirror and the local API share (one pull per blob, whoever asks).
    pub fn pulls(&self) -> &Arc<Pulls> {
        &self.pulls
    }

    pub fn node(&self) -> &Arc<PeerNode> {
        self.swarm.node()
    }

    pub fn store(&self) -> &Arc<ChunkStore> {
        self.swarm.node().store()
    }

    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop_loops();
    }
}
