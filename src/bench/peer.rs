//! `dray bench peer`: one blob moved between two processes, as between two
//! nodes, with each side's CPU cost read from the kernel.
//!
//! The receiver is this process; the sender is this same binary started again
//! as `dray bench peer-send`, so the two sides' CPU seconds (user + system,
//! from `getrusage` here and `/proc/<pid>/stat` for the child) are never
//! mixed. In the same run the same bytes go over plain TCP, TCP with rustls
//! (the fair peer for an encrypted transport) and a bare quinn stream, and are
//! written to a new file (`write_floor`: what landing the bytes in the page
//! cache costs, whoever does it). TCP with rustls is also run into a file,
//! hashed with SHA-256 as it lands (`tls_tcp_to_disk`: what a plain HTTPS
//! download of a blob costs, the fair peer for a node that keeps what it
//! receives). Transfers are repeated `--rounds` times, interleaved, and each
//! figure is the median of its rounds.
//!
//! The floor is written right after the agent's transfer, before the agent's
//! store is deleted: on a VM that hands freed memory back to its host (free
//! page reporting), writing into memory freed a moment ago costs a twentieth
//! of writing into memory the host took back, so a floor written just after
//! a deletion would be no floor at all (`docs/results.md`).
//!
//! Seconds move with the host (steal, page reporting), so the bench also
//! counts work that does not: user-space instructions per GiB of each side
//! under cachegrind, syscalls and UDP datagrams per GiB, for the agent, raw
//! quinn and TCP with rustls (`crate::bench::peer_counted`). The timed rounds
//! then give, per path, user and system CPU seconds per GiB (both sides) and
//! the median, least and most MB/s. `--only` runs one of the two parts.
//!
//! `--net loopback` (the default) runs both sides in this namespace;
//! `--net veth` (root) puts them in two network namespaces joined by a veth
//! pair at MTU 1500, what a NIC gives: loopback's 64 KiB MTU flatters TCP's
//! segments and hides QUIC's packet count. This process makes the
//! namespaces, runs itself again inside the receiver's, and removes them.
//!
//! The JSON report has flat keys `<path>_<figure>`: path `agent`, `quinn` or
//! `tls_tcp`; figure `instructions_per_gib_sender`,
//! `instructions_per_gib_receiver` (and `digest_instructions_per_gib_*`, the
//! blob digest's SHA-256 among them), `syscalls_per_gib`, `datagrams_per_gib`
//! (UDP paths), `user_cpu_s_per_gib`, `sys_cpu_s_per_gib`, `mb_s_median`,
//! `mb_s_min`, `mb_s_max`; and `net`.

use crate::bench::storm::{remove_namespaces, run_ip};
use crate::bench::{emit, parse_size, write_random_seeded};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use dray_agent::identity::{ClusterCa, Identity};
use dray_agent::peer::{PeerConfig, PeerNode, TransportTuning, quic_endpoint};
use dray_agent::pull::fetch::{PeerAddr, fetch_from_peers};
use dray_agent::store::{ChunkStore, write_in_pieces};
use dray_protocol::DEFAULT_CHUNK_SIZE;
use dray_protocol::chunkmap::ChunkMap;
use prost::Message as _;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufRead, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

/// Bytes per write or read of the baselines.
const BLOCK: usize = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// The wait before each round: on the test VM, memory freed 10 s ago costs
/// about two thirds as much to write into as memory never used, memory
/// freed 1 s ago a twentieth (`docs/results.md`).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(10);
const SENDER_ID: &str = "bench-a";
const RECEIVER_ID: &str = "bench-b";
/// The namespaces of `--net veth` (sender, receiver) and their addresses.
const VETH_PREFIX: &str = "dray-peer-";
const SENDER_NS: &str = "dray-peer-a";
const RECEIVER_NS: &str = "dray-peer-b";
const SENDER_VETH_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
const RECEIVER_VETH_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 2);
const VETH_MTU: &str = "1500";
/// The request timeout of `--patient` sides.
const PATIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
/// The paths compared, with the JSON key each figure starts with.
pub(crate) const PATHS: [(&str, Mode); 3] = [
    ("agent", Mode::Agent),
    ("quinn", Mode::Quic),
    ("tls_tcp", Mode::Tls),
];

#[derive(Args)]
pub struct PeerBench {
    /// Blob size, e.g. 256MiB or 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// Chunk size of the blob, e.g. 4MiB.
    #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE as u64, value_parser = parse_size)]
    chunk_size: u64,
    /// Rounds of every transfer, interleaved; each figure is the median.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Where the two processes meet: this namespace's loopback, or a veth
    /// pair between two network namespaces at MTU 1500 (needs root).
    #[arg(long, value_enum, default_value_t = Net::Loopback)]
    net: Net,
    /// Run only the counted figures or only the timed rounds.
    #[arg(long, value_enum)]
    only: Option<Part>,
    /// The unit of the counted runs: each path moves 1, 2 and 3 times this
    /// (cachegrind runs about 50x slower than the host).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    counted_size: u64,
    /// Set when this bench runs itself again inside the receiver's namespace.
    #[arg(long, hide = true)]
    inside_veth: bool,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// Where the sending and receiving processes meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Net {
    Loopback,
    Veth,
}

