//! The counted figures of `dray bench peer`: work that does not move with the
//! host's steal or page reporting, per GiB, for each path (the agent, raw
//! quinn, TCP with rustls).
//!
//! - User-space instructions, each side apart: both processes run under
//!   valgrind's cachegrind, which counts every instruction they execute,
//!   with fair thread scheduling (see [`Counter::wrap`]).
//!   Of those, the SHA-256 of the blob's digest is reported apart
//!   (`..._digest_...`): valgrind does not emulate the SHA extensions, so
//!   under it the `sha2` crate takes its software rounds (about 55
//!   instructions a byte), while natively, on a CPU with SHA-NI, it takes
//!   the hardware ones. The figure without it is the one that compares.
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
//! out. The instructions of the second and the third unit, the digest's
//! left out, are compared, and how far apart they are is reported for each
//! path (`<path>_instructions_disagreement_pct`, the larger side's) and over
//! all (`instructions_disagreement_pct`): a claim about two paths holds only
//! if it holds at the unfavourable end of each one's spread.

use crate::bench::peer::{Mode, PATHS, Placement, Sender, TuningArgs, side_command};
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
/// `<path>_datagrams_per_gib` (UDP paths), and
/// `<path>_instructions_disagreement_pct` (how far apart its second and
/// third unit's instructions are, the digest's left out, percent of their
/// mean, the larger side's).
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
                // Valgrind runs one thread at a time; by default a thread
                // spinning on a lock (sled's lazy statics spin) may keep
                // the core from the one holding it for whole timeslices, so
                // the count grew with wall time: one agent receiver's
                // count differed by 1.07e9 between two equal runs, all of
                // it in `sled::lazy::Lazy::deref`. Fair scheduling hands
                // the core round.
                "--fair-sched=yes".into(),
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

/// Where the blob digest's SHA-256 rounds run (the `sha2` crate's functions).
const DIGEST_FUNCTIONS: &str = "sha2::sha256";

