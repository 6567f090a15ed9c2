//! `dray bench unpack --giant`: one giant gzip layer (issue 38), decoded by
//! the serial path (flate2 on zlib-rs), by the unpacker's parallel decoder at
//! 1, 2, 4, 8 and 16 threads, and by the `rapidgzip` command-line decoder at
//! the same widths, on the same blobs (`gzip -6` and `pigz` of one generated
//! layer). Every decode runs in a child process (`--decode`), so its CPU time
//! is its own; instructions come from valgrind's cachegrind on a smaller
//! slice of the same content, scaled to a GiB. On a 2-core machine the wider
//! runs are oversubscribed, which is fine for counted work; the wall-clock
//! figure is the 2-thread one only.

use crate::bench::emit;
use anyhow::{Context, Result, bail};
use dray_agent::unpack::{ParallelGzipReader, UnpackLimits};
use dray_testkit::layer_content::{Mix, write_layer_tar};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const PROJECTED_CORES: [usize; 4] = [4, 8, 16, 32];
const WALL_ROUNDS: usize = 5;
const GIB: f64 = (1u64 << 30) as f64;
const MIX: Mix = Mix {
    small_text: 25,
    large_text: 30,
    binary: 20,
};
const PROJECTION: &str = "projected_speedup(P) = W_serial / (S + (W - S) / P): W = total CPU \
    seconds of our decoder at min(P, 16) threads, S = its serial part (CPU of the threads that are \
    not decode workers: the reader's in-order hand-off and the coordinator that resolves windows), \
    W_serial = CPU seconds of the serial zlib-rs path. Assumes CPU work measured oversubscribed here \
    is the work on P idle cores, no memory-bandwidth limit, and the serial part on the critical path";
const SERIAL_FRACTION_METHOD: &str = "CPU time of the calling thread (clock_gettime \
    THREAD_CPUTIME) plus the crate's auxiliary threads (cpu-accounting), over the decode's whole CPU";

/// What one decode in a child process reports (`--decode`).
#[derive(Serialize, Deserialize)]
pub struct DecodeRun {
    pub bytes: u64,
    /// CPU of the thread that read the decoded stream.
    pub caller_cpu_s: f64,
    /// CPU of the decoder's threads that are not workers (coordinator).
    pub auxiliary_cpu_s: f64,
    pub route: String,
}

/// The child side: decodes `file` to nothing, with the serial path
/// (`threads` 0) or the parallel decoder, and prints a [`DecodeRun`].
pub fn decode(file: &Path, threads: usize) -> Result<()> {
    let f = std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let len = f.metadata()?.len();
    let sink = |r: &mut dyn Read| std::io::copy(r, &mut std::io::sink());
    let (bytes, auxiliary_cpu_s, route) = if threads == 0 {
        let bytes = sink(&mut flate2::read::MultiGzDecoder::new(
            std::io::BufReader::new(f),
        ))?;
        (bytes, 0.0, "serial".to_string())
    } else {
        let mut r = ParallelGzipReader::start(f, len, threads, &UnpackLimits::default())?;
        let handle = r.handle();
        let bytes = sink(&mut r)?;
        drop(r);
        let stats = handle.stats();
        let aux = stats
            .completed_auxiliary_cpu_time
            .map_or(0.0, |d| d.as_secs_f64());
        (bytes, aux, format!("{:?}", stats.path))
    };
    let run = DecodeRun {
        bytes,
        caller_cpu_s: thread_cpu_s(),
        auxiliary_cpu_s,
        route,
    };
    println!("{}", serde_json::to_string(&run)?);
    Ok(())
}

