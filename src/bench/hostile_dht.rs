//! The liars of `dray bench swarm --no-tracker --hostile K` (issue 37,
//! acceptance 5), built only with the `hostile` cargo feature. Without a
//! tracker nobody vouches for a chunk's hash, so these liars go for what
//! the DHT and the peers' word decide. Each liar is one cluster member,
//! `liar-{i}`, with a valid certificate, and two faces under that name:
//!
//! - **its peer plane**: an agent whose store holds every chunk of the blob
//!   but the last with one bit flipped (src/bench/hostile.rs's flipper), so it
//!   answers a bitfield request first, with hashes of its own bytes, and
//!   serves those bytes;
//! - **its DHT node**: Kademlia on the agent's protocol and TLS, with a
//!   store of lies: it provides the blob (pointing at its peer plane),
//!   answers GET_PROVIDERS with 300 ids (made up, honest and its own), holds
//!   a forged node record of every honest node and of every made-up id
//!   (naming its own peer-plane address), tries to publish those records
//!   into the honest nodes, and floods them with [`FLOOD_KEYS`] provider
//!   records of random keys.
//!
//! The honest agents pull the blob through their mirrors, as containerd
//! would, and a client checks what each mirror hands out against the
//! blob's digest. The agent has no switch to misbehave: the liars are made
//! of its public parts and of libp2p's.

use crate::bench::RandomBytes;
use anyhow::{Context, Result, bail};
use dray_agent::discovery::dht::tls::libp2p_id;
use dray_agent::discovery::dht::{
    KAD_PROTOCOL, MAX_PACKET, NodeRecord, blob_key, member_swarm, multiaddr_of, node_key, socket_of,
};
use dray_agent::identity::Identity;
use dray_agent::peer::PeerConfig;
use dray_agent::pull::PullState;
use dray_agent::pull::registry::RegistryClient;
use dray_agent::pull::swarm::{PullReport, SwarmConfig};
use dray_agent::serving::mirror::MirrorConfig;
use dray_agent::serving::surfaces::Surfaces;
use dray_protocol::{BlobDigest, DEFAULT_CHUNK_SIZE};
use dray_testkit::cluster::LocalCluster;
use futures_util::StreamExt;
use libp2p::core::ConnectedPoint;
use libp2p::kad::store::{MemoryStore, MemoryStoreConfig, RecordStore};
use libp2p::kad::{self, ProviderRecord, QueryResult, Quorum, Record};
use libp2p::swarm::SwarmEvent;
use libp2p::{StreamProtocol, Swarm};
use serde::Serialize;
use std::collections::BTreeSet;
use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Ids in a liar's answer to GET_PROVIDERS: more than a store keeps (256).
const FORGED_PROVIDERS: usize = 300;
/// Provider records of random keys each liar sends: past the 4 Ki a node
/// stores for one member.
const FLOOD_KEYS: usize = 5000;
/// Flood keys provided per round, one round every [`FLOOD_EVERY`].
const FLOOD_BATCH: usize = 100;
const FLOOD_EVERY: Duration = Duration::from_millis(100);
/// How long a liar's DHT setup step may take.
const SETUP: Duration = Duration::from_secs(20);
/// One dial of the seed, before the liar dials again beside it.
const DIAL_ATTEMPT: Duration = Duration::from_secs(3);
/// How long a liar keeps lying at most, whatever the storm does.
const LIE_FOR: Duration = Duration::from_secs(600);

/// What the liars did to the honest nodes, beside the same storm without them.
#[derive(Serialize)]
pub struct DhtHostileResult {
    /// How many liars, and their ids.
    pub liars: usize,
    pub liar_ids: Vec<String>,
    /// Liars ruled liars by at least one honest node's pull.
    pub liars_identified: usize,
    /// The honest agents' `liars_identified_total` metrics, summed.
    pub liars_identified_metric: u64,
    /// Honest nodes some honest pull ruled a liar or dropped for a bad chunk.
    pub honest_dropped: usize,
    /// Bytes a mirror client received that are not the blob's: must be 0.
    pub bad_bytes_delivered: u64,
    /// Registry egress of the storm beside the liars, in copies of the blob.
    pub egress_ratio: f64,
    pub clean_egress_ratio: f64,
    /// The last honest node's mirror pull, beside the liars and without.
    pub last_s: f64,
    pub p50_s: f64,
    pub clean_last_s: f64,
    /// Honest mirror pulls that failed, with their errors.
    pub failures: Vec<String>,
    /// Chunks honest pulls fetched from the registry to settle a dispute.
    pub checks: u32,
    /// Peers honest nodes dropped as slow, summed.
    pub slow_peers_dropped: usize,
    /// Honest pulls beside the liars that fell back to the registry on
    /// their own (no chunk for `swarm.stall`, or starved): a liar held them.
    pub fell_back: usize,
    /// Flood provider records the liars sent, and forged node records they
    /// tried to publish into honest nodes.
    pub flood_keys: usize,
    pub forged_records: usize,
}

