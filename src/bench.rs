//! `dray bench`: measurements that always run their baseline in the same
//! process and the same run, and report ratios, because absolute times on a
//! shared machine drift.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use dray_agent::identity::ClusterCa;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::pulls::Pulls;
use dray_agent::store::ChunkStore;
use serde::Serialize;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// One blob from a sending agent process to a receiving one over QUIC vs
    /// plain TCP, TCP with rustls and a bare quinn stream, each side's CPU
    /// seconds per GiB, and the cost of writing the same bytes to a file.
    Peer(crate::bench_peer::PeerBench),
    /// The sending process of `dray bench peer` (started by it).
    #[command(hide = true)]
    PeerSend(crate::bench_peer::PeerSend),
    /// N agents pulling one blob through the swarm vs N direct pulls, from the
    /// real registry (`docker-registry`) on loopback.
    Swarm(SwarmBench),
    /// An image's blobs pulled through a warm mirror vs straight from the registry.
    Mirror(MirrorBench),
    /// N agents in network namespaces with capped links pulling one blob through
    /// the swarm vs straight from the real registry (needs root).
    Storm(crate::storm::StormBench),
    /// A 4-layer image unpacked by dray (layers in parallel) vs containerd 1.6
    /// and serial `tar -x`, and streamed from the registry into the unpacker
    /// vs download and unpack alone (needs root and containerd).
    Unpack(crate::bench_unpack::UnpackBench),
}