fn thread_cpu_s() -> f64 {
    // SAFETY: clock_gettime fills the timespec we pass.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// A decoder under test.
#[derive(Clone, Copy, Debug)]
enum Decoder {
    /// flate2 on zlib-rs, one thread: today's path.
    Serial,
    /// The unpacker's parallel decoder at this many threads.
    Ours(usize),
    /// The `rapidgzip` command line at this many threads.
    Rapidgzip(usize),
}

/// One decode's cost, measured from outside the child.
struct Measured {
    wall_s: f64,
    cpu_s: f64,
    run: Option<DecodeRun>,
}

fn command(d: Decoder, file: &Path, rapidgzip: &Path) -> Result<Command> {
    let mut c;
    match d {
        Decoder::Serial | Decoder::Ours(_) => {
            c = Command::new(std::env::current_exe()?);
            let threads = match d {
                Decoder::Ours(t) => t,
                _ => 0,
            };
            c.args(["bench", "unpack", "--decode"])
                .arg(file)
                .args(["--threads", &threads.to_string()]);
        }
        Decoder::Rapidgzip(t) => {
            c = Command::new(rapidgzip);
            c.args(["-d", "-c", "-P", &t.to_string()]).arg(file);
        }
    }
    Ok(c)
}

/// Runs `d` on `file` in a child: wall time, the child's CPU (user +
/// system, from wait4) and what it reported.
fn measure(d: Decoder, file: &Path, rapidgzip: &Path) -> Result<Measured> {
    let started = Instant::now();
    let mut child = command(d, file, rapidgzip)?
        .stdout(match d {
            Decoder::Rapidgzip(_) => Stdio::null(),
            _ => Stdio::piped(),
        })
        .spawn()
        .with_context(|| format!("starting {d:?}"))?;
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut out)?;
    }
    // SAFETY: wait4 on our own child, filling the rusage we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let mut status = 0;
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    let wall_s = started.elapsed().as_secs_f64();
    if pid < 0 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("{d:?} on {} failed (status {status})", file.display());
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Measured {
        wall_s,
        cpu_s: tv(ru.ru_utime) + tv(ru.ru_stime),
        run: match d {
            Decoder::Rapidgzip(_) => None,
            _ => Some(serde_json::from_str(out.trim()).context("the child's report")?),
        },
    })
}

/// User-space instructions of `d` on `file` (cachegrind, no cache model).
fn instructions(d: Decoder, file: &Path, rapidgzip: &Path) -> Result<u64> {
    let c = command(d, file, rapidgzip)?;
    let out = Command::new("valgrind")
        .args([
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
        ])
        .arg(c.get_program())
        .args(c.get_args())
        .stdout(Stdio::null())
        .output()
        .context("running valgrind")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("cachegrind of {d:?} failed: {err}");
    }
    err.lines()
        .find_map(|l| {
            let (_, rest) = l.split_once("== I")?;
            Some(rest.trim().strip_prefix("refs:")?.trim().replace(',', ""))
        })
        .context("no `I refs` in cachegrind's output")?
        .parse()
        .context("cachegrind's instruction count")
}

#[derive(Serialize)]
struct Rapidgzip {
    threads: Vec<usize>,
    instructions_per_gib: Vec<f64>,
    cpu_s_per_gib: Vec<f64>,
    /// CPU work / the serial zlib-rs path's.
    work_inflation: Vec<f64>,
    /// Instructions / the serial path's.
    instructions_inflation: Vec<f64>,
    /// Karp-Flatt serial fraction from its 2-thread wall speedup S2 over
    /// itself: e = 2 / S2 - 1 (the serial part of its own work, the
    /// oversubscription and this machine's load included).
    serial_fraction: f64,
    /// As ours: serial CPU-s over W_serial / (e W + (1 - e) W / P), W its
    /// CPU work at min(P, 16) threads.
    projected_speedup: BTreeMap<usize, f64>,
}

#[derive(Serialize)]
struct WallRounds {
    rounds: usize,
    serial_s_median: f64,
    parallel_s_median: f64,
    /// serial / parallel per round: median, least, most.
    speedup_median: f64,
    speedup_min: f64,
    speedup_max: f64,
    /// rapidgzip -P 1 and -P 2 in the same rounds, and its 2-thread speedup
    /// over its own 1-thread run (median, least, most).
    rapidgzip_1_s_median: Option<f64>,
    rapidgzip_2_s_median: Option<f64>,
    rapidgzip_speedup: Option<[f64; 3]>,
}