/// One storm through the mirrors: the nodes' times, reports and failures,
/// the registry's egress and the bytes handed out that are not the blob's.
struct MirrorRun {
    times: Vec<f64>,
    reports: Vec<PullReport>,
    failures: Vec<String>,
    egress: u64,
    bad_bytes: u64,
}

/// The tracker-less storm of `nodes` honest agents pulling `digest`
/// through their mirrors, first alone, then beside `count` liars, each in a
/// new cluster under `root`.
pub async fn storm(
    root: &Path,
    nodes: usize,
    count: usize,
    registry: &dray_testkit::testbed::Registry,
    digest: BlobDigest,
) -> Result<DhtHostileResult> {
    let blob = registry.blob_file(&digest.to_string());
    let real = crate::bench::hostile::real_map(&blob, digest)?;
    let swarm = SwarmConfig {
        dht: dray_agent::discovery::dht::DhtConfig {
            listen: Some("127.0.0.1:0".parse()?),
            ..Default::default()
        },
        ..SwarmConfig::default()
    };
    let clean = {
        let cluster = LocalCluster::start(
            &root.join("clean"),
            nodes,
            swarm.clone(),
            &Default::default(),
        )
        .await?;
        mirror_storm(&cluster, nodes, registry, digest, &blob).await?
    };

    let mut cluster =
        LocalCluster::start(&root.join("hostile"), nodes, swarm, &Default::default()).await?;
    let seed = cluster.agents[0]
        .dht()
        .context("the honest agents run the DHT")?
        .listening()
        .await?;
    let (stop_tx, stop) = watch::channel(false);
    let mut speakers = Vec::new();
    let mut liar_ids = Vec::new();
    for i in 0..count {
        let id = format!("liar-{i}");
        // Its peer plane: no DHT of the agent's (its own DHT node speaks
        // for it), so it announces to the cluster's idle tracker instead.
        let liar = cluster.join(
            &id,
            &root.join(&id),
            SwarmConfig::default(),
            PeerConfig::default(),
            None,
        )?;
        crate::bench::hostile::flip_every_chunk(liar.node().store(), &blob, &real)?;
        let me = NodeRecord {
            peer_id: id.clone(),
            address: liar.node().local_addr()?.to_string(),
            dht: Vec::new(),
        };
        let honest: Vec<String> = (0..nodes).map(LocalCluster::node_id).collect();
        let node = LyingNode::start(&cluster.ca.issue(&id)?, seed, me, &honest, &digest).await?;
        speakers.push(tokio::spawn(node.lie(stop.clone())));
        liar_ids.push(id);
    }
    let run = mirror_storm(&cluster, nodes, registry, digest, &blob).await;
    stop_tx.send_replace(true);
    let mut tally = Tally::default();
    for s in speakers {
        let t = s.await.context("a liar's DHT task")?;
        tally.flood += t.flood;
        tally.forged += t.forged;
    }
    let run = run?;
    let liars_identified_metric = cluster.agents[..nodes]
        .iter()
        .map(|a| counter(&a.node().metrics().encode(), "liars_identified_total"))
        .sum();

    let ruled: BTreeSet<&String> = run.reports.iter().flat_map(|r| &r.liars).collect();
    let bad: BTreeSet<&String> = run.reports.iter().flat_map(|r| &r.bad_peers).collect();
    let honest_dropped = (0..nodes)
        .map(LocalCluster::node_id)
        .filter(|id| ruled.contains(id) || bad.contains(id))
        .count();
    let size = real.size() as f64;
    let median = |t: &[f64]| t.get(t.len() / 2).copied().unwrap_or(f64::NAN);
    let last = |t: &[f64]| t.last().copied().unwrap_or(f64::NAN);
    Ok(DhtHostileResult {
        liars: count,
        liars_identified: liar_ids.iter().filter(|id| ruled.contains(id)).count(),
        liars_identified_metric,
        liar_ids,
        honest_dropped,
        bad_bytes_delivered: run.bad_bytes + clean.bad_bytes,
        egress_ratio: run.egress as f64 / size,
        clean_egress_ratio: clean.egress as f64 / size,
        last_s: last(&run.times),
        p50_s: median(&run.times),
        clean_last_s: last(&clean.times),
        failures: clean.failures.into_iter().chain(run.failures).collect(),
        checks: run.reports.iter().map(|r| r.checks).sum(),
        slow_peers_dropped: run.reports.iter().map(|r| r.slow_peers.len()).sum(),
        fell_back: run.reports.iter().filter(|r| r.fell_back).count(),
        flood_keys: tally.flood,
        forged_records: tally.forged,
    })
}

