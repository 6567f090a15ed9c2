//! The counted figures of `dray bench peer`: work that does not move with the
//! host's steal or page reporting, per GiB, for each path (the agent, raw
//! quinn, TCP with rustls).
//!
//! - User-space instructions, each side apart: both processes run under
//!   valgrind's cachegrind, which counts every instruction they execute.
//! - Syscalls, both sides summed: both processes run under `perf stat` on the
//!   `raw_syscalls:sys_enter` tracepoint (a kernel counter, no ptrace stop per
//!   call, so the batching is the one of an unwatched run).
//! - UDP datagrams sent, both sides summed: `Udp: OutDatagrams` of
//!   `/proc/<pid>/net/snmp` of each side's namespace (on loopback, one
//!   namespace holds both; other UDP traffic of the host is counted too).
//!
//! Every figure is a difference: each path moves 1, 2 and 3 units (runs of
//! `size`, `2 size`, `3 size` bytes), and the figure is what the third unit
//! cost over the first, so process start, handshakes and store opening fall
//! out. The instructions of the second and the third unit are compared, and
//! how far apart they are is reported (`instructions_disagreement_pct`, the
//! largest over paths and sides).

use crate::bench_peer::{Mode, PATHS, Placement, Sender, TuningArgs, side_command};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

const GIB: f64 = (1u64 << 30) as f64;
/// The longest one counted run may take (cachegrind is ~50x slower).
const RUN_TIMEOUT: Duration = Duration::from_secs(1800);

/// The counted figures: `<path>_instructions_per_gib_sender`,
/// `<path>_instructions_per_gib_receiver`, `<path>_syscalls_per_gib`,
/// `<path>_datagrams_per_gib` (UDP paths).
#[derive(Serialize)]
pub(crate) struct Counted {
    counted_unit_bytes: u64,
    /// The largest difference between the second and the third unit's
    /// instructions, percent of their mean, over paths and sides.
    instructions_disagreement_pct: f64,
    #[serde(flatten)]
    figures: BTreeMap<String, f64>,
}

/// What one run was counted under.
#[derive(Clone, Copy)]
enum Counter {
    Instructions,
    Syscalls,
}

impl Counter {
    /// The command prefix that counts a process, writing to `out`.
    fn wrap(self, out: &Path) -> Vec<String> {
        let out = out.display().to_string();
        match self {
            Counter::Instructions => vec![
                "valgrind".into(),
                "-q".into(),
                "--tool=cachegrind".into(),
                "--cache-sim=no".into(),
                format!("--cachegrind-out-file={out}"),
            ],
            Counter::Syscalls => ["perf", "stat", "-e", SYSCALL_EVENT, "-x,", "-o", &out, "--"]
                .map(String::from)
                .to_vec(),
        }
    }

    /// The count a finished run left in `out`.
    fn read(self, out: &Path) -> Result<u64> {
        let text =
            std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
        let n = match self {
            Counter::Instructions => cachegrind_total(&text),
            Counter::Syscalls => perf_count(&text),
        };
        n.with_context(|| format!("no count in {}: {text:?}", out.display()))
    }
}

const SYSCALL_EVENT: &str = "raw_syscalls:sys_enter";

/// The instructions of a cachegrind output file (its `summary:` line).
fn cachegrind_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("summary:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The count of `perf stat -x,` output for the syscall event (its first field).
fn perf_count(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.contains(SYSCALL_EVENT))
        .and_then(|l| l.split(',').next()?.parse().ok())
}