#[derive(Serialize)]
struct GiantRow {
    compression: &'static str,
    compressor: &'static str,
    compressed_bytes: u64,
    uncompressed_bytes: u64,
    /// Serial zlib-rs through flate2 (`MultiGzDecoder`), today's path.
    serial_instructions_per_gib: f64,
    serial_cpu_s_per_gib: f64,
    /// Our decoder, one entry per `threads`.
    threads: Vec<usize>,
    route: Vec<String>,
    instructions_per_gib: Vec<f64>,
    cpu_s_per_gib: Vec<f64>,
    work_inflation: Vec<f64>,
    instructions_inflation: Vec<f64>,
    serial_fraction: Vec<f64>,
    /// Cores -> projected speedup over the serial path (`projection`).
    projected_speedup: BTreeMap<usize, f64>,
    rapidgzip: Option<Rapidgzip>,
    wall_2_threads: WallRounds,
    /// Not measured: the pull-while-unpacking case of a giant layer needs the
    /// picker to fetch the chunks the decoder reads ahead first (not built).
    overlap_ratio: Option<f64>,
}

#[derive(Serialize)]
struct GiantResult {
    cores: usize,
    slice_uncompressed_bytes: u64,
    instructions_method: String,
    serial_fraction_method: &'static str,
    projection: &'static str,
    results: Vec<GiantRow>,
}