/// The first `nodes` agents of `cluster` pull `digest` at once, each
/// through a mirror of its own, as containerd would; a client reads each
/// mirror's answer whole and checks it against the blob (the file `blob`).
async fn mirror_storm(
    cluster: &LocalCluster,
    nodes: usize,
    registry: &dray_testkit::testbed::Registry,
    digest: BlobDigest,
    blob: &Path,
) -> Result<MirrorRun> {
    let size = std::fs::metadata(blob)?.len();
    let mut servers = Vec::new();
    let mut urls = Vec::new();
    for i in 0..nodes {
        let config = MirrorConfig {
            listen: "127.0.0.1:0".parse()?,
            upstreams: [(registry.host(), registry.url())].into_iter().collect(),
            default_registry: Some(registry.host()),
            ..Default::default()
        };
        let served = Surfaces::serve(cluster.pulls(i), config, None).await?;
        urls.push(served.mirror_url());
        servers.push(served);
    }
    let dir = tempfile::tempdir()?;
    let before = registry.egress();
    let start = Instant::now();
    let tasks: Vec<_> = (0..nodes)
        .map(|i| {
            let pulls = cluster.pulls(i).clone();
            let (url, upstream) = (urls[i].clone(), registry.url());
            let out = dir.path().join(format!("pulled-{i}"));
            tokio::spawn(async move {
                // Joined before the mirror's client, so this reader sees
                // the pull's report: the mirror's client joins this pull.
                let client = pulls.upstream(&upstream)?;
                let (mut state, guard) = pulls
                    .admit(&client, false, "bench/blob", digest, size)
                    .await?;
                let got = RegistryClient::new(&url, None)?
                    .download("bench/blob", &digest, &out)
                    .await;
                let time = start.elapsed().as_secs_f64();
                let report = loop {
                    match state.borrow_and_update().clone() {
                        PullState::Done(report, _) => break Ok((*report).clone()),
                        PullState::Failed(e) => break Err(e),
                        PullState::Running => {}
                    }
                    state.changed().await?;
                };
                drop(guard);
                anyhow::Ok((time, got.map(|_| ()), report, out))
            })
        })
        .collect();
    let mut run = MirrorRun {
        times: Vec::new(),
        reports: Vec::new(),
        failures: Vec::new(),
        egress: 0,
        bad_bytes: 0,
    };
    for (i, t) in tasks.into_iter().enumerate() {
        let (time, got, report, out) = t.await.context("a mirror client's task")??;
        run.bad_bytes += bytes_not_the_blobs(&out, blob)?;
        match (got, report) {
            (Ok(()), Ok(report)) => {
                run.times.push(time);
                run.reports.push(report);
            }
            (Err(e), report) => {
                run.failures
                    .push(format!("node-{i} through its mirror: {e}"));
                run.reports.extend(report.ok());
            }
            (Ok(()), Err(e)) => run.failures.push(format!("node-{i}'s pull: {e}")),
        }
    }
    run.egress = registry.egress() - before;
    run.times.sort_by(f64::total_cmp);
    for s in servers {
        s.abort();
    }
    Ok(run)
}

