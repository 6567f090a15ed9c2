//! `dray bench storm`: a scale-out storm on an emulated cluster on this machine.
//!
//! The registry (`docker-registry`), the tracker and N agents (this very `dray`
//! binary) each run in their own network namespace, joined by one bridge in a
//! namespace of its own (the switch), with every link capped by `tbf`, so the
//! swarm is measured against links rather than against loopback and the CPU.
//! Every node pulls one blob through the swarm at once; then, in the same run,
//! every node downloads it straight from the registry (the baseline). Registry egress is read from the kernel's counters
//! on the registry's link (what its end sent), never from the agents' own
//! reports. Needs root.
//!
//! Everything it creates is named `dray-…` on 10.77.0.0/24 and is removed when
//! the run ends, fails or is interrupted (and at the start of the next run, if a
//! previous one was killed outright).

use crate::bench::{emit, parse_size, write_random};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::Serialize;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

const PREFIX: &str = "dray-";
const BRIDGE: &str = "dray-br0";
/// The namespace of the bridge and of every link's switch-side end.
const SWITCH_NS: &str = "dray-sw";
const REGISTRY_NS: &str = "dray-reg";
const TRACKER_NS: &str = "dray-trk";
const REGISTRY_ADDR: &str = "10.77.0.2:5000";
const TRACKER_ADDR: &str = "10.77.0.3:7880";
const REPO: &str = "bench/blob";
/// Node i is 10.77.0.(10 + i); the last host address is .254.
const MAX_NODES: usize = 244;
/// Longest one phase (swarm or direct) may take before the bench gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(600);
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Simulator runs behind one prediction (a few milliseconds each at 16 nodes).
const PREDICTION_SEEDS: u64 = 9;

#[derive(Args)]
pub struct StormBench {
    /// Node namespaces, one agent each (at most 244).
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// Blob size, e.g. 256MiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    size: u64,
    /// Each node's link rate, each direction, Mbit/s.
    #[arg(long, default_value_t = 100)]
    node_mbit: u64,
    /// The registry's link rate, each direction, Mbit/s.
    #[arg(long, default_value_t = 200)]
    registry_mbit: u64,
    /// Every link's MTU, bytes: 1500 is plain Ethernet; 9000 (jumbo frames,
    /// common inside data centres) moves the same bytes in a sixth of the
    /// packets, and per-packet work is what saturates this machine's CPU
    /// when it emulates many nodes.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u16).range(1280..=9000))]
    mtu: u16,
    /// Each agent's upload cap, in percent of its link rate (0: uncapped).
    /// Just under 100 keeps the link's queue short, so the acknowledgements of
    /// the node's own downloads are not stuck behind its uploads.
    #[arg(long, default_value_t = 90)]
    upload_percent: u64,
    /// Chunks each agent serves at once (`peer.max_uploads`).
    #[arg(long, default_value_t = dray_agent::peer::PeerConfig::default().max_uploads)]
    max_uploads: usize,
    /// Chunk requests each agent keeps in flight at once (`peer.max_downloads`).
    #[arg(long, default_value_t = dray_agent::peer::PeerConfig::default().max_downloads)]
    max_downloads: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Write a chart (completion CDF, registry egress over time) as SVG here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Keep the cluster's files (configs, every agent's and service's log)
    /// in a new directory under this one, instead of removing them at the end.
    #[arg(long)]
    keep_dir: Option<PathBuf>,
}

#[derive(Serialize)]
struct StormResult {
    nodes: usize,
    image_bytes: u64,
    node_mbit: u64,
    registry_mbit: u64,
    /// T* = max(F/u_s, F/d_min, N·F/(u_s + Σu_i)) at the configured link rates.
    lower_bound_s: f64,
    swarm_p50_s: f64,
    swarm_last_s: f64,
    direct_p50_s: f64,
    direct_last_s: f64,
    /// Registry egress during the swarm run (wire bytes: frames with their
    /// headers) over the image size.
    egress_ratio: f64,
    direct_egress_ratio: f64,
    /// Swarm egress over one direct download's share of the direct egress:
    /// copies of the blob the registry sent, with header overhead cancelled.
    registry_copies: f64,
    /// swarm_last_s / lower_bound_s.
    bound_ratio: f64,
    /// direct_last_s / lower_bound_s.
    direct_bound_ratio: f64,
    /// Agents whose pull fell back to the registry for unclaimed chunks.
    fell_back: usize,
    /// Peers the agents dropped as too slow or silent (their pull reports'
    /// `slow_peers`, summed): in a storm of honest nodes, each is a false
    /// alarm, reported to the tracker, whose chunks may then leave the
    /// registry again.
    peers_dropped: usize,
    /// Chunk requests the agents waited for past their deadline, half there
    /// by it, and got (summed): each a busy honest peer the deadline alone
    /// would have dropped.
    requests_extended: u64,
    /// Chunks the agents fetched from the registry, summed, against
    /// `chunks`, the blob's: what registry egress counts in bytes, counted.
    registry_chunks: u64,
    chunks: u64,
    /// The simulator's p50 and last-node times for this very cluster
    /// (`Scenario::emulated`; medians over seeds), to check the model
    /// against the emulation.
    predicted_p50_s: f64,
    predicted_last_s: f64,
    /// Share of this machine's CPU time the hypervisor gave to others during
    /// the swarm run (`steal` in `/proc/stat`): the simulator models links,
    /// not CPU, and on a contended host the agents run late.
    swarm_cpu_steal: f64,
    /// Each node's completion time, seconds from the launch, sorted.
    swarm_times_s: Vec<f64>,
    direct_times_s: Vec<f64>,
}