#[derive(Args)]
pub struct MirrorBench {
    /// Total size of the image's blobs (split over 4 layers), e.g. 256MiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    size: u64,
    /// Rounds of (direct, mirror) pulls; the median of each is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct SwarmBench {
    /// Agents pulling at once.
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Blob size, e.g. 256MiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    size: u64,
    /// Cap the registry's total egress, bytes per second (e.g. 50MiB), to model
    /// a registry that is the bottleneck; unlimited by default.
    #[arg(long, value_parser = parse_size)]
    registry_rate: Option<u64>,
    /// Also run the swarm with each agent's store filled to its high
    /// watermark (a `gc.budget` of twice the blob, 8 filler blobs) and its
    /// collector every 100 ms, so that opening the blob evicts and the
    /// collector runs during the storm; reports its times beside the run
    /// without pressure, and the ratio.
    #[arg(long)]
    gc_pressure: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The settings of a store under `--gc-pressure` for a blob of `size`.
fn pressure_gc(size: u64) -> dray_agent::gc::GcConfig {
    dray_agent::gc::GcConfig {
        budget: Some(2 * size),
        high_watermark: 0.8,
        low_watermark: 0.6,
        period: std::time::Duration::from_millis(100),
        // The fillers have no other holder: kept for the cluster, nothing
        // could be evicted.
        keep_cluster_copies: 0,
        ..Default::default()
    }
}

/// Fills the stores of `nodes` agents under `root` with 8 filler blobs
/// each, up to `gc`'s high watermark of its budget.
fn fill_stores(root: &std::path::Path, nodes: usize, gc: &dray_agent::gc::GcConfig) -> Result<()> {
    let budget = gc.budget.context("a pressure run has a budget")?;
    let each = (budget as f64 * gc.high_watermark) as u64 / 8;
    let src = root.join("filler");
    for i in 0..nodes {
        let store = ChunkStore::open(&crate::cluster::LocalCluster::node_dir(root, i))?;
        for k in 0..8 {
            write_random_seeded(&src, each, 1000 + (i * 8 + k) as u64)?;
            store.import(&src, dray_protocol::DEFAULT_CHUNK_SIZE)?;
        }
    }
    std::fs::remove_file(&src)?;
    Ok(())
}

/// One swarm run: a tracker and `nodes` agents in this process (stores
/// under `root`) pull the blob at once.
struct SwarmRun {
    /// Each agent's completion time, sorted.
    times: Vec<f64>,
    egress: u64,
    fell_back: usize,
    /// Blobs the agents' stores lost during the run (the collectors' and
    /// the opens' evictions; the time they took is in the pull times).
    evicted: usize,
}

async fn run_swarm(
    root: &std::path::Path,
    nodes: usize,
    registry: &crate::testbed::Registry,
    client: &Arc<dray_agent::registry::RegistryClient>,
    digest: dray_protocol::BlobDigest,
    gc: &dray_agent::gc::GcConfig,
) -> Result<SwarmRun> {
    let cluster = crate::cluster::LocalCluster::start(
        root,
        nodes,
        dray_agent::swarm::SwarmConfig::default(),
        gc,
    )
    .await?;
    let held_before: usize = cluster
        .agents
        .iter()
        .map(|a| a.node().store().holdings().len())
        .sum();
    let before = registry.egress();
    let start = Instant::now();
    let fell_back = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let pulls: Vec<_> = cluster
        .agents
        .iter()
        .map(|swarm| {
            let (swarm, client, fell_back) = (swarm.clone(), client.clone(), fell_back.clone());
            tokio::spawn(async move {
                let report = swarm.pull(&client, "bench/blob", digest).await?;
                if report.fell_back {
                    fell_back.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    let times = finish_times(pulls, start).await.context("swarm pulls")?;
    let egress = registry.egress() - before;
    // Every agent holds the blob now: what is missing was evicted.
    let held_after: usize = cluster
        .agents
        .iter()
        .map(|a| a.node().store().holdings().len())
        .sum();
    Ok(SwarmRun {
        times,
        egress,
        fell_back: fell_back.load(std::sync::atomic::Ordering::Relaxed),
        evicted: (held_before + nodes).saturating_sub(held_after),
    })
}

/// Parses sizes such as `1GiB`, `256MiB`, `64KiB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = [
        ("GiB", 1u64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
    .unwrap_or((s, 1));
    num.trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size such as 1GiB, 256MiB or 4096"))
}

pub async fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Peer(b) => crate::bench_peer::run(b).await,
        BenchCommand::PeerSend(s) => crate::bench_peer::send(s).await,
        BenchCommand::Swarm(b) => swarm(b).await,
        BenchCommand::Mirror(b) => mirror(b).await,
        BenchCommand::Storm(b) => crate::storm::run(b).await,
        BenchCommand::Unpack(b) => crate::bench_unpack::run(b).await,
    }
}

/// Downloads every blob in turn, as one image pull; returns the seconds taken.
async fn pull_blobs(
    client: &dray_agent::registry::RegistryClient,
    digests: &[dray_protocol::BlobDigest],
    out: &std::path::Path,
) -> Result<f64> {
    let start = Instant::now();
    for d in digests {
        client.download("bench/image", d, out).await?;
    }
    std::fs::remove_file(out)?;
    Ok(start.elapsed().as_secs_f64())
}

#[derive(Serialize)]
struct MirrorResult {
    image_bytes: u64,
    rounds: usize,
    /// Median time to pull every blob through the warm mirror.
    mirror_s: f64,
    /// Median time to pull every blob straight from the registry.
    direct_s: f64,
    /// mirror_s / direct_s: at most 1 means the warm mirror is as fast as the registry.
    ratio: f64,
}

async fn mirror(b: MirrorBench) -> Result<()> {
    use dray_agent::mirror::{Mirror, MirrorConfig};
    use dray_agent::registry::RegistryClient;
    use dray_agent::swarm::{Swarm, SwarmConfig};
    if b.size < 4 || b.rounds == 0 {
        bail!("--size must be at least 4 bytes and --rounds positive");
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let registry = crate::testbed::Registry::start(None).await;
    let mut digests = Vec::new();
    for i in 0..4 {
        let src = dir.path().join(format!("layer-{i}"));
        write_random_seeded(&src, b.size / 4, i)?;
        digests.push(
            registry
                .push("bench/image", &src)
                .parse::<dray_protocol::BlobDigest>()?,
        );
        std::fs::remove_file(&src)?;
    }
    let ca = ClusterCa::generate()?;
    let store = Arc::new(ChunkStore::open(&dir.path().join("agent"))?);
    let node = PeerNode::bind(
        ca.issue("bench-mirror")?,
        store,
        "127.0.0.1:0".parse()?,
        PeerConfig::default(),
    )?;
    let swarm = Swarm::new(node, SwarmConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let mirror_url = format!("http://{}", listener.local_addr()?);
    let config = MirrorConfig {
        listen: listener.local_addr()?,
        upstreams: [(registry.host(), registry.url())].into_iter().collect(),
        default_registry: Some(registry.host()),
        ..Default::default()
    };
    let server = tokio::spawn(Mirror::new(Pulls::new(swarm.clone()), config).serve(listener));
    let through_mirror = RegistryClient::new(&mirror_url, None)?;
    let direct = RegistryClient::new(&registry.url(), None)?;
    let out = dir.path().join("pulled");
    pull_blobs(&through_mirror, &digests, &out)
        .await
        .context("warming the mirror")?;
    let (mut mirror_times, mut direct_times) = (Vec::new(), Vec::new());
    for _ in 0..b.rounds {
        direct_times.push(
            pull_blobs(&direct, &digests, &out)
                .await
                .context("direct pull")?,
        );
        mirror_times.push(
            pull_blobs(&through_mirror, &digests, &out)
                .await
                .context("pull through the mirror")?,
        );
    }
    server.abort();
    swarm.node().close();
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (mirror_s, direct_s) = (median(&mut mirror_times), median(&mut direct_times));
    let r = MirrorResult {
        image_bytes: b.size / 4 * 4,
        rounds: b.rounds,
        mirror_s,
        direct_s,
        ratio: mirror_s / direct_s,
    };
    emit(b.json, &r, |r| {
        println!(
            "image {} bytes in 4 blobs, median of {} rounds",
            r.image_bytes, r.rounds
        );
        println!("warm mirror  {:.3} s", r.mirror_s);
        println!("registry     {:.3} s", r.direct_s);
        println!("mirror / registry = {:.2}", r.ratio);
    })
}

#[derive(Serialize)]
struct SwarmResult {
    nodes: usize,
    blob_bytes: u64,
    registry_egress_bytes: u64,
    egress_ratio: f64,
    swarm_p50_s: f64,
    swarm_last_s: f64,
    direct_egress_ratio: f64,
    direct_p50_s: f64,
    direct_last_s: f64,
    /// direct_last_s / swarm_last_s: above 1 the swarm is faster.
    speedup: f64,
    /// Agents that fell back to the registry for unclaimed chunks.
    fell_back: usize,
    /// With --registry-rate: the blob size over the registry's rate, the
    /// lower bound when the registry is the bottleneck (node links here are
    /// loopback, so CPU, not links, bounds the rest).
    registry_bound_s: Option<f64>,
    /// swarm_last_s / registry_bound_s.
    bound_ratio: Option<f64>,
    /// With --gc-pressure: the same storm with every store at its high
    /// watermark, run after the one without.
    gc_pressure: Option<GcPressureResult>,
}

#[derive(Serialize)]
struct GcPressureResult {
    swarm_p50_s: f64,
    swarm_last_s: f64,
    egress_ratio: f64,
    fell_back: usize,
    /// Filler blobs evicted, over every agent.
    evicted: usize,
    /// swarm_last_s under pressure / without: above 1 is what GC costs.
    last_ratio: f64,
    p50_ratio: f64,
}

/// Waits for every task; returns each one's completion time, sorted.
async fn finish_times(
    tasks: Vec<tokio::task::JoinHandle<Result<()>>>,
    start: Instant,
) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for t in tasks {
        t.await??;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

async fn swarm(b: SwarmBench) -> Result<()> {
    use dray_agent::registry::RegistryClient;
    if b.nodes == 0 || b.size == 0 {
        bail!("--nodes and --size must be positive");
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let registry = crate::testbed::Registry::start(None).await;
    let src = dir.path().join("blob");
    write_random(&src, b.size)?;
    let digest: dray_protocol::BlobDigest = registry.push("bench/blob", &src).parse()?;
    std::fs::remove_file(&src)?;
    if let Some(rate) = b.registry_rate {
        registry.throttle(rate);
    }
    let client = Arc::new(RegistryClient::new(&registry.url(), None)?);

    // Baseline: every node pulls the blob straight from the registry.
    let before = registry.egress();
    let start = Instant::now();
    let direct: Vec<_> = (0..b.nodes)
        .map(|i| {
            let (client, path) = (client.clone(), dir.path().join(format!("direct-{i}")));
            tokio::spawn(async move {
                client.download("bench/blob", &digest, &path).await?;
                std::fs::remove_file(&path)?;
                Ok(())
            })
        })
        .collect();
    let direct = finish_times(direct, start).await.context("direct pulls")?;
    let direct_egress = registry.egress() - before;

    // The swarm: a tracker and N agents in this process.
    let clean = run_swarm(
        &dir.path().join("swarm"),
        b.nodes,
        &registry,
        &client,
        digest,
        &dray_agent::gc::GcConfig::default(),
    )
    .await?;
    // The same with every store at its high watermark, side by side.
    let pressured = match b.gc_pressure {
        true => {
            let root = dir.path().join("swarm-gc");
            let gc = pressure_gc(b.size);
            fill_stores(&root, b.nodes, &gc)?;
            Some(run_swarm(&root, b.nodes, &registry, &client, digest, &gc).await?)
        }
        false => None,
    };
    let (times, egress) = (&clean.times, clean.egress);
    let median = |t: &[f64]| t[t.len() / 2];
    let last = |t: &[f64]| t[t.len() - 1];
    let r = SwarmResult {
        nodes: b.nodes,
        blob_bytes: b.size,
        registry_egress_bytes: egress,
        egress_ratio: egress as f64 / b.size as f64,
        swarm_p50_s: median(times),
        swarm_last_s: last(times),
        direct_egress_ratio: direct_egress as f64 / b.size as f64,
        direct_p50_s: median(&direct),
        direct_last_s: last(&direct),
        speedup: last(&direct) / last(times),
        fell_back: clean.fell_back,
        registry_bound_s: b.registry_rate.map(|rate| b.size as f64 / rate as f64),
        bound_ratio: b
            .registry_rate
            .map(|rate| last(times) / (b.size as f64 / rate as f64)),
        gc_pressure: pressured.map(|p| GcPressureResult {
            swarm_p50_s: median(&p.times),
            swarm_last_s: last(&p.times),
            egress_ratio: p.egress as f64 / b.size as f64,
            fell_back: p.fell_back,
            evicted: p.evicted,
            last_ratio: last(&p.times) / last(times),
            p50_ratio: median(&p.times) / median(times),
        }),
    };
    emit(b.json, &r, |r| {
        println!(
            "nodes {} · blob {} bytes · registry cap {}",
            r.nodes,
            r.blob_bytes,
            b.registry_rate
                .map_or("none".into(), |x| format!("{x} B/s"))
        );
        println!("            egress/blob   p50 s   last s");
        println!(
            "swarm       {:11.3} {:7.2} {:8.2}",
            r.egress_ratio, r.swarm_p50_s, r.swarm_last_s
        );
        println!(
            "direct      {:11.3} {:7.2} {:8.2}",
            r.direct_egress_ratio, r.direct_p50_s, r.direct_last_s
        );
        if let Some(g) = &r.gc_pressure {
            println!(
                "swarm, gc   {:11.3} {:7.2} {:8.2}   ({} blobs evicted)",
                g.egress_ratio, g.swarm_p50_s, g.swarm_last_s, g.evicted
            );
        }
        println!(
            "direct_last / swarm_last = {:.2}   agents that fell back: {}",
            r.speedup, r.fell_back
        );
        if let Some(g) = &r.gc_pressure {
            println!(
                "under gc pressure / without: last {:.2}, p50 {:.2}   agents that fell back: {}",
                g.last_ratio, g.p50_ratio, g.fell_back
            );
        }
    })
}

/// Prints `r` as one JSON line, or as the table `table` draws.
pub(crate) fn emit<T: Serialize>(json: bool, r: &T, table: impl FnOnce(&T)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        table(r);
    }
    Ok(())
}

/// Incompressible bytes, cheaply (xorshift), so no layer can shortcut them.
pub(crate) fn write_random(path: &std::path::Path, size: u64) -> Result<()> {
    write_random_seeded(path, size, 0)
}

/// [`write_random`] with a seed, for several distinct files.
fn write_random_seeded(path: &std::path::Path, size: u64, seed: u64) -> Result<()> {
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    std::io::copy(&mut RandomBytes::new(seed).take(size), &mut f)?;
    f.flush()?;
    Ok(())
}

/// An endless stream of incompressible bytes (xorshift64), distinct per seed.
pub(crate) struct RandomBytes(u64);

impl RandomBytes {
    pub(crate) fn new(seed: u64) -> Self {
        Self(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407))
    }
}

impl std::io::Read for RandomBytes {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        for w in buf.chunks_mut(8) {
            let x = &mut self.0;
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
        }
        Ok(buf.len())
    }
}