/// `OutDatagrams` of the `Udp:` table of a `/proc/net/snmp` file.
fn udp_out_datagrams(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    let i = names.split_whitespace().position(|n| n == "OutDatagrams")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// UDP datagrams sent so far in this process's namespace and, on a veth
/// pair, in the sender's.
fn datagrams(place: &Placement, sender_pid: u32) -> Result<u64> {
    let mut pids = vec!["self".to_string()];
    if place.net == crate::bench_peer::Net::Veth {
        pids.push(sender_pid.to_string());
    }
    pids.iter()
        .map(|pid| {
            let path = format!("/proc/{pid}/net/snmp");
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
            udp_out_datagrams(&text).with_context(|| format!("no Udp OutDatagrams in {path}"))
        })
        .sum()
}

/// One run's counts: sender, receiver, datagrams sent.
type Counts = (u64, u64, u64);

/// Moves `size` bytes over `mode` with both sides under `counter`.
async fn counted_run(
    dir: &Path,
    place: &Placement,
    tuning: &TuningArgs,
    (mode, size, counter): (Mode, u64, Counter),
) -> Result<Counts> {
    let (send_out, recv_out) = (dir.join("count-send"), dir.join("count-recv"));
    let mut wrap = place.sender_wrap();
    wrap.extend(counter.wrap(&send_out));
    let sender = Sender::start(mode, dir, size, tuning, &wrap, place.sender_ip)?;
    let d0 = datagrams(place, sender.pid())?;
    let mut receiver = side_command(
        &counter.wrap(&recv_out),
        "peer-recv",
        mode,
        dir,
        size,
        tuning,
    )?;
    receiver
        .arg("--addr")
        .arg(sender.addr.to_string())
        .arg("--bind")
        .arg(place.receiver_ip.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let status = tokio::time::timeout(
        RUN_TIMEOUT,
        tokio::process::Command::from(receiver)
            .kill_on_drop(true)
            .status(),
    )
    .await
    .with_context(|| format!("the {mode:?} receiver of {size} bytes took over {RUN_TIMEOUT:?}"))?
    .context("running the receiving process")?;
    if !status.success() {
        bail!("the {mode:?} receiver of {size} bytes failed: {status}");
    }
    let d1 = datagrams(place, sender.pid())?;
    sender.stop()?;
    let recv_store = dir.join("recv");
    if recv_store.exists() {
        std::fs::remove_dir_all(&recv_store)?;
    }
    Ok((
        counter.read(&send_out)?,
        counter.read(&recv_out)?,
        d1.saturating_sub(d0),
    ))
}

/// Counts every path; `unit` is the size of the smallest run.
pub(crate) async fn run(
    dir: &Path,
    place: &Placement,
    tuning: &TuningArgs,
    unit: u64,
) -> Result<Counted> {
    let mut tuning = tuning.clone();
    tuning.patient = true;
    let tuning = &tuning;
    let per_gib = |first: u64, last: u64| (last as f64 - first as f64) / (2 * unit) as f64 * GIB;
    let mut figures = BTreeMap::new();
    let mut disagreement = 0.0f64;
    for (key, mode) in PATHS {
        let mut sys = vec![];
        for k in [1, 3] {
            sys.push(counted_run(dir, place, tuning, (mode, k * unit, Counter::Syscalls)).await?);
        }
        let mut instr = vec![];
        for k in 1..=3 {
            instr.push(
                counted_run(dir, place, tuning, (mode, k * unit, Counter::Instructions)).await?,
            );
        }
        for (side, of) in [("sender", 0), ("receiver", 1)] {
            let at = |k: usize| if of == 0 { instr[k].0 } else { instr[k].1 };
            let (second, third) = (at(1) as f64 - at(0) as f64, at(2) as f64 - at(1) as f64);
            disagreement =
                disagreement.max(100.0 * (second - third).abs() / ((second + third) / 2.0));
            figures.insert(
                format!("{key}_instructions_per_gib_{side}"),
                per_gib(at(0), at(2)),
            );
        }
        figures.insert(
            format!("{key}_syscalls_per_gib"),
            per_gib(sys[0].0 + sys[0].1, sys[1].0 + sys[1].1),
        );
        if mode != Mode::Tls {
            figures.insert(
                format!("{key}_datagrams_per_gib"),
                per_gib(sys[0].2, sys[1].2),
            );
        }
    }
    Ok(Counted {
        counted_unit_bytes: unit,
        instructions_disagreement_pct: disagreement,
        figures,
    })
}

pub(crate) fn print_table(c: &Counted) {
    println!(
        "counted over runs of 1, 2 and 3 x {} bytes, per GiB (the 2nd and 3rd unit's instructions agree within {:.2}%)",
        c.counted_unit_bytes, c.instructions_disagreement_pct
    );
    println!("path       instructions sender  receiver     syscalls    datagrams");
    for (key, _) in PATHS {
        let f = |figure: &str| c.figures.get(&format!("{key}_{figure}")).copied();
        println!(
            "{key:<10} {:>19.3e} {:>9.3e} {:>12.0} {:>12}",
            f("instructions_per_gib_sender").unwrap_or(0.0),
            f("instructions_per_gib_receiver").unwrap_or(0.0),
            f("syscalls_per_gib").unwrap_or(0.0),
            f("datagrams_per_gib").map_or("-".into(), |d| format!("{d:.0}")),
        );
    }
    let sum = |key: &str| {
        ["sender", "receiver"]
            .iter()
            .map(|side| c.figures[&format!("{key}_instructions_per_gib_{side}")])
            .sum::<f64>()
    };
    println!(
        "agent / quinn instructions, both sides: {:.3}",
        sum("agent") / sum("quinn")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_counts_of_cachegrind_perf_and_snmp() {
        let cg = "desc: I1 cache:\ncmd: dray\nevents: Ir\nfl=x\n1 2\nsummary: 123456789\n";
        assert_eq!(cachegrind_total(cg), Some(123_456_789));
        let perf = "# started on x\n\n144,,raw_syscalls:sys_enter,1351548,100.00,,\n";
        assert_eq!(perf_count(perf), Some(144));
        assert_eq!(
            perf_count("<not supported>,,raw_syscalls:sys_enter,0,100.00,,"),
            None
        );
        let snmp = "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\nUdp: 10 2 0 77 0\nUdpLite: InDatagrams NoPorts InErrors OutDatagrams\nUdpLite: 0 0 0 5\n";
        assert_eq!(udp_out_datagrams(snmp), Some(77));
    }
}
