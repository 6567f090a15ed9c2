//! `dray bench unpack`: dray's layer unpacker against containerd 1.6's own
//! unpack and against serial `tar -x`, on the same 4-layer image (gzip and
//! zstd), and the overlap of download and unpack when an agent pulls the
//! layers from the real registry and unpacks them from its store as the
//! chunks arrive, as its local API does for the snapshotter.

use crate::bench::emit;
use crate::bench::peer::{child_cpu, diff, own_cpu, total};
use anyhow::{Context, Result, bail};
use clap::Args;
use dray_agent::unpack::{Compression, unpack_layer};
use dray_testkit::layer_content::{Mix, write_layer_tar};
use dray_testkit::oci_image::{Containerd, LayerBlob, write_oci_archive};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

const LAYERS: usize = 4;

#[derive(Args)]
pub struct UnpackBench {
    /// Uncompressed size of the whole image (4 layers), MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Instead: one giant gzip layer, serial vs the parallel decoder vs
    /// rapidgzip, in counted work (see `bench_unpack_giant`).
    #[arg(long)]
    giant: bool,
    /// With --giant: uncompressed size of the layer, MiB.
    #[arg(long, default_value_t = 2048)]
    giant_mib: u64,
    /// With --giant: uncompressed size of the slice counted by cachegrind, MiB.
    #[arg(long, default_value_t = 64)]
    slice_mib: u64,
    /// With --giant: the `rapidgzip` command line (`pip install rapidgzip`);
    /// its figures are left out when it is missing.
    #[arg(long, default_value = "rapidgzip")]
    rapidgzip: PathBuf,
    /// Internal (a child of --giant): decode this gzip file to nothing.
    #[arg(long, hide = true)]
    decode: Option<PathBuf>,
    /// Internal, with --decode: 0 for the serial path, else decoder threads.
    #[arg(long, hide = true, default_value_t = 0)]
    threads: usize,
}

#[derive(Serialize)]
struct CompressionResult {
    compression: &'static str,
    compressed_bytes: u64,
    /// dray: the 4 layers at once, at most `parallel` at a time; the slower
    /// of two runs, one before the baselines and one after (`unpack_s`), as
    /// this machine's page cache makes the same run vary several-fold.
    dray_s: f64,
    /// The first of the two runs.
    dray_first_s: f64,
    /// containerd 1.6 applying the same layers (see `containerd_method`).
    containerd_s: f64,
    /// `tar -x` of each layer in turn.
    tar_s: f64,
    containerd_over_dray: f64,
    tar_over_dray: f64,
    /// The 4 blobs from the registry through a relay capped at `rate_bytes_s`.
    download_s: f64,
    /// The 4 layers unpacked from local files again, just before the pull.
    unpack_s: f64,
    /// The 4 blobs pulled by an agent (in this process, alone in its swarm)
    /// and unpacked from its store as they arrive, at most `parallel` at a
    /// time, all pulls started at once: the agent's local API's path.
    pull_unpack_s: f64,
    /// pull_unpack_s / max(download_s, unpack_s): 1 is perfect overlap.
    overlap_ratio: f64,
    /// CPU seconds (user + system) of the timed download (this process and
    /// the registry's), of the unpack from local files (`unpack_s`), and of
    /// the agent's pull and unpack together (`pull_unpack_s`).
    download_cpu_s: f64,
    unpack_cpu_s: f64,
    pull_unpack_cpu_s: f64,
    /// (download_cpu_s + unpack_cpu_s) / parallel: the least time both can
    /// take together on this machine's cores, however well they overlap.
    cpu_floor_s: f64,
    /// pull_unpack_s / max(download_s, unpack_s, cpu_floor_s): overlap
    /// lost to anything but a lack of cores.
    overlap_vs_cpu_floor: f64,
    rate_bytes_s: u64,
}

#[derive(Serialize)]
struct UnpackResult {
    uncompressed_bytes: u64,
    files: u64,
    parallel: usize,
    containerd_method: &'static str,
    rate_method: &'static str,
    results: Vec<CompressionResult>,
}