/// One part of the bench.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// Instructions, syscalls and datagrams per GiB.
    Counted,
    /// Throughput and CPU seconds, interleaved rounds.
    Timed,
}

/// Where each side runs: the sender's command prefix (its namespace) and the
/// address each side binds.
#[derive(Clone, Copy)]
pub(crate) struct Placement {
    pub(crate) net: Net,
    pub(crate) sender_ip: IpAddr,
    pub(crate) receiver_ip: IpAddr,
}

impl Placement {
    fn new(net: Net) -> Self {
        let (sender_ip, receiver_ip) = match net {
            Net::Loopback => (Ipv4Addr::LOCALHOST, Ipv4Addr::LOCALHOST),
            Net::Veth => (SENDER_VETH_IP, RECEIVER_VETH_IP),
        };
        Self {
            net,
            sender_ip: sender_ip.into(),
            receiver_ip: receiver_ip.into(),
        }
    }

    /// The command prefix that puts a sending process in its namespace.
    pub(crate) fn sender_wrap(&self) -> Vec<String> {
        match self.net {
            Net::Loopback => vec![],
            Net::Veth => ["ip", "netns", "exec", SENDER_NS]
                .map(String::from)
                .to_vec(),
        }
    }
}

/// Overrides of the agents' QUIC transport settings (both sides).
#[derive(Args, Clone, Default)]
pub struct TuningArgs {
    /// Override the largest UDP payload MTU discovery may reach.
    #[arg(long)]
    max_udp_payload: Option<u16>,
    /// Turn off segmentation offload (GSO/GRO).
    #[arg(long)]
    no_gso: bool,
    /// Override the per-stream flow-control window, bytes.
    #[arg(long)]
    stream_window: Option<u32>,
    /// Override the per-connection flow-control windows, bytes.
    #[arg(long)]
    connection_window: Option<u32>,
    /// Override the UDP socket buffer size, bytes.
    #[arg(long)]
    socket_buffer: Option<u32>,
    /// Wait for requests and chunks as long as a run under cachegrind needs
    /// (set by the counted runs for both sides).
    #[arg(long, hide = true)]
    pub(crate) patient: bool,
}

impl TuningArgs {
    fn apply(&self, t: &mut TransportTuning) {
        if let Some(p) = self.max_udp_payload {
            t.max_udp_payload = p;
        }
        if let Some(w) = self.stream_window {
            t.stream_window = w;
        }
        if let Some(w) = self.connection_window {
            t.connection_window = w;
        }
        if let Some(b) = self.socket_buffer {
            t.socket_buffer = b;
        }
        if self.no_gso {
            t.segmentation_offload = false;
        }
    }

    /// The same overrides as flags, for the sending process.
    fn to_flags(&self) -> Vec<String> {
        let mut f = Vec::new();
        let mut opt = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                f.extend([name.to_string(), v]);
            }
        };
        opt(
            "--max-udp-payload",
            self.max_udp_payload.map(|v| v.to_string()),
        );
        opt("--stream-window", self.stream_window.map(|v| v.to_string()));
        opt(
            "--connection-window",
            self.connection_window.map(|v| v.to_string()),
        );
        opt("--socket-buffer", self.socket_buffer.map(|v| v.to_string()));
        if self.no_gso {
            f.push("--no-gso".into());
        }
        if self.patient {
            f.push("--patient".into());
        }
        f
    }

    fn peer_config(&self) -> PeerConfig {
        let mut cfg = PeerConfig::default();
        self.apply(&mut cfg.transport);
        if self.patient {
            cfg.request_timeout = PATIENT_TIMEOUT;
            cfg.min_chunk_bytes_per_s = 1 << 10;
        }
        cfg
    }
}

/// What the sending process sends over (and the receiving one receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Plain TCP from memory.
    Tcp,
    /// TCP with rustls (mutual TLS 1.3 with the agents' certificates) from memory.
    Tls,
    /// One quinn stream on an endpoint made as the agent's is (its transport
    /// settings and UDP socket: `dray_agent::peer::quic_endpoint`), from memory.
    Quic,
    /// A `dray` peer node serving the blob from its chunk store.
    Agent,
}

/// The sending half of `dray bench peer`, in its own process. Prints
/// `ADDR <address>` when it listens, serves until its stdin closes.
#[derive(Args)]
pub struct PeerSend {
    #[arg(long, value_enum)]
    mode: Mode,
    /// Where the receiver left the identities and the agent's chunk stores.
    #[arg(long)]
    dir: PathBuf,
    /// Bytes to send (the baselines).
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: IpAddr,
    #[command(flatten)]
    tuning: TuningArgs,
}

/// The receiving half of `dray bench peer` in its own process, for the
/// counted runs: receives `--size` bytes from `--addr` and exits.
#[derive(Args)]
pub struct PeerRecv {
    #[arg(long, value_enum)]
    mode: Mode,
    /// Where the identities are; the agent path's chunk map is `map-<size>.pb`
    /// there and its store `recv`.
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, value_parser = parse_size)]
    size: u64,
    #[arg(long)]
    addr: SocketAddr,
    /// The address to receive on.
    #[arg(long)]
    bind: IpAddr,
    #[command(flatten)]
    tuning: TuningArgs,
}