/// The instructions a cachegrind output file counts in functions whose
/// name contains `name` (the lines after each `fn=` are `line count`).
fn cachegrind_in(text: &str, name: &str) -> u64 {
    let mut inside = false;
    let mut n = 0;
    for l in text.lines() {
        if let Some(f) = l.strip_prefix("fn=") {
            inside = f.contains(name);
        } else if l.starts_with("summary:") {
            inside = false;
        } else if inside {
            n += l
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    n
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
    if place.net == crate::bench::peer::Net::Veth {
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

/// One run's counts: each side's, and the datagrams sent.
struct Counts {
    sender: u64,
    receiver: u64,
    /// Of the instructions, those of the blob digest's SHA-256.
    sender_digest: u64,
    receiver_digest: u64,
    datagrams: u64,
}

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
    let digest = |out: &Path| -> Result<u64> {
        Ok(match counter {
            Counter::Instructions => {
                cachegrind_in(&std::fs::read_to_string(out)?, DIGEST_FUNCTIONS)
            }
            Counter::Syscalls => 0,
        })
    };
    Ok(Counts {
        sender: counter.read(&send_out)?,
        receiver: counter.read(&recv_out)?,
        sender_digest: digest(&send_out)?,
        receiver_digest: digest(&recv_out)?,
        datagrams: d1.saturating_sub(d0),
    })
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
            let run = (mode, k * unit, Counter::Syscalls);
            sys.push(counted_run(dir, place, tuning, run).await?);
        }
        let mut instr = vec![];
        for k in 1..=3 {
            let run = (mode, k * unit, Counter::Instructions);
            instr.push(counted_run(dir, place, tuning, run).await?);
        }
        let mut path_disagreement = 0.0f64;
        for side in ["sender", "receiver"] {
            let of = |c: &Counts| match side {
                "sender" => (c.sender, c.sender_digest),
                _ => (c.receiver, c.receiver_digest),
            };
            let at = |k: usize| of(&instr[k]).0;
            // The digest's software rounds are the same for every byte and
            // are left out of the comparison, so they must not hide the
            // spread of the rest.
            let rest = |k: usize| (at(k) - of(&instr[k]).1) as f64;
            let (second, third) = (rest(1) - rest(0), rest(2) - rest(1));
            path_disagreement =
                path_disagreement.max(100.0 * (second - third).abs() / ((second + third) / 2.0));
            figures.insert(
                format!("{key}_instructions_per_gib_{side}"),
                per_gib(at(0), at(2)),
            );
            let digest = |k: usize| of(&instr[k]).1;
            figures.insert(
                format!("{key}_digest_instructions_per_gib_{side}"),
                per_gib(digest(0), digest(2)),
            );
        }
        figures.insert(
            format!("{key}_instructions_disagreement_pct"),
            path_disagreement,
        );
        disagreement = disagreement.max(path_disagreement);
        let both = |c: &Counts| c.sender + c.receiver;
        figures.insert(
            format!("{key}_syscalls_per_gib"),
            per_gib(both(&sys[0]), both(&sys[1])),
        );
        if mode != Mode::Tls {
            figures.insert(
                format!("{key}_datagrams_per_gib"),
                per_gib(sys[0].datagrams, sys[1].datagrams),
            );
        }
    }
    Ok(Counted {
        counted_unit_bytes: unit,
        instructions_disagreement_pct: disagreement,
        figures,
    })
}

/// Instructions per GiB of `path`, both sides, `without_digest` its SHA-256.
pub(crate) fn both_sides(c: &Counted, path: &str, without_digest: bool) -> f64 {
    ["sender", "receiver"]
        .iter()
        .map(|side| {
            let f = |figure: &str| c.figures[&format!("{path}_{figure}_per_gib_{side}")];
            let digest = if without_digest {
                f("digest_instructions")
            } else {
                0.0
            };
            f("instructions") - digest
        })
        .sum()
}

pub(crate) fn print_table(c: &Counted) {
    println!(
        "counted over runs of 1, 2 and 3 x {} bytes, per GiB (the 2nd and 3rd unit's instructions agree within {:.2}%)",
        c.counted_unit_bytes, c.instructions_disagreement_pct
    );
    println!(
        "path       instructions sender  receiver  of them SHA-256 (software under valgrind)     syscalls    datagrams"
    );
    for (key, _) in PATHS {
        let f = |figure: &str| c.figures.get(&format!("{key}_{figure}")).copied();
        println!(
            "{key:<10} {:>19.3e} {:>9.3e} {:>43.3e} {:>12.0} {:>12}",
            f("instructions_per_gib_sender").unwrap_or(0.0),
            f("instructions_per_gib_receiver").unwrap_or(0.0),
            f("digest_instructions_per_gib_sender").unwrap_or(0.0)
                + f("digest_instructions_per_gib_receiver").unwrap_or(0.0),
            f("syscalls_per_gib").unwrap_or(0.0),
            f("datagrams_per_gib").map_or("-".into(), |d| format!("{d:.0}")),
        );
    }
    println!(
        "agent / quinn instructions, both sides: {:.3}; without the digest's SHA-256: {:.3}",
        both_sides(c, "agent", false) / both_sides(c, "quinn", false),
        both_sides(c, "agent", true) / both_sides(c, "quinn", true)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_counts_of_cachegrind_perf_and_snmp() {
        let cg = "desc: I1 cache:\ncmd: dray\nevents: Ir\nfl=x\n1 2\nsummary: 123456789\n";
        assert_eq!(cachegrind_total(cg), Some(123_456_789));
        let cg = "events: Ir\nfl=a.rs\nfn=sha2::sha256::soft::compress\n10 300\n11 20\nfn=other\n3 5\nfl=b.rs\nfn=sha2::sha256::x\n1 7\nsummary: 332\n";
        assert_eq!(cachegrind_in(cg, DIGEST_FUNCTIONS), 327);
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