/// The value of the counter whose name ends in `name` in an exposition.
fn counter(exposition: &str, name: &str) -> u64 {
    exposition
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(metric, _)| metric.ends_with(name))
        .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The bytes of what a client received (the file `got`, a prefix of the
/// blob if all went well) in chunks that differ from the blob's.
fn bytes_not_the_blobs(got: &Path, blob: &Path) -> Result<u64> {
    let Ok(mut got) = std::fs::File::open(got) else {
        return Ok(0);
    };
    let mut blob = std::fs::File::open(blob)?;
    let (mut a, mut b) = (
        vec![0; DEFAULT_CHUNK_SIZE as usize],
        vec![0; DEFAULT_CHUNK_SIZE as usize],
    );
    let mut bad = 0;
    loop {
        let n = read_full(&mut got, &mut a)?;
        if n == 0 {
            return Ok(bad);
        }
        let m = read_full(&mut blob, &mut b)?;
        if m < n || a[..n] != b[..n] {
            bad += n as u64;
        }
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> Result<usize> {
    let mut len = 0;
    while len < buf.len() {
        match f.read(&mut buf[len..])? {
            0 => break,
            n => len += n,
        }
    }
    Ok(len)
}

/// What a liar's DHT node sent.
#[derive(Default)]
struct Tally {
    flood: usize,
    forged: usize,
}

/// A liar's DHT node: Kademlia on the agent's protocol and TLS, its store
/// holding the lies of the module's doc.
struct LyingNode {
    swarm: Swarm<kad::Behaviour<MemoryStore>>,
    /// Forged node records it tries to publish into honest nodes.
    forged: Vec<Record>,
}

impl LyingNode {
    /// Joins the DHT at `seed` as `identity`, publishes its own record `me`
    /// (with its DHT address), provides `digest` and fills its store with
    /// the forged provider list and node records (of `honest` and of
    /// made-up ids). Returns once the provider record went out.
    async fn start(
        identity: &Identity,
        seed: SocketAddr,
        mut me: NodeRecord,
        honest: &[String],
        digest: &BlobDigest,
    ) -> Result<Self> {
        let local = libp2p_id(&identity.peer_id);
        let mut config = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
        config.set_max_packet_size(MAX_PACKET);
        let store = MemoryStore::with_config(
            local,
            MemoryStoreConfig {
                max_records: 4 * FORGED_PROVIDERS,
                max_provided_keys: 2 * FLOOD_KEYS,
                max_providers_per_key: 2 * FORGED_PROVIDERS,
                ..Default::default()
            },
        );
        let mut behaviour = kad::Behaviour::with_config(local, store, config);
        behaviour.set_mode(Some(kad::Mode::Server));
        let mut swarm = member_swarm(identity, Default::default(), behaviour)?;
        swarm.listen_on(multiaddr_of("127.0.0.1:0".parse()?))?;
        let bound = until(&mut swarm, "listening", |e| match e {
            SwarmEvent::NewListenAddr { address, .. } => socket_of(address),
            _ => None,
        })
        .await?;
        let (peer, address) = connect(&mut swarm, seed).await?;
        swarm.behaviour_mut().add_address(&peer, address);
        swarm.behaviour_mut().bootstrap()?;

        me.dht = vec![bound];
        let mut own = Record::new(node_key(&local), serde_json::to_vec(&me)?);
        own.publisher = Some(local);
        swarm.behaviour_mut().put_record(own, Quorum::One)?;
        swarm.behaviour_mut().start_providing(blob_key(digest))?;

        // The forged provider list: made-up ids first, then every honest
        // node and itself; and a forged record of each naming its own
        // peer plane, which no honest node's certificate answers to.
        let ghosts: Vec<String> = (0..FORGED_PROVIDERS - honest.len() - 1)
            .map(|i| format!("ghost-{}-{i}", identity.peer_id))
            .collect();
        let store = swarm.behaviour_mut().store_mut();
        let mut forged = Vec::new();
        for id in ghosts.iter().chain(honest) {
            let peer = libp2p_id(id);
            store.add_provider(ProviderRecord::new(blob_key(digest), peer, Vec::new()))?;
            let lie = NodeRecord {
                peer_id: id.clone(),
                address: me.address.clone(),
                dht: vec![bound],
            };
            let record = Record::new(node_key(&peer), serde_json::to_vec(&lie)?);
            store.put(record.clone())?;
            forged.push(record);
        }
        until(&mut swarm, "providing the blob", |e| match e {
            SwarmEvent::Behaviour(kad::Event::OutboundQueryProgressed {
                result: QueryResult::StartProviding(_),
                ..
            }) => Some(()),
            _ => None,
        })
        .await?;
        Ok(Self { swarm, forged })
    }

    /// Publishes its forged records, floods provider records and answers
    /// queries from its store of lies until `stop` (or [`LIE_FOR`]).
    async fn lie(mut self, mut stop: watch::Receiver<bool>) -> Tally {
        let mut tally = Tally::default();
        for r in std::mem::take(&mut self.forged) {
            // Refused by honest nodes (not the sender's own record): it tries.
            if self
                .swarm
                .behaviour_mut()
                .put_record(r, Quorum::One)
                .is_ok()
            {
                tally.forged += 1;
            }
        }
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut keys = RandomBytes::new(seed);
        let mut flood = tokio::time::interval(FLOOD_EVERY);
        let deadline = tokio::time::sleep(LIE_FOR);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = stop.changed() => return tally,
                _ = &mut deadline => return tally,
                _ = self.swarm.select_next_some() => {}
                _ = flood.tick(), if tally.flood < FLOOD_KEYS => {
                    for _ in 0..FLOOD_BATCH {
                        let mut key = [0u8; 32];
                        _ = keys.read(&mut key);
                        if self.swarm.behaviour_mut().start_providing(kad::RecordKey::new(&key)).is_ok() {
                            tally.flood += 1;
                        }
                    }
                }
            }
        }
    }
}

/// Drives `swarm` until `f` picks something out of an event, for at most
/// [`SETUP`]; `what` names the wait in the error.
/// Dials `seed` until a connection is up, or [`SETUP`] passes: again after
/// a failed dial, and beside one that has not finished in [`DIAL_ATTEMPT`].
/// The suite once saw the single dial of the first version get nowhere
/// and the bench fail 20 s later (why was not found; every node of a local
/// cluster is 127.0.0.1, one address to the seed's cap on handshakes per
/// address, which the honest nodes' own dials share).
async fn connect(
    swarm: &mut Swarm<kad::Behaviour<MemoryStore>>,
    seed: SocketAddr,
) -> Result<(libp2p::PeerId, libp2p::Multiaddr)> {
    let wait = async {
        loop {
            swarm.dial(multiaddr_of(seed))?;
            let attempt = async {
                loop {
                    match swarm.select_next_some().await {
                        SwarmEvent::ConnectionEstablished {
                            peer_id,
                            endpoint: ConnectedPoint::Dialer { address, .. },
                            ..
                        } => return Some((peer_id, address)),
                        SwarmEvent::OutgoingConnectionError { error, .. } => {
                            tracing::info!(%error, "a liar's dial of the seed failed; dialling again");
                            return None;
                        }
                        _ => {}
                    }
                }
            };
            if let Ok(Some(up)) = tokio::time::timeout(DIAL_ATTEMPT, attempt).await {
                return anyhow::Ok(up);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    match tokio::time::timeout(SETUP, wait).await {
        Ok(r) => r,
        Err(_) => bail!("a liar's DHT node was not connected to the seed within {SETUP:?}"),
    }
}

async fn until<T>(
    swarm: &mut Swarm<kad::Behaviour<MemoryStore>>,
    what: &str,
    mut f: impl FnMut(&SwarmEvent<kad::Event>) -> Option<T>,
) -> Result<T> {
    let wait = async {
        loop {
            let event = swarm.select_next_some().await;
            if let Some(t) = f(&event) {
                return t;
            }
        }
    };
    match tokio::time::timeout(SETUP, wait).await {
        Ok(t) => Ok(t),
        Err(_) => bail!("a liar's DHT node was not {what} within {SETUP:?}"),
    }
}

/// The table lines of a tracker-less hostile run.
pub fn print(h: &DhtHostileResult) {
    println!(
        "beside {} liars without a tracker ({}):",
        h.liars,
        h.liar_ids.join(", ")
    );
    println!(
        "through the mirrors: egress {:.3} (clean {:.3})   last {:.2} s (clean {:.2} s)   p50 {:.2} s",
        h.egress_ratio, h.clean_egress_ratio, h.last_s, h.clean_last_s, h.p50_s
    );
    println!(
        "liars identified: {} ({} by the metric)   honest nodes dropped: {}   bad bytes delivered: {}   registry checks: {}   slow peers dropped: {}   fell back: {}",
        h.liars_identified,
        h.liars_identified_metric,
        h.honest_dropped,
        h.bad_bytes_delivered,
        h.checks,
        h.slow_peers_dropped,
        h.fell_back
    );
    println!(
        "flood provider records sent: {}   forged node records pushed: {}",
        h.flood_keys, h.forged_records
    );
    for f in &h.failures {
        println!("failed: {f}");
    }
}