#[derive(Serialize)]
struct PeerResult {
    size_bytes: u64,
    chunk_size: u64,
    rounds: usize,
    net: Net,
    #[serde(flatten)]
    timed: Option<Timed>,
    #[serde(flatten)]
    counted: Option<crate::bench::peer_counted::Counted>,
}

/// The figures of the timed rounds.
#[derive(Serialize, Default)]
struct Timed {
    agent_mb_s: f64,
    tcp_mb_s: f64,
    tls_tcp_mb_s: f64,
    /// TCP with rustls into a new file, hashed as it lands.
    tls_tcp_to_disk_mb_s: f64,
    raw_quic_mb_s: f64,
    /// agent_mb_s / tls_tcp_mb_s: the goal is at least 0.8.
    agent_vs_tls_tcp: f64,
    /// agent_mb_s / tls_tcp_to_disk_mb_s.
    agent_vs_tls_tcp_to_disk: f64,
    agent_vs_tcp: f64,
    agent_vs_raw_quic: f64,
    /// CPU seconds (user + system) per GiB moved, each side its own process.
    sender_cpu_s_per_gib: f64,
    receiver_cpu_s_per_gib: f64,
    /// CPU seconds per GiB of writing the same bytes to a new file.
    write_floor_cpu_s_per_gib: f64,
    /// receiver_cpu_s_per_gib - write_floor_cpu_s_per_gib: the goal is at most 1.0.
    receiver_above_floor_cpu_s_per_gib: f64,
    receiver_user_cpu_s_per_gib: f64,
    receiver_system_cpu_s_per_gib: f64,
    tcp_sender_cpu_s_per_gib: f64,
    tcp_receiver_cpu_s_per_gib: f64,
    tls_tcp_sender_cpu_s_per_gib: f64,
    tls_tcp_receiver_cpu_s_per_gib: f64,
    tls_tcp_to_disk_receiver_cpu_s_per_gib: f64,
    raw_quic_sender_cpu_s_per_gib: f64,
    raw_quic_receiver_cpu_s_per_gib: f64,
    /// Peak resident memory of the receiving process during the agent
    /// transfer, and of the sending agent over its life, MiB.
    receiver_peak_rss_mib: f64,
    /// What the receiving process held as the agent transfer began: it ran
    /// the baselines first, and the allocator keeps some of what they freed
    /// (the peak above includes it; an agent process of its own does not).
    receiver_rss_before_mib: f64,
    sender_peak_rss_mib: f64,
    /// UDP payload size the agents' path reached through MTU discovery.
    path_mtu: u16,
    /// `<path>_user_cpu_s_per_gib`, `<path>_sys_cpu_s_per_gib` (both sides,
    /// median), `<path>_mb_s_median`, `<path>_mb_s_min`, `<path>_mb_s_max`.
    #[serde(flatten)]
    figures: BTreeMap<String, f64>,
}

/// One transfer: wall seconds and each side's (user, system) CPU seconds.
#[derive(Clone, Copy, Default)]
struct Sample {
    wall: f64,
    sender: (f64, f64),
    receiver: (f64, f64),
}

impl Sample {
    fn mb_s(&self, bytes: u64) -> f64 {
        bytes as f64 / 1e6 / self.wall
    }
}

pub(crate) fn total((u, s): (f64, f64)) -> f64 {
    u + s
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// This process's (user, system) CPU seconds.
pub(crate) fn own_cpu() -> (f64, f64) {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

/// A child's (user, system) CPU seconds so far, from `/proc/<pid>/stat`.
pub(crate) fn child_cpu(pid: u32) -> Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at `state`;
    // utime and stime are the 14th and 15th fields of the whole line.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let field = |i: usize| -> Result<f64> {
        Ok(f.get(i)
            .context("short /proc stat")?
            .parse::<f64>()
            .context("bad /proc stat field")?
            / tick)
    };
    Ok((field(11)?, field(12)?))
}

pub(crate) fn diff(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    (b.0 - a.0, b.1 - a.1)
}

/// Peak resident set (VmHWM) of a process, MiB.
fn peak_rss_mib(pid: &str) -> Result<f64> {
    status_mib(pid, "VmHWM:")
}

/// A memory figure (`VmHWM:`, `VmRSS:`) from a process's `/proc` status, MiB.
fn status_mib(pid: &str, field: &str) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .with_context(|| format!("no {field} in /proc status"))?;
    Ok(kib / 1024.0)
}

/// Resets this process's peak resident set to its current size.
fn reset_peak_rss() -> Result<()> {
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")
}