const CONTAINERD_METHOD: &str = "a private containerd 1.6 (overlayfs snapshotter) per compression; \
    `ctr images import --no-unpack` of the OCI archive loads the content, then the same import is \
    timed again with --no-unpack (archive read, content already present) and with unpack: \
    containerd_s is the difference";
const RATE_METHOD: &str = "the relay's total rate is set so that downloading the 4 blobs takes \
    about as long as unpacking them (compressed bytes / unpack_s), the case where overlap matters most";

pub async fn run(b: UnpackBench) -> Result<()> {
    if let Some(file) = &b.decode {
        return crate::bench::unpack_giant::decode(file, b.threads);
    }
    if b.giant {
        let rapidgzip = which(&b.rapidgzip);
        let (mib, slice, json) = (b.giant_mib, b.slice_mib, b.json);
        return tokio::task::spawn_blocking(move || {
            crate::bench::unpack_giant::run(mib, slice, rapidgzip, json)
        })
        .await?;
    }
    if b.size_mib < LAYERS as u64 {
        bail!("--size-mib must be at least {LAYERS}");
    }
    let parallel = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir_in("/var/tmp").context("creating a temporary directory")?;
    let w = dir.path().to_path_buf();
    let per_layer = b.size_mib << 20 >> 2;
    let (tars, files) = tokio::task::spawn_blocking({
        let w = w.clone();
        move || generate_layers(&w, per_layer)
    })
    .await??;
    let mut diff_ids = Vec::new();
    for t in &tars {
        diff_ids.push(dray_testkit::oci_image::sha256_file(t)?);
    }
    let uncompressed: u64 = tars
        .iter()
        .map(|t| std::fs::metadata(t).map_or(0, |m| m.len()))
        .sum();
    let registry = dray_testkit::testbed::Registry::start(None).await;
    let mut results = Vec::new();
    for compression in [Compression::Gzip, Compression::Zstd] {
        let blobs = tokio::task::spawn_blocking({
            let (tars, w) = (tars.clone(), w.clone());
            move || compress_layers(&tars, &w, compression)
        })
        .await??;
        results.push(
            measure(&w, &registry, &blobs, &diff_ids, compression, parallel)
                .await
                .with_context(|| format!("{compression:?} layers"))?,
        );
        for blob in &blobs {
            std::fs::remove_file(blob)?;
        }
    }
    let r = UnpackResult {
        uncompressed_bytes: uncompressed,
        files,
        parallel,
        containerd_method: CONTAINERD_METHOD,
        rate_method: RATE_METHOD,
        results,
    };
    emit(b.json, &r, |r| {
        println!(
            "image: {LAYERS} layers, {} bytes uncompressed, {} files; dray unpacks {} at a time",
            r.uncompressed_bytes, r.files, r.parallel
        );
        println!("containerd_s: {}", r.containerd_method);
        println!("overlap: {}", r.rate_method);
        println!(
            "{:6} {:>12} {:>8} {:>9} {:>13} {:>7} {:>11} {:>9} {:>10} {:>9} {:>13} {:>8}",
            "",
            "compressed",
            "dray_s",
            "1st run",
            "containerd_s",
            "tar_s",
            "ctrd/dray",
            "tar/dray",
            "download_s",
            "unpack_s",
            "pull_unpack_s",
            "overlap"
        );
        for c in &r.results {
            println!(
                "{:6} {:>12} {:>8.2} {:>9.2} {:>13.2} {:>7.2} {:>11.2} {:>9.2} {:>10.2} {:>9.2} {:>13.2} {:>8.2}",
                c.compression,
                c.compressed_bytes,
                c.dray_s,
                c.dray_first_s,
                c.containerd_s,
                c.tar_s,
                c.containerd_over_dray,
                c.tar_over_dray,
                c.download_s,
                c.unpack_s,
                c.pull_unpack_s,
                c.overlap_ratio
            );
        }
        for c in &r.results {
            println!(
                "{}: CPU s download {:.2}, unpack {:.2}, pull+unpack {:.2}; cores allow {:.2} s at best: pull+unpack {:.2}x that",
                c.compression,
                c.download_cpu_s,
                c.unpack_cpu_s,
                c.pull_unpack_cpu_s,
                c.cpu_floor_s,
                c.overlap_vs_cpu_floor
            );
        }
    })
}

