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

use crate::bench::{emit, parse_size, write_random};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use dray_agent::fetch::{PeerAddr, fetch_from_peers};
use dray_agent::identity::{ClusterCa, Identity};
use dray_agent::peer::{PeerConfig, PeerNode, TransportTuning};
use dray_agent::store::{ChunkStore, write_in_pieces};
use dray_protocol::DEFAULT_CHUNK_SIZE;
use serde::Serialize;
use std::io::{BufRead, Read, Write};
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

#[derive(Args)]
pub struct PeerBench {
    /// Blob size, e.g. 256MiB or 1GiB.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// Chunk size of the blob, e.g. 4MiB.
    #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE as u64, value_parser = parse_size)]
    chunk_size: u64,
    /// Rounds of every transfer, interleaved; each figure is the median.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tuning: TuningArgs,
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
        f
    }

    fn peer_config(&self) -> PeerConfig {
        let mut cfg = PeerConfig::default();
        self.apply(&mut cfg.transport);
        cfg
    }
}

/// What the sending process sends over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Plain TCP from memory.
    Tcp,
    /// TCP with rustls (mutual TLS 1.3 with the agents' certificates) from memory.
    Tls,
    /// One quinn stream with quinn's default transport settings, from memory.
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
    /// Where the receiver left the identities and the agent's chunk store.
    #[arg(long)]
    dir: PathBuf,
    /// Bytes to send (the baselines).
    #[arg(long, value_parser = parse_size)]
    size: u64,
    #[command(flatten)]
    tuning: TuningArgs,
}

