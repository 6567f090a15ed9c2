//! `dray bench`: measurements that always run their baseline in the same
//! process and the same run, and report ratios, because absolute times on a
//! shared machine drift.
//!
//! Each bench is a module of this folder: [`peer`] (one blob between two
//! processes, timed and counted by [`peer_counted`]), [`unpack`] and
//! [`unpack_giant`] (the unpacker against containerd, `tar` and rapidgzip),
//! [`storm`] (an emulated cluster of `dray agent` processes), and with the
//! `hostile` feature the liars of `bench swarm --hostile`: [`hostile`] (with
//! a tracker, its withholder in [`withholder`]) and [`hostile_dht`] (without
//! one). `bench swarm` is here.

#[cfg(feature = "hostile")]
mod hostile;
#[cfg(feature = "hostile")]
mod hostile_dht;
pub(crate) mod peer;
mod peer_counted;
mod storm;
mod unpack;
mod unpack_giant;
#[cfg(feature = "hostile")]
mod withholder;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use dray_agent::identity::ClusterCa;
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
    Peer(crate::bench::peer::PeerBench),
    /// The sending process of `dray bench peer` (started by it).
    #[command(hide = true)]
    PeerSend(crate::bench::peer::PeerSend),
    /// The receiving process of `dray bench peer`'s counted runs (started by it).
    #[command(hide = true)]
    PeerRecv(crate::bench::peer::PeerRecv),
    /// N agents pulling one blob through the swarm vs N direct pulls, from the
    /// real registry (`docker-registry`) on loopback.
    Swarm(SwarmBench),
    /// An image's blobs pulled through a warm mirror vs straight from the registry.
    Mirror(MirrorBench),
    /// N agents in network namespaces with capped links pulling one blob through
    /// the swarm vs straight from the real registry (needs root).
    Storm(crate::bench::storm::StormBench),
    /// A 4-layer image unpacked by dray (layers in parallel) vs containerd 1.6
    /// and serial `tar -x`, and streamed from the registry into the unpacker
    /// vs download and unpack alone (needs root and containerd).
    Unpack(crate::bench::unpack::UnpackBench),
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
    /// Also run the storm with this many liars beside the agents (cluster
    /// members speaking the real protocol, each running one of `--attacks`
    /// in turn; with `--no-tracker`, the DHT liars of src/bench/hostile_dht.rs,
    /// and every node pulls through its mirror); reports what they cost
    /// beside the run without them. Built only with the `hostile` cargo
    /// feature.
    #[cfg(feature = "hostile")]
    #[arg(long, default_value_t = 0)]
    hostile: usize,
    /// The liars' attacks, taken in turn.
    #[cfg(feature = "hostile")]
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "flip,trickle,forge,accuse"
    )]
    attacks: Vec<crate::bench::hostile::Attack>,
    /// No tracker: the agents find each other through the DHT alone (and
    /// choose who fetches what from the registry among themselves).
    #[arg(long)]
    no_tracker: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The settings of a store under `--gc-pressure` for a blob of `size`.