/// `dray bench <side> --mode <mode> --size <size> --dir <dir> <tuning>` run
/// under the command prefix `wrap` (a namespace, a counter), as a child.
pub(crate) fn side_command(
    wrap: &[String],
    side: &str,
    mode: Mode,
    dir: &Path,
    size: u64,
    tuning: &TuningArgs,
) -> Result<Command> {
    let exe = std::env::current_exe().context("finding the dray binary")?;
    let mut cmd = match wrap.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args(["bench", side, "--mode", &mode_name(mode), "--size"])
        .arg(size.to_string())
        .arg("--dir")
        .arg(dir)
        .args(tuning.to_flags());
    Ok(cmd)
}

fn mode_name(mode: Mode) -> String {
    format!("{mode:?}").to_lowercase()
}

/// A running sender process and the address it listens on.
pub(crate) struct Sender {
    child: Child,
    pub(crate) addr: SocketAddr,
}

impl Sender {
    /// Starts the sender of `mode` under the command prefix `wrap`, listening on `bind`.
    pub(crate) fn start(
        mode: Mode,
        dir: &Path,
        size: u64,
        tuning: &TuningArgs,
        wrap: &[String],
        bind: IpAddr,
    ) -> Result<Self> {
        let mode_name = mode_name(mode);
        let mut child = side_command(wrap, "peer-send", mode, dir, size, tuning)?
            .arg("--bind")
            .arg(bind.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the sending process")?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().context("no stdout")?)
            .read_line(&mut line)
            .context("reading the sender's address")?;
        let addr = match line.trim().strip_prefix("ADDR ") {
            Some(a) => a.parse().context("parsing the sender's address")?,
            None => {
                let _ = child.kill();
                bail!("the {mode_name} sender did not start (said {line:?})");
            }
        };
        Ok(Self { child, addr })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes the sender's stdin, which ends it.
    pub(crate) fn stop(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the sending process failed: {status}");
        }
        Ok(())
    }
}

/// Runs `receive` against a fresh sender of `mode`, timing both sides.
async fn transfer<F, Fut>(
    mode: Mode,
    dir: &Path,
    size: u64,
    (tuning, place): (&TuningArgs, &Placement),
    receive: F,
) -> Result<(Sample, f64)>
where
    F: FnOnce(SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let sender = Sender::start(
        mode,
        dir,
        size,
        tuning,
        &place.sender_wrap(),
        place.sender_ip,
    )?;
    let pid = sender.pid();
    let (s0, r0, t0) = (child_cpu(pid)?, own_cpu(), Instant::now());
    receive(sender.addr)
        .await
        .with_context(|| format!("{mode:?} transfer"))?;
    let (wall, r1, s1) = (t0.elapsed().as_secs_f64(), own_cpu(), child_cpu(pid)?);
    let sender_rss = peak_rss_mib(&pid.to_string())?;
    sender.stop()?;
    Ok((
        Sample {
            wall,
            sender: diff(s0, s1),
            receiver: diff(r0, r1),
        },
        sender_rss,
    ))
}

pub async fn run(b: PeerBench) -> Result<()> {
    if b.size == 0 || b.rounds == 0 || b.counted_size == 0 {
        bail!("--size, --rounds and --counted-size must be positive");
    }
    if b.net == Net::Veth && !b.inside_veth {
        return run_in_veth().await;
    }
    let chunk_size = u32::try_from(b.chunk_size).context("--chunk-size is too large")?;
    let place = Placement::new(b.net);
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let ca = ClusterCa::generate()?;
    let sender_id = ca.issue(SENDER_ID)?;
    let receiver_id = ca.issue(RECEIVER_ID)?;
    for (name, text) in [
        ("ca.crt", ca.cert_pem.clone()),
        ("sender.crt", sender_id.cert_pem()),
        ("sender.key", sender_id.key_pem()),
        ("receiver.crt", receiver_id.cert_pem()),
        ("receiver.key", receiver_id.key_pem()),
    ] {
        std::fs::write(dir.path().join(name), text)?;
    }
    let (counted, timed) = (b.only != Some(Part::Timed), b.only != Some(Part::Counted));
    let counted_sizes = [1, 2, 3].map(|k| k * b.counted_size);
    let mut maps = BTreeMap::new();
    let sizes = timed.then_some(b.size).into_iter();
    for size in sizes.chain(counted.then_some(counted_sizes).into_iter().flatten()) {
        if let std::collections::btree_map::Entry::Vacant(e) = maps.entry(size) {
            e.insert(import_blob(dir.path(), size, chunk_size)?);
        }
    }
    let counted = match counted {
        true => Some(
            crate::bench::peer_counted::run(dir.path(), &place, &b.tuning, b.counted_size).await?,
        ),
        false => None,
    };
    let timed = match timed {
        true => Some(timed_rounds(&b, dir.path(), &place, &receiver_id, &maps[&b.size]).await?),
        false => None,
    };
    let r = PeerResult {
        size_bytes: b.size,
        chunk_size: b.chunk_size,
        rounds: b.rounds,
        net: b.net,
        timed,
        counted,
    };
    emit(b.json, &r, print_table)
}

/// Writes a blob of `size` random bytes (seeded by its size) into a store
/// of its own (a store evicts what it holds to make room for an import),
/// and its chunk map to `map-<size>.pb` in `dir` for a receiving process.
fn import_blob(dir: &Path, size: u64, chunk_size: u32) -> Result<ChunkMap> {
    let src = dir.join("blob");
    write_random_seeded(&src, size, size)?;
    let map = ChunkStore::open(&sender_store(dir, size))?.import(&src, chunk_size)?;
    std::fs::remove_file(&src)?;
    std::fs::write(map_file(dir, size), map.to_pb().encode_to_vec())?;
    Ok(map)
}

/// The sending agent's store of the blob of `size` bytes.
fn sender_store(dir: &Path, size: u64) -> PathBuf {
    dir.join(format!("a-{size}"))
}

fn map_file(dir: &Path, size: u64) -> PathBuf {
    dir.join(format!("map-{size}.pb"))
}

/// `--net veth`: makes the two namespaces and their link, runs this bench
/// again inside the receiver's, and removes them however it ends.
async fn run_in_veth() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("--net veth makes network namespaces: it needs root");
    }
    let _pair = VethPair::build().await?;
    let exe = std::env::current_exe().context("finding the dray binary")?;
    let status = tokio::process::Command::new("ip")
        .args(["netns", "exec", RECEIVER_NS])
        .arg(exe)
        .args(std::env::args_os().skip(1))
        .arg("--inside-veth")
        .kill_on_drop(true)
        .status()
        .await
        .context("running the bench inside its namespace")?;
    if !status.success() {
        bail!("the bench inside {RECEIVER_NS} failed: {status}");
    }
    Ok(())
}