/// One phase's outcome: sorted completion times and the registry's egress.
struct Phase {
    times: Vec<f64>,
    egress_bytes: u64,
    /// (seconds from the launch, registry egress bytes so far), every 250 ms.
    egress_series: Vec<(f64, u64)>,
    /// Share of the machine's CPU time stolen by the hypervisor meanwhile.
    cpu_steal: f64,
}

pub async fn run(b: StormBench) -> Result<()> {
    if b.nodes == 0 || b.nodes > MAX_NODES || b.size == 0 {
        bail!("--nodes must be 1 to {MAX_NODES} and --size positive");
    }
    if b.node_mbit == 0 || b.registry_mbit == 0 {
        bail!("--node-mbit and --registry-mbit must be positive");
    }
    if b.max_uploads == 0 {
        bail!("--max-uploads must be positive: an agent that serves nothing cannot swarm");
    }
    if b.upload_percent > 100 {
        bail!(
            "--upload-percent {} is above 100: an agent cannot upload faster than its link",
            b.upload_percent
        );
    }
    let exe = std::env::current_exe().context("finding the dray binary")?;
    let mut cluster = Cluster {
        dir: match &b.keep_dir {
            Some(parent) => {
                let kept = tempfile::Builder::new()
                    .prefix("dray-storm-")
                    .disable_cleanup(true)
                    .tempdir_in(parent)
                    .with_context(|| format!("creating a directory in {}", parent.display()))?;
                eprintln!("keeping the cluster's files in {}", kept.path().display());
                kept
            }
            None => tempfile::tempdir().context("creating a temporary directory")?,
        },
        services: Vec::new(),
        agents: Vec::new(),
    };
    let outcome = tokio::select! {
        r = storm(&b, &exe, &mut cluster) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    drop(cluster);
    let (r, swarm, direct) = outcome?;
    if let Some(path) = &b.svg {
        std::fs::write(path, svg(&r, &swarm, &direct))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    emit(b.json, &r, |r| {
        println!(
            "{} nodes at {} Mbit/s · registry at {} Mbit/s · blob {} bytes · lower bound {:.2} s",
            r.nodes, r.node_mbit, r.registry_mbit, r.image_bytes, r.lower_bound_s
        );
        println!("          p50 s   last s   last/bound   egress/blob");
        println!(
            "swarm  {:8.2} {:8.2} {:12.2} {:13.3}",
            r.swarm_p50_s, r.swarm_last_s, r.bound_ratio, r.egress_ratio
        );
        println!(
            "direct {:8.2} {:8.2} {:12.2} {:13.3}",
            r.direct_p50_s, r.direct_last_s, r.direct_bound_ratio, r.direct_egress_ratio
        );
        println!(
            "sim    {:8.2} {:8.2} {:12.2}    (the simulator's prediction of the swarm row)",
            r.predicted_p50_s,
            r.predicted_last_s,
            r.predicted_last_s / r.lower_bound_s
        );
        println!(
            "registry copies in the swarm (headers cancelled): {:.3} · chunks from the registry: {} of {} · agents that fell back: {} · peers dropped as too slow: {} · requests waited for past their deadline: {}",
            r.registry_copies,
            r.registry_chunks,
            r.chunks,
            r.fell_back,
            r.peers_dropped,
            r.requests_extended
        );
        println!(
            "CPU time stolen by the hypervisor during the swarm run: {:.1}%",
            100.0 * r.swarm_cpu_steal
        );
    })
}

async fn storm(
    b: &StormBench,
    exe: &Path,
    cluster: &mut Cluster,
) -> Result<(StormResult, Phase, Phase)> {
    cluster
        .build(b.nodes, b.node_mbit, b.registry_mbit, b.mtu)
        .await?;
    let dir = cluster.dir.path().to_path_buf();

    // The registry, holding one random blob, pushed over its own namespace's
    // loopback path so the capped link is untouched.
    let data = dir.join("registry");
    let cfg = dir.join("registry.yml");
    std::fs::write(
        &cfg,
        format!(
            "version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {}}}, delete: {{enabled: true}}}}\nhttp: {{addr: \"{REGISTRY_ADDR}\", secret: test}}\n",
            data.display()
        ),
    )
    .with_context(|| format!("writing {}", cfg.display()))?;
    let registry = spawn_in(
        REGISTRY_NS,
        "docker-registry".as_ref(),
        &["serve".as_ref(), cfg.as_os_str()],
        &dir.join("registry.log"),
    )?;
    let egress = Egress::of(&registry)?;
    cluster.services.push(registry);
    wait_listening(REGISTRY_ADDR, "docker-registry").await?;
    let blob = dir.join("blob");
    write_random(&blob, b.size).context("writing the random blob")?;
    let digest = dray_testkit::testbed::file_digest(&blob);
    push(&blob, &digest).await?;
    std::fs::remove_file(&blob)?;

    // The cluster CA, the tracker's certificate, and a certificate and config per node.
    let ca = dir.join("ca");
    run_cmd(
        exe.as_os_str(),
        &[
            "ca".as_ref(),
            "init".as_ref(),
            "--dir".as_ref(),
            ca.as_os_str(),
        ],
    )
    .await?;
    let tracker_tls = dir.join("tracker-tls");
    let tracker_ip = TRACKER_ADDR.split(':').next().unwrap_or(TRACKER_ADDR);
    run_cmd(
        exe.as_os_str(),
        &[
            "ca".as_ref(),
            "issue".as_ref(),
            "--ca-dir".as_ref(),
            ca.as_os_str(),
            "--tracker".as_ref(),
            "--name".as_ref(),
            "dray-tracker".as_ref(),
            "--name".as_ref(),
            tracker_ip.as_ref(),
            "--out".as_ref(),
            tracker_tls.as_os_str(),
        ],
    )
    .await?;
    let tracker = spawn_in(
        TRACKER_NS,
        exe.as_os_str(),
        &[
            "tracker".as_ref(),
            "--listen".as_ref(),
            TRACKER_ADDR.as_ref(),
            "--cert".as_ref(),
            tracker_tls.join("tracker.crt").as_os_str(),
            "--key".as_ref(),
            tracker_tls.join("tracker.key").as_os_str(),
            "--ca".as_ref(),
            tracker_tls.join("ca.crt").as_os_str(),
        ],
        &dir.join("tracker.log"),
    )?;
    cluster.services.push(tracker);
    wait_listening(TRACKER_ADDR, "dray tracker").await?;

    for i in 0..b.nodes {
        let node = dir.join(format!("node-{i}"));
        run_cmd(
            exe.as_os_str(),
            &[
                "ca".as_ref(),
                "issue".as_ref(),
                "--ca-dir".as_ref(),
                ca.as_os_str(),
                "--peer-id".as_ref(),
                format!("node-{i}").as_ref(),
                "--out".as_ref(),
                node.as_os_str(),
            ],
        )
        .await?;
        let path = |f: &str| format!("{:?}", node.join(f).display().to_string());
        let upload_cap = b.node_mbit * 1_000_000 / 8 * b.upload_percent / 100;
        std::fs::write(
            node.join("node.toml"),
            format!(
                "state_dir = {}\npeer_listen = \"{}:7881\"\ncert = {}\nkey = {}\nca = {}\n\n[peer]\nupload_bytes_per_s = {upload_cap}\nmax_uploads = {}\nmax_downloads = {}\n\n[mirror]\nlisten = \"127.0.0.1:0\"\n\n[swarm]\ntrackers = [\"https://{TRACKER_ADDR}\"]\n",
                path("state"),
                node_ip(i),
                path("agent.crt"),
                path("agent.key"),
                path("ca.crt"),
                b.max_uploads,
                b.max_downloads,
            ),
        )
        .with_context(|| format!("writing {}/node.toml", node.display()))?;
    }

    let (swarm, counts) = swarm_phase(b.nodes, exe, &dir, &digest, &egress, cluster).await?;
    let direct = direct_phase(b.nodes, b.size, &digest, &egress).await?;

    let bits = b.size as f64 * 8.0;
    let (u_s, u) = (b.registry_mbit as f64 * 1e6, b.node_mbit as f64 * 1e6);
    let n = b.nodes as f64;
    let lower_bound_s = (bits / u_s).max(bits / u).max(n * bits / (u_s + n * u));
    let last = |t: &[f64]| t[t.len() - 1];
    let (predicted_p50_s, predicted_last_s) = predict(b)?;
    let r = StormResult {
        nodes: b.nodes,
        image_bytes: b.size,
        node_mbit: b.node_mbit,
        registry_mbit: b.registry_mbit,
        lower_bound_s,
        swarm_p50_s: median(&swarm.times),
        swarm_last_s: last(&swarm.times),
        direct_p50_s: median(&direct.times),
        direct_last_s: last(&direct.times),
        egress_ratio: swarm.egress_bytes as f64 / b.size as f64,
        direct_egress_ratio: direct.egress_bytes as f64 / b.size as f64,
        registry_copies: swarm.egress_bytes as f64 / (direct.egress_bytes as f64 / n),
        bound_ratio: last(&swarm.times) / lower_bound_s,
        direct_bound_ratio: last(&direct.times) / lower_bound_s,
        fell_back: counts.fell_back,
        peers_dropped: counts.peers_dropped,
        requests_extended: counts.requests_extended,
        registry_chunks: counts.registry_chunks,
        chunks: counts.chunks,
        predicted_p50_s,
        predicted_last_s,
        swarm_cpu_steal: swarm.cpu_steal,
        swarm_times_s: swarm.times.clone(),
        direct_times_s: direct.times.clone(),
    };
    Ok((r, swarm, direct))
}

/// The simulator's p50 and last-node times for the emulated cluster: flows
/// share its links unevenly at random, so each is the median over
/// [`PREDICTION_SEEDS`] seeds.
fn predict(b: &StormBench) -> Result<(f64, f64)> {
    let scenario = dray_simulations::Scenario::emulated(&dray_simulations::Emulated {
        nodes: b.nodes as u32,
        image_bytes: b.size,
        node_mbit: b.node_mbit,
        registry_mbit: b.registry_mbit,
        upload_percent: b.upload_percent,
        max_uploads: b.max_uploads as u32,
        max_downloads: b.max_downloads as u32,
        mtu: b.mtu,
    });
    let (mut p50, mut last) = (Vec::new(), Vec::new());
    for seed in 1..=PREDICTION_SEEDS {
        let r = dray_simulations::run(&scenario, dray_simulations::Strategy::Dray, seed)
            .context("simulating the emulated cluster")?;
        p50.push(r.p50_s);
        last.push(r.max_s);
    }
    p50.sort_by(f64::total_cmp);
    last.sort_by(f64::total_cmp);
    Ok((median(&p50), median(&last)))
}

/// The middle value (the upper one of an even count) of sorted times.
fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

/// What the agents' pull reports of one swarm run add up to.
#[derive(Default)]
struct PullCounts {
    fell_back: usize,
    peers_dropped: usize,
    requests_extended: u64,
    registry_chunks: u64,
    /// The blob's chunks, as every report counts them.
    chunks: u64,
}

impl PullCounts {
    /// Adds one agent's pull report (`dray blob pull`'s JSON line).
    fn add(&mut self, report: &serde_json::Value) {
        let count = |key: &str| report[key].as_u64().unwrap_or(0);
        self.fell_back += usize::from(report["fell_back"].as_bool() == Some(true));
        self.peers_dropped += report["slow_peers"].as_array().map_or(0, Vec::len);
        self.requests_extended += count("extended_requests");
        self.registry_chunks += count("chunks_from_registry");
        self.chunks = self.chunks.max(
            count("chunks_from_registry") + count("chunks_from_peers") + count("resumed_chunks"),
        );
    }
}

/// Every node pulls the blob through the swarm at once; returns the phase and
/// what the agents' pull reports add up to. The agents keep serving until
/// the last one is done, then they are stopped.
async fn swarm_phase(
    nodes: usize,
    exe: &Path,
    dir: &Path,
    digest: &str,
    egress: &Egress,
    cluster: &mut Cluster,
) -> Result<(Phase, PullCounts)> {
    let counts = Arc::new(Mutex::new(PullCounts::default()));
    let registry_url = format!("http://{REGISTRY_ADDR}");
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let egress0 = egress.sent()?;
    for i in 0..nodes {
        let node = dir.join(format!("node-{i}"));
        let config = node.join("node.toml");
        let log = node.join("agent.log");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &node_ns(i)])
            .arg(exe)
            .args(["blob", "pull", "-c"])
            .arg(&config)
            .args([
                "--registry",
                &registry_url,
                "--repo",
                REPO,
                "--digest",
                digest,
                "--serve",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file(&log)?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting `dray blob pull` in {}", node_ns(i)))?;
        let stdout = child.stdout.take().context("agent stdout")?;
        cluster.agents.push(child);
        let counts = counts.clone();
        tasks.spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            while let Some(line) = lines.next_line().await? {
                let Ok(report) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if report.get("seconds").is_some() {
                    counts
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .add(&report);
                    return Ok(start.elapsed().as_secs_f64());
                }
            }
            bail!(
                "`dray blob pull` in {} ended without a pull report: {}",
                node_ns(i),
                log_tail(&log)
            )
        });
    }
    let phase = await_phase(tasks, start, egress, egress0)
        .await
        .context("swarm run")?;
    cluster.stop_agents().await;
    let counts = std::mem::take(&mut *counts.lock().unwrap_or_else(|e| e.into_inner()));
    Ok((phase, counts))
}