fn pressure_gc(size: u64) -> dray_agent::store::gc::GcConfig {
    dray_agent::store::gc::GcConfig {
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
fn fill_stores(
    root: &std::path::Path,
    nodes: usize,
    gc: &dray_agent::store::gc::GcConfig,
) -> Result<()> {
    let budget = gc.budget.context("a pressure run has a budget")?;
    let each = (budget as f64 * gc.high_watermark) as u64 / 8;
    let src = root.join("filler");
    for i in 0..nodes {
        let store = ChunkStore::open(&dray_testkit::cluster::LocalCluster::node_dir(root, i))?;
        for k in 0..8 {
            write_random_seeded(&src, each, 1000 + (i * 8 + k) as u64)?;
            store.import(&src, dray_protocol::DEFAULT_CHUNK_SIZE)?;
        }
    }
    std::fs::remove_file(&src)?;
    Ok(())
}

/// One swarm run: a tracker and agents pulling the blob at once.
pub(crate) struct SwarmRun {
    /// Each completed agent's completion time, sorted.
    pub times: Vec<f64>,
    /// The completed pulls' reports.
    pub reports: Vec<dray_agent::pull::swarm::PullReport>,
    /// The pulls that failed, with their errors.
    pub failures: Vec<String>,
    pub egress: u64,
    /// Blobs the agents' stores lost during the run (the collectors' and
    /// the opens' evictions; the time they took is in the pull times).
    evicted: usize,
}

/// A tracker and `nodes` agents in this process (stores under `root`) pull
/// the blob at once (with `no_tracker`, agents joined in a DHT instead);
/// every pull must complete.
async fn run_swarm(
    root: &std::path::Path,
    nodes: usize,
    registry: &dray_testkit::testbed::Registry,
    client: &Arc<dray_agent::pull::registry::RegistryClient>,
    digest: dray_protocol::BlobDigest,
    gc: &dray_agent::store::gc::GcConfig,
    no_tracker: bool,
) -> Result<SwarmRun> {
    let mut swarm = dray_agent::pull::swarm::SwarmConfig::default();
    if no_tracker {
        swarm.dht.listen = Some("127.0.0.1:0".parse()?);
    }
    let cluster = dray_testkit::cluster::LocalCluster::start(root, nodes, swarm, gc).await?;
    let run = pull_all(&cluster, registry, client, digest).await?;
    if let Some(e) = run.failures.first() {
        bail!("a swarm pull failed: {e}");
    }
    Ok(run)
}

/// Every agent of `cluster` pulls the blob at once.
pub(crate) async fn pull_all(
    cluster: &dray_testkit::cluster::LocalCluster,
    registry: &dray_testkit::testbed::Registry,
    client: &Arc<dray_agent::pull::registry::RegistryClient>,
    digest: dray_protocol::BlobDigest,
) -> Result<SwarmRun> {
    let held = || -> usize {
        cluster
            .agents
            .iter()
            .map(|a| a.node().store().holdings().len())
            .sum()
    };
    let held_before = held();
    let before = registry.egress();
    let mut run = SwarmRun {
        times: Vec::new(),
        reports: Vec::new(),
        failures: Vec::new(),
        egress: 0,
        evicted: 0,
    };
    let pulls = dray_testkit::cluster::pull_each(&cluster.agents, client, "bench/blob", digest);
    for (time, outcome) in pulls.await? {
        match outcome {
            Ok(report) => {
                run.times.push(time);
                run.reports.push(report);
            }
            Err(e) => run.failures.push(format!("{e:#}")),
        }
    }
    run.egress = registry.egress() - before;
    // Every agent that completed holds the blob now: what is missing was evicted.
    run.evicted = (held_before + run.reports.len()).saturating_sub(held());
    Ok(run)
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
        BenchCommand::Peer(b) => crate::bench::peer::run(b).await,
        BenchCommand::PeerSend(s) => crate::bench::peer::send(s).await,
        BenchCommand::PeerRecv(r) => crate::bench::peer::recv(r).await,
        BenchCommand::Swarm(b) => swarm(b).await,
        BenchCommand::Mirror(b) => mirror(b).await,
        BenchCommand::Storm(b) => crate::bench::storm::run(b).await,
        BenchCommand::Unpack(b) => crate::bench::unpack::run(b).await,
    }
}

/// Downloads every blob in turn, as one image pull; returns the seconds taken.
async fn pull_blobs(
    client: &dray_agent::pull::registry::RegistryClient,
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
    use dray_agent::config::AgentConfig;
    use dray_agent::pull::registry::RegistryClient;
    use dray_agent::serving::mirror::MirrorConfig;
    use dray_agent::serving::surfaces::Surfaces;
    if b.size < 4 || b.rounds == 0 {
        bail!("--size must be at least 4 bytes and --rounds positive");
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let registry = dray_testkit::testbed::Registry::start(None).await;
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
    let agent = dray_agent::Agent::open(
        &AgentConfig {
            state_dir: dir.path().join("agent"),
            peer_listen: "127.0.0.1:0".parse()?,
            ..AgentConfig::default()
        },
        ca.issue("bench-mirror")?,
        Arc::default(),
    )?;
    let config = MirrorConfig {
        listen: "127.0.0.1:0".parse()?,
        upstreams: [(registry.host(), registry.url())].into_iter().collect(),
        default_registry: Some(registry.host()),
        ..Default::default()
    };
    let server = Surfaces::serve(agent.pulls(), config, None).await?;
    let mirror_url = server.mirror_url();
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
    agent.kill();
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
    /// How the agents found each other: "tracker", or "dht" (--no-tracker).
    discovery: &'static str,
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
    /// With --hostile: the same storm beside liars, run after the one without.
    #[cfg(feature = "hostile")]
    hostile: Option<crate::bench::hostile::HostileResult>,
    /// With --no-tracker --hostile: the storm through the mirrors beside
    /// DHT liars, and without them, run after the one above.
    #[cfg(feature = "hostile")]
    hostile_dht: Option<crate::bench::hostile_dht::DhtHostileResult>,
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

/// Waits for every task; returns each one's outcome with the time it
/// was seen done, sorted by that time.
async fn finish_times<T>(
    tasks: Vec<tokio::task::JoinHandle<Result<T>>>,
    start: Instant,
) -> Result<Vec<(f64, Result<T>)>> {
    let mut done = Vec::new();
    let mut tasks: futures_util::stream::FuturesUnordered<_> = tasks.into_iter().collect();
    while let Some(t) = futures_util::StreamExt::next(&mut tasks).await {
        done.push((start.elapsed().as_secs_f64(), t.context("a pull's task")?));
    }
    Ok(done)
}

async fn swarm(b: SwarmBench) -> Result<()> {
    use dray_agent::pull::registry::RegistryClient;
    if b.nodes == 0 || b.size == 0 {
        bail!("--nodes and --size must be positive");
    }
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let registry = dray_testkit::testbed::Registry::start(None).await;
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
    let direct = finish_times(direct, start)
        .await?
        .into_iter()
        .map(|(time, outcome)| outcome.map(|()| time))
        .collect::<Result<Vec<f64>>>()
        .context("direct pulls")?;
    let direct_egress = registry.egress() - before;

    // The swarm: a tracker and N agents in this process.
    let clean = run_swarm(
        &dir.path().join("swarm"),
        b.nodes,
        &registry,
        &client,
        digest,
        &dray_agent::store::gc::GcConfig::default(),
        b.no_tracker,
    )
    .await?;
    // The same with every store at its high watermark, side by side.
    let pressured = match b.gc_pressure {
        true => {
            let root = dir.path().join("swarm-gc");
            let gc = pressure_gc(b.size);
            fill_stores(&root, b.nodes, &gc)?;
            Some(
                run_swarm(
                    &root,
                    b.nodes,
                    &registry,
                    &client,
                    digest,
                    &gc,
                    b.no_tracker,
                )
                .await?,
            )
        }
        false => None,
    };
    #[cfg(feature = "hostile")]
    let hostile_dht = match (b.hostile, b.no_tracker) {
        (k, true) if k > 0 => Some(
            crate::bench::hostile_dht::storm(
                &dir.path().join("swarm-hostile-dht"),
                b.nodes,
                k,
                &registry,
                digest,
            )
            .await?,
        ),
        _ => None,
    };
    #[cfg(feature = "hostile")]
    let hostile = match b.hostile {
        k if k == 0 || b.no_tracker => None,
        k => Some(
            crate::bench::hostile::storm(
                &dir.path().join("swarm-hostile"),
                b.nodes,
                k,
                &b.attacks,
                &registry,
                &client,
                digest,
                &clean,
            )
            .await?,
        ),
    };
    let (times, egress) = (&clean.times, clean.egress);
    let median = |t: &[f64]| t[t.len() / 2];
    let last = |t: &[f64]| t[t.len() - 1];
    let r = SwarmResult {
        discovery: if b.no_tracker { "dht" } else { "tracker" },
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
        fell_back: clean.reports.iter().filter(|r| r.fell_back).count(),
        registry_bound_s: b.registry_rate.map(|rate| b.size as f64 / rate as f64),
        bound_ratio: b
            .registry_rate
            .map(|rate| last(times) / (b.size as f64 / rate as f64)),
        gc_pressure: pressured.map(|p| GcPressureResult {
            swarm_p50_s: median(&p.times),
            swarm_last_s: last(&p.times),
            egress_ratio: p.egress as f64 / b.size as f64,
            fell_back: p.reports.iter().filter(|r| r.fell_back).count(),
            evicted: p.evicted,
            last_ratio: last(&p.times) / last(times),
            p50_ratio: median(&p.times) / median(times),
        }),
        #[cfg(feature = "hostile")]
        hostile,
        #[cfg(feature = "hostile")]
        hostile_dht,
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
        #[cfg(feature = "hostile")]
        if let Some(h) = &r.hostile {
            crate::bench::hostile::print(h);
        }
        #[cfg(feature = "hostile")]
        if let Some(h) = &r.hostile_dht {
            crate::bench::hostile_dht::print(h);
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
pub(crate) fn write_random_seeded(path: &std::path::Path, size: u64, seed: u64) -> Result<()> {
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