/// The two namespaces of `--net veth` and the veth pair between them;
/// dropping it deletes them.
struct VethPair;

impl VethPair {
    async fn build() -> Result<Self> {
        remove_namespaces(VETH_PREFIX);
        let pair = VethPair;
        for ns in [SENDER_NS, RECEIVER_NS] {
            run_ip(&["netns", "add", ns]).await?;
        }
        run_ip(&[
            "-n",
            SENDER_NS,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            RECEIVER_NS,
        ])
        .await?;
        for (ns, ip) in [(SENDER_NS, SENDER_VETH_IP), (RECEIVER_NS, RECEIVER_VETH_IP)] {
            run_ip(&["-n", ns, "link", "set", "eth0", "mtu", VETH_MTU]).await?;
            run_ip(&["-n", ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"]).await?;
            run_ip(&["-n", ns, "link", "set", "eth0", "up"]).await?;
            run_ip(&["-n", ns, "link", "set", "lo", "up"]).await?;
        }
        Ok(pair)
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        remove_namespaces(VETH_PREFIX);
    }
}

/// The timed rounds: every path once per round, interleaved, after a settle.
async fn timed_rounds(
    b: &PeerBench,
    dir: &Path,
    place: &Placement,
    receiver_id: &Identity,
    map: &ChunkMap,
) -> Result<Timed> {
    let size = b.size;
    let chunk_size = map.chunk_size();
    let ctx = (&b.tuning, place);
    let bind = place.receiver_ip;
    let (mut floor, mut tcp, mut tls, mut tls_disk, mut quic, mut agent) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut path_mtu, mut receiver_rss, mut sender_rss) = (0, 0.0f64, 0.0f64);
    let mut rss_before = 0.0f64;
    for round in 0..b.rounds {
        // What the last round (or the setup) freed goes back to the host
        // first, so the three writes of the round all land in memory alike.
        tokio::time::sleep(SETTLE).await;
        tcp.push(
            transfer(Mode::Tcp, dir, size, ctx, |a| {
                blocking(move || receive_tcp(a, size))
            })
            .await?
            .0,
        );
        let id = receiver_id.clone();
        tls.push(
            transfer(Mode::Tls, dir, size, ctx, |a| {
                blocking(move || receive_tls(a, size, &id))
            })
            .await?
            .0,
        );
        quic.push(
            transfer(Mode::Quic, dir, size, ctx, move |a| {
                receive_quic(a, size, receiver_id, (bind, &b.tuning))
            })
            .await?
            .0,
        );
        let store_dir = dir.join(format!("b{round}"));
        reset_peak_rss()?;
        rss_before = rss_before.max(status_mib("self", "VmRSS:")?);
        let (store, cfg, mtu) = (&store_dir, b.tuning.peer_config(), &mut path_mtu);
        let (sample, rss) = transfer(Mode::Agent, dir, size, ctx, move |addr| async move {
            *mtu = receive_agent(addr, map, receiver_id, store, bind, cfg).await?;
            Ok(())
        })
        .await?;
        receiver_rss = receiver_rss.max(peak_rss_mib("self")?);
        sender_rss = sender_rss.max(rss);
        agent.push(sample);
        let floor_file = dir.join("floor");
        floor.push(write_floor(&floor_file, size, chunk_size)?);
        let (id, disk_file) = (receiver_id.clone(), dir.join("tls-to-disk"));
        let to = disk_file.clone();
        tls_disk.push(
            transfer(Mode::Tls, dir, size, ctx, |a| {
                blocking(move || receive_tls_to_disk(a, size, &id, &to))
            })
            .await?
            .0,
        );
        std::fs::remove_dir_all(&store_dir)?;
        std::fs::remove_file(&floor_file)?;
        std::fs::remove_file(&disk_file)?;
    }

    let per_gib = |s: f64| s / (size as f64 / GIB);
    let rates = |v: &[Sample]| v.iter().map(|s| s.mb_s(size)).collect::<Vec<_>>();
    let mb_s = |v: &[Sample]| median(rates(v));
    let cpu = |v: &[Sample], f: fn(&Sample) -> f64| per_gib(median(v.iter().map(f).collect()));
    let sender = |s: &Sample| total(s.sender);
    let receiver = |s: &Sample| total(s.receiver);
    let mut figures = BTreeMap::new();
    for (key, samples) in [("agent", &agent), ("quinn", &quic), ("tls_tcp", &tls)] {
        let r = rates(samples);
        for (figure, value) in [
            (
                "user_cpu_s_per_gib",
                cpu(samples, |s| s.sender.0 + s.receiver.0),
            ),
            (
                "sys_cpu_s_per_gib",
                cpu(samples, |s| s.sender.1 + s.receiver.1),
            ),
            ("mb_s_median", median(r.clone())),
            ("mb_s_min", r.iter().copied().fold(f64::INFINITY, f64::min)),
            ("mb_s_max", r.iter().copied().fold(0.0, f64::max)),
        ] {
            figures.insert(format!("{key}_{figure}"), value);
        }
    }
    let mut r = Timed {
        agent_mb_s: mb_s(&agent),
        tcp_mb_s: mb_s(&tcp),
        tls_tcp_mb_s: mb_s(&tls),
        tls_tcp_to_disk_mb_s: mb_s(&tls_disk),
        raw_quic_mb_s: mb_s(&quic),
        sender_cpu_s_per_gib: cpu(&agent, sender),
        receiver_cpu_s_per_gib: cpu(&agent, receiver),
        write_floor_cpu_s_per_gib: per_gib(median(floor)),
        receiver_user_cpu_s_per_gib: cpu(&agent, |s| s.receiver.0),
        receiver_system_cpu_s_per_gib: cpu(&agent, |s| s.receiver.1),
        tcp_sender_cpu_s_per_gib: cpu(&tcp, sender),
        tcp_receiver_cpu_s_per_gib: cpu(&tcp, receiver),
        tls_tcp_sender_cpu_s_per_gib: cpu(&tls, sender),
        tls_tcp_receiver_cpu_s_per_gib: cpu(&tls, receiver),
        tls_tcp_to_disk_receiver_cpu_s_per_gib: cpu(&tls_disk, receiver),
        raw_quic_sender_cpu_s_per_gib: cpu(&quic, sender),
        raw_quic_receiver_cpu_s_per_gib: cpu(&quic, receiver),
        receiver_peak_rss_mib: receiver_rss,
        receiver_rss_before_mib: rss_before,
        sender_peak_rss_mib: sender_rss,
        path_mtu,
        figures,
        ..Timed::default()
    };
    r.agent_vs_tls_tcp = r.agent_mb_s / r.tls_tcp_mb_s;
    r.agent_vs_tls_tcp_to_disk = r.agent_mb_s / r.tls_tcp_to_disk_mb_s;
    r.agent_vs_tcp = r.agent_mb_s / r.tcp_mb_s;
    r.agent_vs_raw_quic = r.agent_mb_s / r.raw_quic_mb_s;
    r.receiver_above_floor_cpu_s_per_gib = r.receiver_cpu_s_per_gib - r.write_floor_cpu_s_per_gib;
    Ok(r)
}

fn print_table(r: &PeerResult) {
    println!(
        "size {} bytes, chunks of {} bytes, net {:?}",
        r.size_bytes, r.chunk_size, r.net
    );
    if let Some(c) = &r.counted {
        crate::bench::peer_counted::print_table(c);
    }
    if let Some(t) = &r.timed {
        print_timed(t, r.rounds);
    }
}

fn print_timed(r: &Timed, rounds: usize) {
    println!("median of {rounds} round(s); CPU s per GiB");
    println!("                    MB/s   sender  receiver");
    let row = |name: &str, mb_s: f64, s: f64, rcv: f64| {
        println!("{name:<16} {mb_s:8.1} {s:8.2} {rcv:9.2}");
    };
    row(
        "agent (QUIC)",
        r.agent_mb_s,
        r.sender_cpu_s_per_gib,
        r.receiver_cpu_s_per_gib,
    );
    row(
        "raw quinn",
        r.raw_quic_mb_s,
        r.raw_quic_sender_cpu_s_per_gib,
        r.raw_quic_receiver_cpu_s_per_gib,
    );
    row(
        "TCP + rustls",
        r.tls_tcp_mb_s,
        r.tls_tcp_sender_cpu_s_per_gib,
        r.tls_tcp_receiver_cpu_s_per_gib,
    );
    row(
        "TCP+rustls disk",
        r.tls_tcp_to_disk_mb_s,
        r.tls_tcp_sender_cpu_s_per_gib,
        r.tls_tcp_to_disk_receiver_cpu_s_per_gib,
    );
    row(
        "plain TCP",
        r.tcp_mb_s,
        r.tcp_sender_cpu_s_per_gib,
        r.tcp_receiver_cpu_s_per_gib,
    );
    println!(
        "write floor                         {:9.2}",
        r.write_floor_cpu_s_per_gib
    );
    println!(
        "agent receiver: {:.2} user + {:.2} system, {:.2} above the floor; peak RSS {:.0} MiB ({:.0} MiB held before, from the baselines run in this process; sender {:.0} MiB)",
        r.receiver_user_cpu_s_per_gib,
        r.receiver_system_cpu_s_per_gib,
        r.receiver_above_floor_cpu_s_per_gib,
        r.receiver_peak_rss_mib,
        r.receiver_rss_before_mib,
        r.sender_peak_rss_mib
    );
    println!("path MTU {} bytes (agents)", r.path_mtu);
    println!(
        "agent / TCP+TLS {:.2}   agent / TCP+TLS to disk {:.2}   agent / TCP {:.2}   agent / quinn {:.2}",
        r.agent_vs_tls_tcp, r.agent_vs_tls_tcp_to_disk, r.agent_vs_tcp, r.agent_vs_raw_quic
    );
    println!("both sides, CPU s per GiB   user  system   MB/s median (min-max)");
    for (key, _) in PATHS {
        let f = |figure: &str| r.figures[&format!("{key}_{figure}")];
        println!(
            "{key:<26} {:6.2} {:7.2}   {:.1} ({:.1}-{:.1})",
            f("user_cpu_s_per_gib"),
            f("sys_cpu_s_per_gib"),
            f("mb_s_median"),
            f("mb_s_min"),
            f("mb_s_max")
        );
    }
}

async fn blocking(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    tokio::task::spawn_blocking(f).await?
}

/// CPU seconds of writing `size` bytes chunk by chunk to a new file `path`,
/// as the store writes a blob ([`write_in_pieces`]); the caller removes it.
fn write_floor(path: &Path, size: u64, chunk_size: u32) -> Result<f64> {
    let mut buf = vec![0u8; chunk_size as usize];
    crate::bench::RandomBytes::new(7).read_exact(&mut buf)?;
    let before = own_cpu();
    let f = std::fs::File::create(path)?;
    let mut off = 0;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        write_in_pieces(&f, &buf[..n], off)?;
        off += n as u64;
    }
    drop(f);
    Ok(total(diff(before, own_cpu())))
}