/// The baseline: every node downloads the blob straight from the registry at once.
async fn direct_phase(nodes: usize, size: u64, digest: &str, egress: &Egress) -> Result<Phase> {
    let url = format!("http://{REGISTRY_ADDR}/v2/{REPO}/blobs/{digest}");
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let egress0 = egress.sent()?;
    for i in 0..nodes {
        let child = Command::new("ip")
            .args(["netns", "exec", &node_ns(i)])
            .args([
                "curl",
                "-sfS",
                "-o",
                "/dev/null",
                "-w",
                "%{size_download}",
                &url,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting curl in {}", node_ns(i)))?;
        tasks.spawn(async move {
            let out = child.wait_with_output().await?;
            let got = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() || got.trim() != size.to_string() {
                bail!(
                    "curl in {} failed ({}, {} bytes): {}",
                    node_ns(i),
                    out.status,
                    got.trim(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(start.elapsed().as_secs_f64())
        });
    }
    await_phase(tasks, start, egress, egress0)
        .await
        .context("direct run")
}

/// Waits for every node's task (each returns its completion time), sampling
/// the registry's egress every 250 ms, for at most [`PHASE_TIMEOUT`].
async fn await_phase(
    mut tasks: JoinSet<Result<f64>>,
    start: Instant,
    egress: &Egress,
    egress0: u64,
) -> Result<Phase> {
    let deadline = tokio::time::Instant::from_std(start + PHASE_TIMEOUT);
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let mut times = Vec::new();
    let mut egress_series = Vec::new();
    let cpu0 = CpuTimes::now()?;
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(t) => times.push(t??),
                None => break,
            },
            _ = tick.tick() => {
                egress_series.push((start.elapsed().as_secs_f64(), egress.sent()? - egress0));
            }
            _ = tokio::time::sleep_until(deadline) => {
                bail!("{} of {} nodes unfinished after {PHASE_TIMEOUT:?}", tasks.len(), tasks.len() + times.len());
            }
        }
    }
    let egress_bytes = egress.sent()? - egress0;
    egress_series.push((start.elapsed().as_secs_f64(), egress_bytes));
    times.sort_by(f64::total_cmp);
    Ok(Phase {
        times,
        egress_bytes,
        egress_series,
        cpu_steal: CpuTimes::now()?.steal_since(&cpu0),
    })
}

/// The machine's CPU time so far, in ticks: all of it, and what the
/// hypervisor stole (the first line of `/proc/stat`).
struct CpuTimes {
    total: u64,
    steal: u64,
}

impl CpuTimes {
    fn now() -> Result<Self> {
        let text = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        cpu_times(&text).with_context(|| format!("no cpu line in /proc/stat: {text:?}"))
    }

    /// The stolen share of the CPU time since `before` (0 when none passed).
    fn steal_since(&self, before: &Self) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(before.steal) as f64 / total as f64
    }
}

/// The `cpu` line of a `/proc/stat` table: user, nice, system, idle, iowait,
/// irq, softirq, steal (guest time is already counted in user).
fn cpu_times(table: &str) -> Option<CpuTimes> {
    let line = table.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    (ticks.len() == 8).then(|| CpuTimes {
        total: ticks.iter().sum(),
        steal: ticks[7],
    })
}

/// The registry's side of its link: the interface counters of its namespace,
/// read through a process that lives there (`/proc/<pid>/net/dev`).
struct Egress(PathBuf);

impl Egress {
    fn of(registry: &Child) -> Result<Self> {
        let pid = registry.id().context("the registry exited at once")?;
        Ok(Self(PathBuf::from(format!("/proc/{pid}/net/dev"))))
    }

    /// Bytes the registry has sent over its link (its `eth0`'s transmit bytes).
    fn sent(&self) -> Result<u64> {
        let path = self.0.display();
        let text = std::fs::read_to_string(&self.0).with_context(|| format!("reading {path}"))?;
        transmit_bytes(&text, "eth0")
            .with_context(|| format!("no eth0 counters in {path}: {text:?}"))
    }
}

/// The transmit byte count of `dev` in a `/proc/net/dev` table (the ninth
/// number after the name: eight receive columns come first).
fn transmit_bytes(table: &str, dev: &str) -> Option<u64> {
    table.lines().find_map(|line| {
        let (name, counters) = line.split_once(':')?;
        (name.trim() == dev).then(|| counters.split_whitespace().nth(8)?.parse().ok())?
    })
}

fn node_ns(i: usize) -> String {
    format!("dray-n{i}")
}

fn node_ip(i: usize) -> String {
    format!("10.77.0.{}", 10 + i)
}

/// The namespaces, links and processes of one run. Dropping it removes them
/// all, however the run ends.
struct Cluster {
    dir: tempfile::TempDir,
    /// The registry and the tracker.
    services: Vec<Child>,
    agents: Vec<Child>,
}

impl Cluster {
    /// Removes what an interrupted run left, then creates the bridge and one
    /// namespace per registry, tracker and node, with capped links.
    async fn build(
        &mut self,
        nodes: usize,
        node_mbit: u64,
        registry_mbit: u64,
        mtu: u16,
    ) -> Result<()> {
        let mtu_bytes = u32::from(mtu);
        let mtu = mtu.to_string();
        remove_leftovers();
        // The switch gets a namespace of its own so that bridged frames skip
        // iptables: where br_netfilter is loaded, the host's namespace sends
        // every bridged frame through it (a bridge's own nf_call_iptables
        // option cannot turn that off), CPU this machine needs for the agents.
        run_ip(&["netns", "add", SWITCH_NS]).await?;
        run_cmd(
            "ip".as_ref(),
            &os(&[
                "netns",
                "exec",
                SWITCH_NS,
                "sh",
                "-c",
                "for f in /proc/sys/net/bridge/bridge-nf-call-*; do [ ! -e \"$f\" ] || echo 0 > \"$f\"; done",
            ]),
        )
        .await?;
        run_ip(&["-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge"]).await?;
        run_ip(&["-n", SWITCH_NS, "link", "set", BRIDGE, "up"]).await?;
        let mut hosts = vec![
            (
                REGISTRY_NS.to_string(),
                "dray-v-reg".to_string(),
                "10.77.0.2".to_string(),
                Some(registry_mbit),
            ),
            (
                TRACKER_NS.to_string(),
                "dray-v-trk".to_string(),
                "10.77.0.3".to_string(),
                None,
            ),
        ];
        hosts.extend((0..nodes).map(|i| {
            (
                node_ns(i),
                format!("dray-v-n{i}"),
                node_ip(i),
                Some(node_mbit),
            )
        }));
        for (ns, veth, ip, mbit) in &hosts {
            run_ip(&["netns", "add", ns]).await?;
            run_ip(&[
                "-n", SWITCH_NS, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ])
            .await?;
            run_ip(&[
                "-n", SWITCH_NS, "link", "set", veth, "mtu", &mtu, "master", BRIDGE, "up",
            ])
            .await?;
            run_ip(&["-n", ns, "link", "set", "eth0", "mtu", &mtu]).await?;
            run_ip(&["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"]).await?;
            run_ip(&["-n", ns, "link", "set", "eth0", "up"]).await?;
            run_ip(&["-n", ns, "link", "set", "lo", "up"]).await?;
            if let Some(mbit) = mbit {
                let rate = format!("{mbit}mbit");
                // 10 ms of the rate, and at least two frames (a bucket
                // smaller than a frame never lets it through). With two
                // frames alone, a link lost the tokens of every moment its
                // vCPU was descheduled (`docs/results.md`, "The emulated
                // links and the host's steal").
                let burst = (*mbit * 1_250).max(u64::from(2 * mtu_bytes)).to_string();
                let tbf = [
                    "root", "tbf", "rate", &rate, "burst", &burst, "latency", "50ms",
                ];
                // Egress from the namespace, and into it (the switch side's egress).
                let mut out = vec!["-n", ns, "qdisc", "add", "dev", "eth0"];
                out.extend(tbf);
                run_cmd("tc".as_ref(), &os(&out)).await?;
                let mut into = vec!["-n", SWITCH_NS, "qdisc", "add", "dev", veth];
                into.extend(tbf);
                run_cmd("tc".as_ref(), &os(&into)).await?;
            }
        }
        Ok(())
    }

    /// Kills every agent and waits for it to exit.
    async fn stop_agents(&mut self) {
        for mut a in self.agents.drain(..) {
            let _ = a.kill().await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let children = self.agents.iter_mut().chain(self.services.iter_mut());
        for c in children {
            let _ = c.start_kill();
            for _ in 0..200 {
                if !matches!(c.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        remove_leftovers();
    }
}

/// Kills the processes left in `dray-` namespaces and deletes those namespaces:
/// every link goes with them (the switch's holds the bridge and one end of
/// each link; deleting a veth end deletes its pair).
fn remove_leftovers() {
    remove_namespaces(PREFIX);
}

/// Kills the processes in the network namespaces whose names start with
/// `prefix` and deletes those namespaces, with the links in them.
pub(crate) fn remove_namespaces(prefix: &str) {
    let output = |args: &[&str]| {
        std::process::Command::new(args[0])
            .args(&args[1..])
            .stderr(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let namespaces = output(&["ip", "netns", "list"]);
    for ns in namespaces
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
    {
        let pids = output(&["ip", "netns", "pids", ns]);
        let pids: Vec<&str> = pids.split_whitespace().collect();
        if !pids.is_empty() {
            let mut kill = vec!["kill", "-9"];
            kill.extend(pids);
            output(&kill);
        }
        output(&["ip", "netns", "del", ns]);
    }
}

pub(crate) async fn run_ip(args: &[&str]) -> Result<String> {
    run_cmd("ip".as_ref(), &os(args)).await
}

fn os<'a>(args: &[&'a str]) -> Vec<&'a OsStr> {
    args.iter().map(|a| OsStr::new(*a)).collect()
}

/// Runs a command to completion and returns its stdout; the error names the command.
async fn run_cmd(program: &OsStr, args: &[&OsStr]) -> Result<String> {
    let shown = || {
        std::iter::once(program)
            .chain(args.iter().copied())
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running `{}`", shown()))?;
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            shown(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Starts a long-running process inside a namespace, its output going to `log`.
fn spawn_in(ns: &str, program: &OsStr, args: &[&OsStr], log: &Path) -> Result<Child> {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log_file(log)?)
        .stderr(log_file(log)?)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting `{}` in {ns}", program.to_string_lossy()))
}

fn log_file(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

/// The last lines of a log, for an error message.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Waits up to 5 s for something to accept TCP connections at `addr`.
async fn wait_listening(addr: &str, what: &str) -> Result<()> {
    let addr: SocketAddr = addr.parse()?;
    for _ in 0..100 {
        let attempt = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await;
        if matches!(attempt, Ok(Ok(_))) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} is not listening on {addr} after 5 s")
}

/// Uploads the blob with curl from inside the registry's namespace.
async fn push(blob: &Path, digest: &str) -> Result<()> {
    let base = format!("http://{REGISTRY_ADDR}");
    let in_registry = |curl: &[&str]| {
        let mut args = vec!["netns", "exec", REGISTRY_NS, "curl"];
        args.extend(curl);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let start = in_registry(&[
        "-sfS",
        "-X",
        "POST",
        "-D",
        "-",
        "-o",
        "/dev/null",
        &format!("{base}/v2/{REPO}/blobs/uploads/"),
    ]);
    let headers = run_ip(&start.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    let put_url = dray_testkit::testbed::upload_url(&base, &headers, digest)
        .context("the registry's upload answer has no Location header")?;
    let put = in_registry(&[
        "-sfS",
        "-X",
        "PUT",
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        &format!("@{}", blob.display()),
        &put_url,
    ]);
    run_ip(&put.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    Ok(())
}

/// Two panels: nodes done over time (swarm vs direct, with the lower bound)
/// and the registry's egress rate over time (with its link rate).
fn svg(r: &StormResult, swarm: &Phase, direct: &Phase) -> String {
    const SWARM: &str = "#1f77b4";
    const DIRECT: &str = "#d62728";
    let t_max = r.direct_last_s.max(r.swarm_last_s) * 1.05;
    let cdf = |times: &[f64]| {
        let n = times.len() as f64;
        let mut pts = vec![(0.0, 0.0)];
        for (k, &t) in times.iter().enumerate() {
            pts.push((t, k as f64 / n));
            pts.push((t, (k + 1) as f64 / n));
        }
        pts
    };
    let rate = |p: &Phase| {
        p.egress_series
            .windows(2)
            .filter(|w| w[1].0 > w[0].0)
            .map(|w| {
                (
                    w[1].0,
                    (w[1].1 - w[0].1) as f64 * 8.0 / (w[1].0 - w[0].0) / 1e6,
                )
            })
            .collect::<Vec<_>>()
    };
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif" font-size="12">"#,
        2.0 * W
    );
    panel(
        &mut out,
        &Panel {
            x0: 0.0,
            title: &format!("{} nodes: nodes done (CDF)", r.nodes),
            y_label: "fraction of nodes",
            x_max: t_max,
            y_max: 1.0,
            guide: [(r.lower_bound_s, 0.0), (r.lower_bound_s, 1.0)],
        },
        &[
            (SWARM, "swarm", cdf(&swarm.times)),
            (DIRECT, "direct", cdf(&direct.times)),
        ],
    );
    let cap = r.registry_mbit as f64;
    panel(
        &mut out,
        &Panel {
            x0: W,
            title: "registry egress",
            y_label: "Mbit/s",
            x_max: t_max,
            y_max: cap * 1.25,
            guide: [(0.0, cap), (t_max, cap)],
        },
        &[
            (SWARM, "swarm", rate(swarm)),
            (DIRECT, "direct", rate(direct)),
        ],
    );
    out.push_str("</svg>\n");
    out
}

const W: f64 = 480.0;
const H: f64 = 320.0;

struct Panel<'a> {
    x0: f64,
    title: &'a str,
    y_label: &'a str,
    x_max: f64,
    y_max: f64,
    /// A dashed reference line, in data coordinates.
    guide: [(f64, f64); 2],
}

/// A series to draw: colour, legend, points in data coordinates.
type Line<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

fn panel(out: &mut String, p: &Panel, lines: &[Line]) {
    let (left, right, top, bottom) = (p.x0 + 60.0, p.x0 + W - 15.0, 30.0, H - 45.0);
    let sx = |x: f64| left + x / p.x_max * (right - left);
    let sy = |y: f64| bottom - y.min(p.y_max) / p.y_max * (bottom - top);
    let _ = write!(
        out,
        r#"<text x="{left}" y="18" font-weight="bold">{}</text><rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        p.title,
        right - left,
        bottom - top
    );
    for k in 0..=4 {
        let (x, y) = (p.x_max * k as f64 / 4.0, p.y_max * k as f64 / 4.0);
        let _ = write!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{x:.0}</text><text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            sx(x),
            bottom + 15.0,
            left - 4.0,
            sy(y) + 4.0,
            if p.y_max <= 1.0 {
                format!("{y:.2}")
            } else {
                format!("{y:.0}")
            }
        );
    }
    let _ = write!(
        out,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">seconds from launch</text><text transform="translate({},{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (left + right) / 2.0,
        bottom + 32.0,
        p.x0 + 14.0,
        (top + bottom) / 2.0,
        p.y_label
    );
    let [(gx0, gy0), (gx1, gy1)] = p.guide;
    let _ = write!(
        out,
        r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="gray" stroke-dasharray="4 3"/>"#,
        sx(gx0),
        sy(gy0),
        sx(gx1),
        sy(gy1)
    );
    for (k, (color, name, pts)) in lines.iter().enumerate() {
        let points: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/><text x="{}" y="{}" fill="{color}">{name}</text>"#,
            points.join(" "),
            right - 60.0,
            top + 18.0 + 15.0 * k as f64
        );
    }
}

#[cfg(test)]
mod tests {
    /// The simulator's model of `dray bench storm` is the agent as shipped:
    /// a default changed on one side only fails here.
    #[test]
    fn the_simulated_storm_runs_the_agents_defaults() {
        let agent = dray_agent::config::AgentConfig::default();
        let sim = dray_simulations::Scenario::emulated(&Default::default());
        assert_eq!(
            sim.announce_interval_s,
            agent.swarm.pull_announce.as_secs_f64()
        );
        assert_eq!(sim.stall_s, agent.swarm.stall.as_secs_f64());
        assert_eq!(sim.tracker_grace_s, agent.swarm.tracker_grace.as_secs_f64());
        assert_eq!(sim.registry_parallel, agent.swarm.registry_parallel);
        assert_eq!(sim.max_uploads as usize, agent.peer.max_uploads);
        assert_eq!(sim.max_downloads as usize, agent.peer.max_downloads);
        assert_eq!(sim.max_peers_per_blob, agent.peer.max_peers_per_blob);
        assert_eq!(sim.max_watchers_per_blob, agent.peer.max_watchers_per_blob);
        assert_eq!(sim.sim_chunk_bytes, u64::from(agent.swarm.chunk_size));
    }

    use super::{cpu_times, transmit_bytes};

    #[test]
    fn reads_the_stolen_share_from_proc_stat() {
        let before = cpu_times("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 50 0 25 400 0 0 0 25 0 0\n")
            .expect("a cpu line");
        let after = cpu_times("cpu  200 0 100 1400 0 0 0 300 0 0\n").expect("a cpu line");
        assert_eq!((before.total, before.steal), (1000, 50));
        assert!((after.steal_since(&before) - 0.25).abs() < 1e-9);
        assert_eq!(before.steal_since(&before), 0.0);
        assert!(cpu_times("cpu0 1 2 3 4 5 6 7 8\n").is_none());
        assert!(cpu_times("cpu  1 2 3\n").is_none());
    }

    #[test]
    fn reads_a_devices_transmit_bytes_from_a_proc_net_dev_table() {
        let table = "Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    lo:     100       2    0    0    0     0          0         0      100       2    0    0    0     0       0          0\n  eth0: 5000      40    0    0    0     0          0         0  268435456  190000    0    0    0     0       0          0\n";
        assert_eq!(transmit_bytes(table, "eth0"), Some(268_435_456));
        assert_eq!(transmit_bytes(table, "lo"), Some(100));
        assert_eq!(transmit_bytes(table, "eth1"), None);
        assert_eq!(transmit_bytes("  eth0: 1 2 3\n", "eth0"), None);
    }
}