#[derive(Serialize, Default)]
struct PeerResult {
    size_bytes: u64,
    chunk_size: u64,
    rounds: usize,
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

/// A running sender process and the address it listens on.
struct Sender {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Sender {
    fn start(mode: Mode, dir: &Path, size: u64, tuning: &TuningArgs) -> Result<Self> {
        let exe = std::env::current_exe().context("finding the dray binary")?;
        let mode_name = format!("{mode:?}").to_lowercase();
        let mut child = Command::new(exe)
            .args(["bench", "peer-send", "--mode", &mode_name, "--size"])
            .arg(size.to_string())
            .arg("--dir")
            .arg(dir)
            .args(tuning.to_flags())
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

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Closes the sender's stdin, which ends it.
    fn stop(mut self) -> Result<()> {
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
    tuning: &TuningArgs,
    receive: F,
) -> Result<(Sample, f64)>
where
    F: FnOnce(std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let sender = Sender::start(mode, dir, size, tuning)?;
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
    if b.size == 0 || b.rounds == 0 {
        bail!("--size and --rounds must be positive");
    }
    let chunk_size = u32::try_from(b.chunk_size).context("--chunk-size is too large")?;
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let ca = ClusterCa::generate()?;
    let sender_id = ca.issue(SENDER_ID)?;
    for (name, text) in [
        ("ca.crt", ca.cert_pem.as_str()),
        ("sender.crt", &sender_id.cert_pem()),
        ("sender.key", &sender_id.key_pem()),
    ] {
        std::fs::write(dir.path().join(name), text)?;
    }
    let receiver_id = ca.issue(RECEIVER_ID)?;
    let map = {
        let src = dir.path().join("blob");
        write_random(&src, b.size)?;
        let store = ChunkStore::open(&dir.path().join("a"))?;
        let map = store.import(&src, chunk_size)?;
        std::fs::remove_file(&src)?;
        map
    };

    let size = b.size;
    let (mut floor, mut tcp, mut tls, mut tls_disk, mut quic, mut agent) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut path_mtu, mut receiver_rss, mut sender_rss) = (0, 0.0f64, 0.0f64);
    let mut rss_before = 0.0f64;
    for round in 0..b.rounds {
        // What the last round (or the setup) freed goes back to the host
        // first, so the three writes of the round all land in memory alike.
        tokio::time::sleep(SETTLE).await;
        tcp.push(
            transfer(Mode::Tcp, dir.path(), size, &b.tuning, |a| {
                blocking(move || receive_tcp(a, size))
            })
            .await?
            .0,
        );
        let id = receiver_id.clone();
        tls.push(
            transfer(Mode::Tls, dir.path(), size, &b.tuning, |a| {
                blocking(move || receive_tls(a, size, &id))
            })
            .await?
            .0,
        );
        let id = &receiver_id;
        quic.push(
            transfer(Mode::Quic, dir.path(), size, &b.tuning, move |a| {
                receive_quic(a, size, id)
            })
            .await?
            .0,
        );
        let store_dir = dir.path().join(format!("b{round}"));
        reset_peak_rss()?;
        rss_before = rss_before.max(status_mib("self", "VmRSS:")?);
        let (id, store, map, cfg, mtu) = (
            &receiver_id,
            &store_dir,
            &map,
            b.tuning.peer_config(),
            &mut path_mtu,
        );
        let (sample, rss) = transfer(
            Mode::Agent,
            dir.path(),
            size,
            &b.tuning,
            move |addr| async move {
                let node = PeerNode::bind(
                    id.clone(),
                    Arc::new(ChunkStore::open(store)?),
                    "127.0.0.1:0".parse()?,
                    cfg,
                )?;
                let peers = [PeerAddr {
                    peer_id: SENDER_ID.into(),
                    addr,
                }];
                let report = fetch_from_peers(&node, map, &peers).await?;
                *mtu = report.path_mtu_by_peer.values().copied().max().unwrap_or(0);
                node.close();
                Ok(())
            },
        )
        .await?;
        receiver_rss = receiver_rss.max(peak_rss_mib("self")?);
        sender_rss = sender_rss.max(rss);
        agent.push(sample);
        let floor_file = dir.path().join("floor");
        floor.push(write_floor(&floor_file, size, chunk_size)?);
        let (id, disk_file) = (receiver_id.clone(), dir.path().join("tls-to-disk"));
        let to = disk_file.clone();
        tls_disk.push(
            transfer(Mode::Tls, dir.path(), size, &b.tuning, |a| {
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
    let mb_s = |v: &[Sample]| median(v.iter().map(|s| s.mb_s(size)).collect());
    let cpu = |v: &[Sample], f: fn(&Sample) -> f64| per_gib(median(v.iter().map(f).collect()));
    let sender = |s: &Sample| total(s.sender);
    let receiver = |s: &Sample| total(s.receiver);
    let mut r = PeerResult {
        size_bytes: size,
        chunk_size: b.chunk_size,
        rounds: b.rounds,
        agent_mb_s: mb_s(&agent),
        tcp_mb_s: mb_s(&tcp),
        tls_tcp_mb_s: mb_s(&tls),
        tls_tcp_to_disk_mb_s: mb_s(&tls_disk),
        raw_quic_mb_s: mb_s(&quic),
        sender_cpu_s_per_gib: cpu(&agent, sender),
        receiver_cpu_s_per_gib: cpu(&agent, receiver),
        write_floor_cpu_s_per_gib: per_gib(median(floor.clone())),
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
        ..PeerResult::default()
    };
    r.agent_vs_tls_tcp = r.agent_mb_s / r.tls_tcp_mb_s;
    r.agent_vs_tls_tcp_to_disk = r.agent_mb_s / r.tls_tcp_to_disk_mb_s;
    r.agent_vs_tcp = r.agent_mb_s / r.tcp_mb_s;
    r.agent_vs_raw_quic = r.agent_mb_s / r.raw_quic_mb_s;
    r.receiver_above_floor_cpu_s_per_gib = r.receiver_cpu_s_per_gib - r.write_floor_cpu_s_per_gib;
    emit(b.json, &r, print_table)
}

fn print_table(r: &PeerResult) {
    println!(
        "size {} bytes, chunks of {} bytes, median of {} round(s); CPU s per GiB",
        r.size_bytes, r.chunk_size, r.rounds
    );
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

fn receive_tcp(addr: std::net::SocketAddr, size: u64) -> Result<()> {
    drain(&mut std::net::TcpStream::connect(addr)?, size, discard)
}

fn tls_stream(
    addr: std::net::SocketAddr,
    id: &Identity,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>> {
    let name = rustls::pki_types::ServerName::try_from(SENDER_ID.to_string())?;
    let conn = rustls::ClientConnection::new(Arc::new(id.client_tls()?), name)?;
    Ok(rustls::StreamOwned::new(
        conn,
        std::net::TcpStream::connect(addr)?,
    ))
}

fn receive_tls(addr: std::net::SocketAddr, size: u64, id: &Identity) -> Result<()> {
    drain(&mut tls_stream(addr, id)?, size, discard)
}

/// Receives over TCP with rustls into a new file `path` (the caller removes it),
/// hashing with SHA-256 what it writes, as a plain HTTPS download of a blob.
fn receive_tls_to_disk(
    addr: std::net::SocketAddr,
    size: u64,
    id: &Identity,
    path: &Path,
) -> Result<()> {
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

async fn receive_quic(addr: std::net::SocketAddr, size: u64, id: &Identity) -> Result<()> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(id.client_tls()?)?;
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint.connect(addr, SENDER_ID)?.await?;
    let mut r = conn.accept_uni().await?;
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

/// `dray bench peer-send`: listens, prints its address, sends, and stays until
/// stdin closes.
pub async fn send(s: PeerSend) -> Result<()> {
    let path = |n: &str| s.dir.join(n);
    let id = Identity::load(&path("sender.crt"), &path("sender.key"), &path("ca.crt"))?;
    let announce = |addr: std::net::SocketAddr| -> Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ADDR {addr}")?;
        out.flush()?;
        Ok(())
    };
    let size = s.size;
    let serving = match s.mode {
        Mode::Tcp | Mode::Tls => {
            let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
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
            let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(id.server_tls()?)?;
            let cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
            let endpoint = quinn::Endpoint::server(cfg, "127.0.0.1:0".parse()?)?;
            announce(endpoint.local_addr()?)?;
            tokio::spawn(async move {
                let conn = endpoint.accept().await.context("no connection")?.await?;
                let mut w = conn.open_uni().await?;
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
            let mut cfg = PeerConfig::default();
            s.tuning.apply(&mut cfg.transport);
            let store = Arc::new(ChunkStore::open(&path("a"))?);
            let node = PeerNode::bind(id, store, "127.0.0.1:0".parse()?, cfg)?;
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