/// Reads until `size` bytes have come, into one reused buffer, handing each
/// read to `sink` with its offset.
fn drain(
    r: &mut impl Read,
    size: u64,
    mut sink: impl FnMut(&[u8], u64) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; BLOCK];
    let mut got = 0u64;
    while got < size {
        let n = r.read(&mut buf)?;
        if n == 0 {
            bail!("stream ended after {got} of {size} bytes");
        }
        sink(&buf[..n], got)?;
        got += n as u64;
    }
    Ok(())
}

fn discard(_: &[u8], _: u64) -> Result<()> {
    Ok(())
}

/// Writes `size` bytes from one reused buffer.
fn pour(w: &mut impl Write, size: u64) -> Result<()> {
    let buf = vec![7u8; BLOCK];
    let mut left = size;
    while left > 0 {
        let n = left.min(BLOCK as u64) as usize;
        w.write_all(&buf[..n])?;
        left -= n as u64;
    }
    w.flush()?;
    Ok(())
}

fn receive_tcp(addr: SocketAddr, size: u64) -> Result<()> {
    drain(&mut std::net::TcpStream::connect(addr)?, size, discard)
}

fn tls_stream(
    addr: SocketAddr,
    id: &Identity,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>> {
    let name = rustls::pki_types::ServerName::try_from(SENDER_ID.to_string())?;
    let conn = rustls::ClientConnection::new(Arc::new(id.client_tls()?), name)?;
    Ok(rustls::StreamOwned::new(
        conn,
        std::net::TcpStream::connect(addr)?,
    ))
}

fn receive_tls(addr: SocketAddr, size: u64, id: &Identity) -> Result<()> {
    drain(&mut tls_stream(addr, id)?, size, discard)
}

/// Receives over TCP with rustls into a new file `path` (the caller removes it),
/// hashing with SHA-256 what it writes, as a plain HTTPS download of a blob.
fn receive_tls_to_disk(addr: SocketAddr, size: u64, id: &Identity, path: &Path) -> Result<()> {
    use sha2::Digest as _;
    let file = std::fs::File::create(path)?;
    let mut sha = sha2::Sha256::new();
    drain(&mut tls_stream(addr, id)?, size, |bytes, at| {
        sha.update(bytes);
        Ok(write_in_pieces(&file, bytes, at)?)
    })?;
    std::hint::black_box(sha.finalize());
    Ok(())
}

async fn receive_quic(
    addr: SocketAddr,
    size: u64,
    id: &Identity,
    (bind, tuning): (IpAddr, &TuningArgs),
) -> Result<()> {
    let transport = tuning.peer_config().transport;
    let endpoint = quic_endpoint(id, SocketAddr::new(bind, 0), &transport)?;
    let conn = endpoint.connect(addr, SENDER_ID)?.await?;
    // A bidirectional stream, as the agent's requests are: the peer plane
    // allows no unidirectional ones.
    let (_send, mut r) = conn.accept_bi().await?;
    let mut got = 0u64;
    while let Some(chunk) = r.read_chunk(BLOCK, true).await? {
        got += chunk.bytes.len() as u64;
    }
    if got != size {
        bail!("QUIC stream ended after {got} of {size} bytes");
    }
    conn.close(0u32.into(), b"done");
    endpoint.wait_idle().await;
    Ok(())
}

/// Fetches `map`'s blob from the sending agent at `addr` into a new store
/// `store`, as a receiving node; returns the path MTU it reached.
async fn receive_agent(
    addr: SocketAddr,
    map: &ChunkMap,
    id: &Identity,
    store: &Path,
    bind: IpAddr,
    cfg: PeerConfig,
) -> Result<u16> {
    let store = Arc::new(ChunkStore::open(store)?);
    let node = PeerNode::bind(id.clone(), store, SocketAddr::new(bind, 0), cfg)?;
    let peers = [PeerAddr {
        peer_id: SENDER_ID.into(),
        addr,
    }];
    let report = fetch_from_peers(&node, map, &peers).await?;
    node.close();
    Ok(report.path_mtu_by_peer.values().copied().max().unwrap_or(0))
}

/// `dray bench peer-recv`: receives once, as the receiving process of a counted run.
pub async fn recv(r: PeerRecv) -> Result<()> {
    let path = |n: &str| r.dir.join(n);
    let id = Identity::load(
        &path("receiver.crt"),
        &path("receiver.key"),
        &path("ca.crt"),
    )?;
    let (addr, size) = (r.addr, r.size);
    match r.mode {
        Mode::Tcp => blocking(move || receive_tcp(addr, size)).await,
        Mode::Tls => blocking(move || receive_tls(addr, size, &id)).await,
        Mode::Quic => receive_quic(addr, size, &id, (r.bind, &r.tuning)).await,
        Mode::Agent => {
            let pb = std::fs::read(map_file(&r.dir, size)).context("reading the chunk map")?;
            let map = ChunkMap::from_pb(&prost::Message::decode(pb.as_slice())?)?;
            let cfg = r.tuning.peer_config();
            receive_agent(addr, &map, &id, &path("recv"), r.bind, cfg).await?;
            Ok(())
        }
    }
}

/// `dray bench peer-send`: listens, prints its address, sends, and stays until
/// stdin closes.
pub async fn send(s: PeerSend) -> Result<()> {
    let path = |n: &str| s.dir.join(n);
    let id = Identity::load(&path("sender.crt"), &path("sender.key"), &path("ca.crt"))?;
    let announce = |addr: SocketAddr| -> Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ADDR {addr}")?;
        out.flush()?;
        Ok(())
    };
    let size = s.size;
    let serving = match s.mode {
        Mode::Tcp | Mode::Tls => {
            let listener = std::net::TcpListener::bind(SocketAddr::new(s.bind, 0))?;
            announce(listener.local_addr()?)?;
            let tls = (s.mode == Mode::Tls).then(|| id.server_tls()).transpose()?;
            tokio::task::spawn_blocking(move || -> Result<()> {
                let (tcp, _) = listener.accept()?;
                match tls {
                    None => pour(&mut &tcp, size),
                    Some(cfg) => {
                        let conn = rustls::ServerConnection::new(Arc::new(cfg))?;
                        let mut tls = rustls::StreamOwned::new(conn, tcp);
                        pour(&mut tls, size)?;
                        tls.conn.send_close_notify();
                        tls.flush()?;
                        Ok(())
                    }
                }
            })
        }
        Mode::Quic => {
            let transport = s.tuning.peer_config().transport;
            let endpoint = quic_endpoint(&id, SocketAddr::new(s.bind, 0), &transport)?;
            announce(endpoint.local_addr()?)?;
            tokio::spawn(async move {
                let conn = endpoint.accept().await.context("no connection")?.await?;
                let (mut w, _recv) = conn.open_bi().await?;
                let buf = bytes::Bytes::from(vec![7u8; BLOCK]);
                let mut left = size;
                while left > 0 {
                    let n = left.min(BLOCK as u64) as usize;
                    w.write_chunk(buf.slice(..n)).await?;
                    left -= n as u64;
                }
                w.finish()?;
                let _ = conn.closed().await;
                Ok(())
            })
        }
        Mode::Agent => {
            let cfg = s.tuning.peer_config();
            let store = Arc::new(ChunkStore::open(&sender_store(&s.dir, size))?);
            let node = PeerNode::bind(id, store, SocketAddr::new(s.bind, 0), cfg)?;
            announce(node.local_addr()?)?;
            tokio::spawn(async move {
                // Serves until stdin closes.
                let _ =
                    tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut vec![])).await;
                node.close();
                Ok(())
            })
        }
    };
    serving.await??;
    // Stay until the receiver has read this process's CPU time.
    tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut vec![])).await??;
    Ok(())
}