async fn measure(
    w: &Path,
    registry: &dray_testkit::testbed::Registry,
    blobs: &[PathBuf],
    diff_ids: &[String],
    compression: Compression,
    parallel: usize,
) -> Result<CompressionResult> {
    let name = match compression {
        Compression::Gzip => "gzip",
        Compression::Zstd => "zstd",
        Compression::None => "tar",
    };
    let compressed_bytes: u64 = blobs
        .iter()
        .map(|b| std::fs::metadata(b).map_or(0, |m| m.len()))
        .sum();

    // dray, from local files.
    let dray = || {
        let (blobs, ids, out) = (blobs.to_vec(), diff_ids.to_vec(), w.join("dray"));
        tokio::task::spawn_blocking(move || {
            settle(None)?;
            let before = own_cpu();
            let secs = unpack_files(&blobs, &ids, compression, &out, parallel)?;
            let cpu = total(diff(before, own_cpu()));
            settle(Some(&out))?;
            anyhow::Ok((secs, cpu))
        })
    };
    let dray_first_s = dray().await??.0;

    // Serial tar.
    let tar_s = tokio::task::spawn_blocking({
        let (blobs, out) = (blobs.to_vec(), w.join("tar"));
        move || {
            settle(None)?;
            let secs = serial_tar(&blobs, compression, &out)?;
            settle(Some(&out))?;
            anyhow::Ok(secs)
        }
    })
    .await??;

    // containerd.
    let containerd_s = tokio::task::spawn_blocking({
        let (blobs, ids, w) = (blobs.to_vec(), diff_ids.to_vec(), w.to_path_buf());
        move || containerd_unpack(&w, &blobs, &ids, compression)
    })
    .await??;

    // Overlap: stream from the registry into the unpacker.
    let repo = "bench/unpack";
    let mut digests = Vec::new();
    for blob in blobs {
        digests.push(registry.push(repo, blob));
    }
    let (unpack_s, unpack_cpu_s) = dray().await??;
    // This process's CPU seconds and the registry's.
    let cpu = || -> Result<f64> { Ok(total(own_cpu()) + total(child_cpu(registry.pid())?)) };
    let dray_s = dray_first_s.max(unpack_s);
    let rate = ((compressed_bytes as f64 / unpack_s) as u64).max(1);
    registry.throttle(rate);
    let client = std::sync::Arc::new(dray_agent::pull::registry::RegistryClient::new(
        &registry.url(),
        None,
    )?);
    settle(None)?;
    let (start, cpu0) = (Instant::now(), cpu()?);
    let mut tasks = Vec::new();
    for (i, d) in digests.iter().enumerate() {
        let (client, d, path) = (client.clone(), d.parse()?, w.join(format!("dl-{i}")));
        tasks.push(tokio::spawn(async move {
            client.download(repo, &d, &path).await?;
            std::fs::remove_file(&path)?;
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let (download_s, download_cpu_s) = (start.elapsed().as_secs_f64(), cpu()? - cpu0);
    let out = w.join("pulled");
    std::fs::create_dir_all(&out)?;
    let cluster = dray_testkit::cluster::LocalCluster::start(
        &w.join(format!("agent-{name}")),
        1,
        Default::default(),
        &Default::default(),
    )
    .await?;
    let pulls = cluster.pulls(0).clone();
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel));
    settle(None)?;
    let (start, cpu0) = (Instant::now(), cpu()?);
    let mut tasks = Vec::new();
    for (i, ((d, id), blob)) in digests.iter().zip(diff_ids).zip(blobs).enumerate() {
        let layer = Layer {
            digest: d.parse()?,
            size: std::fs::metadata(blob)?.len(),
            diff_id: id.clone(),
        };
        // As the agent's local API does: every download starts now, and an
        // unpack waits for a slot, then catches up with what has arrived.
        let (pull, _) = pulls
            .admit(&client, false, repo, layer.digest, layer.size)
            .await?;
        let (pulls, target, limit) = (pulls.clone(), out.join(i.to_string()), limit.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = limit.acquire_owned().await?;
            unpack_from_store(&pulls, pull, &layer, compression, &target).await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let (pull_unpack_s, pull_unpack_cpu_s) = (start.elapsed().as_secs_f64(), cpu()? - cpu0);
    let cpu_floor_s = (download_cpu_s + unpack_cpu_s) / parallel as f64;
    registry.throttle(0);
    drop(cluster);
    settle(Some(&out))?;
    Ok(CompressionResult {
        compression: name,
        compressed_bytes,
        dray_s,
        dray_first_s,
        containerd_s,
        tar_s,
        containerd_over_dray: containerd_s / dray_s,
        tar_over_dray: tar_s / dray_s,
        download_s,
        unpack_s,
        pull_unpack_s,
        overlap_ratio: pull_unpack_s / download_s.max(unpack_s),
        download_cpu_s,
        unpack_cpu_s,
        pull_unpack_cpu_s,
        cpu_floor_s,
        overlap_vs_cpu_floor: pull_unpack_s / download_s.max(unpack_s).max(cpu_floor_s),
        rate_bytes_s: rate,
    })
}

/// Removes `out` (if given) and writes back every dirty page, so that the
/// next timed phase starts from the same state whatever ran before it (on
/// this machine a gigabyte of writeback left over slows the next phase
/// several-fold).
fn settle(out: Option<&Path>) -> Result<()> {
    if let Some(out) = out {
        std::fs::remove_dir_all(out)?;
    }
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() };
    Ok(())
}

/// Unpacks every blob into `out/<i>`, at most `parallel` at once; returns the seconds taken.
fn unpack_files(
    blobs: &[PathBuf],
    diff_ids: &[String],
    compression: Compression,
    out: &Path,
    parallel: usize,
) -> Result<f64> {
    std::fs::create_dir_all(out)?;
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..parallel.min(blobs.len()))
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(blob) = blobs.get(i) else {
                            return Ok(());
                        };
                        let f = std::fs::File::open(blob)?;
                        unpack_layer(f, compression, &out.join(i.to_string()), Some(&diff_ids[i]))
                            .with_context(|| format!("unpacking {}", blob.display()))?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("unpack worker panicked"))
    })?;
    Ok(start.elapsed().as_secs_f64())
}