fn compress(tool: &str, src: &Path, dst: &Path) -> Result<()> {
    let mut c = Command::new(tool);
    if tool == "gzip" {
        c.arg("-6");
    }
    let ok = c
        .arg("-c")
        .arg(src)
        .stdout(std::fs::File::create(dst)?)
        .status()
        .with_context(|| format!("running {tool}"))?;
    if !ok.success() {
        bail!("{tool} failed");
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `dray bench unpack --giant`.
pub fn run(giant_mib: u64, slice_mib: u64, rapidgzip: Option<PathBuf>, json: bool) -> Result<()> {
    let dir = tempfile::tempdir_in("/var/tmp").context("creating a temporary directory")?;
    let w = dir.path();
    let (tar, slice) = (w.join("giant.tar"), w.join("slice.tar"));
    write_layer_tar(&tar, "giant", giant_mib << 20, MIX, 38)?;
    write_layer_tar(&slice, "giant", slice_mib << 20, MIX, 38)?;
    let rapidgzip = rapidgzip.filter(|p| p.exists());
    let rg = rapidgzip.clone().unwrap_or_default();
    // The fixed cost of starting each decoder (a process, an interpreter for
    // rapidgzip's), from an empty stream, comes off every instruction count.
    let empty = w.join("empty.tar");
    std::fs::write(&empty, [0u8; 1024])?;
    let mut results = Vec::new();
    for (compressor, tool) in [("gzip -6", "gzip"), ("pigz", "pigz")] {
        let (blob, slice_blob, empty_blob) = (
            w.join(format!("giant.{tool}.gz")),
            w.join(format!("slice.{tool}.gz")),
            w.join(format!("empty.{tool}.gz")),
        );
        compress(tool, &tar, &blob)?;
        compress(tool, &slice, &slice_blob)?;
        compress(tool, &empty, &empty_blob)?;
        let slice_bytes = std::fs::metadata(&slice)?.len() as f64;
        let per_gib = |d: Decoder| -> Result<f64> {
            let n = instructions(d, &slice_blob, &rg)? as f64;
            let base = instructions(d, &empty_blob, &rg)? as f64;
            Ok((n - base).max(0.0) * GIB / slice_bytes)
        };
        let serial = measure(Decoder::Serial, &blob, &rg)?;
        let uncompressed = serial.run.as_ref().map_or(0, |r| r.bytes);
        let gib = uncompressed as f64 / GIB;
        let serial_instr = per_gib(Decoder::Serial)?;
        let mut row = GiantRow {
            compression: "gzip-giant",
            compressor,
            compressed_bytes: std::fs::metadata(&blob)?.len(),
            uncompressed_bytes: uncompressed,
            serial_instructions_per_gib: serial_instr,
            serial_cpu_s_per_gib: serial.cpu_s / gib,
            threads: THREADS.to_vec(),
            route: Vec::new(),
            instructions_per_gib: Vec::new(),
            cpu_s_per_gib: Vec::new(),
            work_inflation: Vec::new(),
            instructions_inflation: Vec::new(),
            serial_fraction: Vec::new(),
            projected_speedup: BTreeMap::new(),
            rapidgzip: None,
            wall_2_threads: wall_rounds(&blob, rapidgzip.as_deref())?,
            overlap_ratio: None,
        };
        let mut work = Vec::new();
        for t in THREADS {
            let m = measure(Decoder::Ours(t), &blob, &rg)?;
            let run = m.run.context("our decoder's report")?;
            if run.bytes != uncompressed {
                bail!(
                    "{t} threads decoded {} bytes, the serial path {uncompressed}",
                    run.bytes
                );
            }
            let instr = per_gib(Decoder::Ours(t))?;
            let serial_part = (run.caller_cpu_s + run.auxiliary_cpu_s).min(m.cpu_s);
            row.route.push(run.route);
            row.instructions_per_gib.push(instr);
            row.cpu_s_per_gib.push(m.cpu_s / gib);
            row.work_inflation.push(m.cpu_s / serial.cpu_s);
            row.instructions_inflation.push(instr / serial_instr);
            row.serial_fraction.push(serial_part / m.cpu_s);
            work.push((t, m.cpu_s, serial_part));
        }
        row.projected_speedup = project(serial.cpu_s, &work);
        if let Some([s2, ..]) = row.wall_2_threads.rapidgzip_speedup {
            let e = (2.0 / s2 - 1.0).clamp(0.0, 1.0);
            let mut r = Rapidgzip {
                threads: THREADS.to_vec(),
                instructions_per_gib: Vec::new(),
                cpu_s_per_gib: Vec::new(),
                work_inflation: Vec::new(),
                instructions_inflation: Vec::new(),
                serial_fraction: e,
                projected_speedup: BTreeMap::new(),
            };
            let mut work = Vec::new();
            for t in THREADS {
                let m = measure(Decoder::Rapidgzip(t), &blob, &rg)?;
                let instr = per_gib(Decoder::Rapidgzip(t))?;
                r.instructions_per_gib.push(instr);
                r.cpu_s_per_gib.push(m.cpu_s / gib);
                r.work_inflation.push(m.cpu_s / serial.cpu_s);
                r.instructions_inflation.push(instr / serial_instr);
                work.push((t, m.cpu_s, e * m.cpu_s));
            }
            r.projected_speedup = project(serial.cpu_s, &work);
            row.rapidgzip = Some(r);
        }
        results.push(row);
        for f in [&blob, &slice_blob, &empty_blob] {
            std::fs::remove_file(f)?;
        }
    }
    let r = GiantResult {
        cores: dray_agent::unpack::cores(),
        slice_uncompressed_bytes: std::fs::metadata(&slice)?.len(),
        instructions_method: format!(
            "valgrind cachegrind (--cache-sim=no) `I refs` of each decoder on a {slice_mib} MiB \
             slice of the same content compressed the same way, less its run on an empty stream, \
             scaled to a GiB of tar"
        ),
        serial_fraction_method: SERIAL_FRACTION_METHOD,
        projection: PROJECTION,
        results,
    };
    emit(json, &r, print_table)
}

/// The serial path and our decoder at 2 threads, interleaved, `WALL_ROUNDS`
/// times.
fn wall_rounds(blob: &Path, rg: Option<&Path>) -> Result<WallRounds> {
    let (mut serial, mut parallel, mut speedup) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rg1, mut rg2, mut rg_speedup) = (Vec::new(), Vec::new(), Vec::new());
    let none = PathBuf::new();
    for _ in 0..WALL_ROUNDS {
        let s = measure(Decoder::Serial, blob, &none)?.wall_s;
        let p = measure(Decoder::Ours(2), blob, &none)?.wall_s;
        serial.push(s);
        parallel.push(p);
        speedup.push(s / p);
        if let Some(rg) = rg {
            let one = measure(Decoder::Rapidgzip(1), blob, rg)?.wall_s;
            let two = measure(Decoder::Rapidgzip(2), blob, rg)?.wall_s;
            rg1.push(one);
            rg2.push(two);
            rg_speedup.push(one / two);
        }
    }
    let spread = |v: &[f64]| {
        [
            median(v.to_vec()),
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(0.0, f64::max),
        ]
    };
    let [speedup_median, speedup_min, speedup_max] = spread(&speedup);
    let measured = rg.is_some();
    Ok(WallRounds {
        rounds: WALL_ROUNDS,
        serial_s_median: median(serial),
        parallel_s_median: median(parallel),
        speedup_median,
        speedup_min,
        speedup_max,
        rapidgzip_1_s_median: measured.then(|| median(rg1)),
        rapidgzip_2_s_median: measured.then(|| median(rg2)),
        rapidgzip_speedup: measured.then(|| spread(&rg_speedup)),
    })
}

/// W_serial / (s + (W - s) / P) for each projected P, `work` holding
/// (threads, W, s) by threads.
fn project(serial_cpu_s: f64, work: &[(usize, f64, f64)]) -> BTreeMap<usize, f64> {
    PROJECTED_CORES
        .iter()
        .map(|&p| {
            let &(_, total, s) = work
                .iter()
                .rev()
                .find(|(t, ..)| *t <= p)
                .expect("1 thread measured");
            (p, serial_cpu_s / (s + (total - s) / p as f64))
        })
        .collect()
}

fn print_table(r: &GiantResult) {
    println!(
        "one giant gzip layer on {} cores; instructions: {}",
        r.cores, r.instructions_method
    );
    for row in &r.results {
        println!(
            "\n{}: {} -> {} bytes; serial zlib-rs {:.2} CPU-s/GiB, {:.2e} instr/GiB",
            row.compressor,
            row.compressed_bytes,
            row.uncompressed_bytes,
            row.serial_cpu_s_per_gib,
            row.serial_instructions_per_gib
        );
        println!("threads  route         CPU-s/GiB  instr/GiB  inflation(cpu, instr)  serial part");
        for i in 0..row.threads.len() {
            println!(
                "{:>7}  {:<12}  {:>9.2}  {:>9.2e}  {:>9.2} {:>9.2}  {:>11.3}",
                row.threads[i],
                row.route[i],
                row.cpu_s_per_gib[i],
                row.instructions_per_gib[i],
                row.work_inflation[i],
                row.instructions_inflation[i],
                row.serial_fraction[i]
            );
        }
        if let Some(rg) = &row.rapidgzip {
            for i in 0..rg.threads.len() {
                println!(
                    "rapidgzip {:>2}: {:.2} CPU-s/GiB, {:.2e} instr/GiB, inflation {:.2} (cpu) {:.2} (instr)",
                    rg.threads[i],
                    rg.cpu_s_per_gib[i],
                    rg.instructions_per_gib[i],
                    rg.work_inflation[i],
                    rg.instructions_inflation[i]
                );
            }
        }
        println!(
            "projected speedup over the serial path: {:?}",
            row.projected_speedup
        );
        let w = &row.wall_2_threads;
        println!(
            "2 threads, wall, median of {}: serial {:.2} s, parallel {:.2} s, speedup {:.2} ({:.2}-{:.2})",
            w.rounds,
            w.serial_s_median,
            w.parallel_s_median,
            w.speedup_median,
            w.speedup_min,
            w.speedup_max
        );
        if let Some(rg) = &row.rapidgzip {
            println!(
                "rapidgzip: 2-thread speedup over itself {:?}, serial fraction {:.3}, projected {:?}",
                w.rapidgzip_speedup, rg.serial_fraction, rg.projected_speedup
            );
        }
    }
    println!("\n{}", r.projection);
}