/// A layer blob to pull and unpack.
struct Layer {
    digest: dray_protocol::BlobDigest,
    size: u64,
    diff_id: String,
}

/// Unpacks `layer` from the agent's store as its pull brings the chunks in,
/// through the bridge the agent's local API uses (verified 1 MiB frames read
/// from the store, handed to the unpacker's blocking thread); then waits for
/// the blob's digest to hold.
async fn unpack_from_store(
    pulls: &std::sync::Arc<dray_agent::pull::Pulls>,
    pull: tokio::sync::watch::Receiver<dray_agent::pull::PullState>,
    layer: &Layer,
    compression: Compression,
    target: &Path,
) -> Result<()> {
    let (digest, size) = (layer.digest, layer.size);
    let reader = pulls.open(digest, size, 0, size, pull.clone()).await?;
    let bridge =
        tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(reader.into_stream()));
    let (target, diff_id) = (target.to_path_buf(), layer.diff_id.clone());
    tokio::task::spawn_blocking(move || unpack_layer(bridge, compression, &target, Some(&diff_id)))
        .await?
        .with_context(|| format!("unpacking {digest}"))?;
    pulls
        .open(digest, size, size, size, pull)
        .await?
        .verified()
        .await?;
    Ok(())
}

fn serial_tar(blobs: &[PathBuf], compression: Compression, out: &Path) -> Result<f64> {
    let start = Instant::now();
    for (i, blob) in blobs.iter().enumerate() {
        let dir = out.join(i.to_string());
        std::fs::create_dir_all(&dir)?;
        let mut cmd = Command::new("tar");
        match compression {
            Compression::Gzip => cmd.arg("-xzf"),
            Compression::Zstd => cmd.args(["--zstd", "-xf"]),
            Compression::None => cmd.arg("-xf"),
        };
        let status = cmd.arg(blob).arg("-C").arg(&dir).status()?;
        if !status.success() {
            bail!("tar -x of {} failed: {status}", blob.display());
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

fn containerd_unpack(
    w: &Path,
    blobs: &[PathBuf],
    diff_ids: &[String],
    compression: Compression,
) -> Result<f64> {
    let media_type = match compression {
        Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        Compression::None => "application/vnd.oci.image.layer.v1.tar",
    };
    let layers: Vec<LayerBlob> = blobs
        .iter()
        .zip(diff_ids)
        .map(|(path, id)| LayerBlob {
            path: path.clone(),
            media_type,
            diff_id: id.clone(),
        })
        .collect();
    let archive = w.join("image.tar");
    write_oci_archive(&layers, "dray.bench/unpack:1", &archive)?;
    let root = w.join("containerd");
    std::fs::create_dir_all(&root)?;
    let secs = {
        let ctrd = Containerd::start(&root).context("starting containerd")?;
        let a = archive.to_str().context("archive path")?;
        ctrd.ctr_ok(&["images", "import", "--no-unpack", a])?;
        settle(None)?;
        let t = Instant::now();
        ctrd.ctr_ok(&["images", "import", "--no-unpack", a])?;
        let without = t.elapsed().as_secs_f64();
        settle(None)?;
        let t = Instant::now();
        ctrd.ctr_ok(&["images", "import", a])?;
        let with = t.elapsed().as_secs_f64();
        let top = dray_testkit::oci_image::chain_ids(diff_ids)
            .pop()
            .context("no layers")?;
        ctrd.snapshot_dir(&top)
            .context("containerd did not unpack the image")?;
        with - without
    };
    settle(Some(&root))?;
    std::fs::remove_file(&archive)?;
    Ok(secs)
}

/// `program` as given when it names a path, else found on `PATH`.
fn which(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return Some(program.to_path_buf());
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
}

/// Compresses each tar (gzip at the default level 6, as Docker and
/// containerd write it; zstd level 3), in parallel.
fn compress_layers(tars: &[PathBuf], w: &Path, compression: Compression) -> Result<Vec<PathBuf>> {
    std::thread::scope(|s| {
        let jobs: Vec<_> = tars
            .iter()
            .map(|tar| {
                s.spawn(move || -> Result<PathBuf> {
                    let mut src = std::fs::File::open(tar)?;
                    let name = tar.file_name().context("tar name")?.to_string_lossy();
                    let (path, mut enc): (PathBuf, Box<dyn Write>) = match compression {
                        Compression::Gzip => {
                            let p = w.join(format!("{name}.gz"));
                            let f = std::fs::File::create(&p)?;
                            let e =
                                flate2::write::GzEncoder::new(f, flate2::Compression::default());
                            (p, Box::new(e))
                        }
                        Compression::Zstd => {
                            let p = w.join(format!("{name}.zst"));
                            let f = std::fs::File::create(&p)?;
                            (p, Box::new(zstd::Encoder::new(f, 3)?.auto_finish()))
                        }
                        Compression::None => bail!("nothing to compress"),
                    };
                    std::io::copy(&mut src, &mut enc)?;
                    enc.flush()?;
                    drop(enc);
                    Ok(path)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("compression worker panicked"))
            .collect()
    })
}

/// Four layer tars of `per_layer` bytes each: 30% small text files (0.5–16
/// KiB, 100 per directory), 40% large text files (4–12 MiB), 30% large
/// random files, with a few symlinks and hardlinks. Returns the tars and the
/// number of files.
fn generate_layers(w: &Path, per_layer: u64) -> Result<(Vec<PathBuf>, u64)> {
    let mix = Mix {
        small_text: 30,
        large_text: 40,
        binary: 0,
    };
    let mut files = 0;
    let mut tars = Vec::new();
    for layer in 0..LAYERS {
        let path = w.join(format!("layer{layer}.tar"));
        files += write_layer_tar(
            &path,
            &format!("l{layer}"),
            per_layer,
            mix,
            layer as u64 + 1,
        )?;
        tars.push(path);
    }
    Ok((tars, files))
}
