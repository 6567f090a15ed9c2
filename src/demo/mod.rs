//! `dray demo`: the whole system in one process, with nothing to install.
//!
//! An embedded registry with a capped uplink serves one image; a tracker and N
//! agents on loopback pull every layer of it at once through the swarm; the
//! demo then checks every node's copy against the image byte for byte and
//! reports how much left the registry and how long it took against the lower
//! bound (one copy of the image through the registry's uplink) and against N
//! direct pulls.

mod image;
mod progress;
mod registry;

use anyhow::{Context, Result, bail};
use clap::Args;
use dray_agent::pull::registry::RegistryClient;
use dray_agent::pull::swarm::{Swarm, SwarmConfig};
use dray_protocol::BlobDigest;
use dray_testkit::cluster::LocalCluster;
use image::{Image, Manifest};
use registry::{DemoRegistry, REPO, TAG};
use serde::Serialize;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Args)]
pub struct DemoArgs {
    /// Agents pulling the image at once.
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Size of the generated image in MiB (ignored with --image).
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Layers of the generated image (ignored with --image).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// The registry's uplink, Mbit/s, shared by all its connections.
    #[arg(long, default_value_t = 400)]
    registry_mbps: u64,
    /// Serve this OCI image layout (a directory with index.json) instead of a
    /// generated image.
    #[arg(long)]
    image: Option<PathBuf>,
    /// The manifest to serve from --image, by its tag
    /// (org.opencontainers.image.ref.name); needed when index.json lists several.
    #[arg(long, requires = "image")]
    tag: Option<String>,
    /// Print one JSON object instead of the progress display and the table.
    #[arg(long)]
    json: bool,
    /// Keep the node directories (and the generated image) under DIR instead of
    /// removing them at the end.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
}

/// One node's pull.
#[derive(Serialize)]
struct NodeReport {
    node: String,
    dir: PathBuf,
    /// Seconds from the start until every blob was verified in its store.
    seconds: f64,
    /// What the registry sent this node (its manifest included).
    bytes_from_registry: u64,
    /// The image's bytes less what the registry sent this node.
    bytes_from_peers: u64,
    /// Every blob of the image is complete in the store and byte-identical to the image.
    complete: bool,
    /// The node gave up on the swarm for some chunks and took them from the registry.
    fell_back: bool,
}

#[derive(Serialize)]
struct DemoReport {
    nodes: usize,
    image: String,
    layers: usize,
    /// Config and layers: what each node pulls.
    image_bytes: u64,
    registry_mbps: u64,
    /// What the embedded registry sent (manifests included).
    registry_egress_bytes: u64,
    egress_ratio: f64,
    peer_bytes: u64,
    /// One copy of the image through the registry's uplink: the storm bench's
    /// T* = max(F/u_s, F/d, N·F/(u_s + N·u)) with loopback node links, which
    /// are not the bottleneck.
    lower_bound_s: f64,
    /// The last node's time.
    last_s: f64,
    /// last_s / lower_bound_s.
    bound_ratio: f64,
    /// N direct pulls through the same uplink: N × image / registry rate.
    direct_estimate_s: f64,
    per_node: Vec<NodeReport>,
}

pub async fn run(args: DemoArgs) -> Result<()> {
    if args.nodes == 0 || args.registry_mbps == 0 {
        bail!("--nodes and --registry-mbps must be positive");
    }
    if args.image.is_none() && (args.size_mib == 0 || args.layers == 0) {
        bail!("--size-mib and --layers must be positive");
    }
    let (temp, root) = match &args.keep {
        Some(dir) => {
            // Stores left by an earlier run would resume, and pull nothing.
            if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
                bail!("--keep {}: the directory is not empty", dir.display());
            }
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            (None, dir.clone())
        }
        None => {
            let t = tempfile::tempdir().context("creating a temporary directory")?;
            let root = t.path().to_path_buf();
            (Some(t), root)
        }
    };
    tokio::select! {
        r = demo(&args, &root) => r,
        _ = tokio::signal::ctrl_c() => {
            // The demo and its display are dropped by now; the agents' tasks
            // are still winding down: remove their directories and leave
            // without waiting for them.
            drop(temp);
            match &args.keep {
                Some(dir) => eprintln!("dray: interrupted; the node directories stay in {}", dir.display()),
                None => eprintln!("dray: interrupted; removed {}", root.display()),
            }
            std::process::exit(130)
        }
    }
}

async fn demo(args: &DemoArgs, root: &Path) -> Result<()> {
    let image = {
        let (source, tag) = (args.image.clone(), args.tag.clone());
        let generated = root.join("image");
        let (layers, size) = (args.layers, args.size_mib << 20);
        tokio::task::spawn_blocking(move || match source {
            Some(dir) => Image::load(&dir, tag.as_deref())
                .with_context(|| format!("--image {}", dir.display())),
            None => Image::generate(&generated, layers, size, TAG)
                .with_context(|| format!("generating an image in {}", generated.display())),
        })
        .await??
    };
    let image = Arc::new(image);
    let rate = args.registry_mbps * 1_000_000 / 8;
    let registry = Arc::new(DemoRegistry::start(image.clone(), args.nodes, rate).await?);
    let cluster = LocalCluster::start(
        root,
        args.nodes,
        SwarmConfig::default(),
        &dray_agent::store::gc::GcConfig::default(),
    )
    .await?;
    let display = progress::Display::new(!args.json, &image, &cluster, &registry, rate);

    let start = Instant::now();
    let pulls: Vec<_> = cluster
        .agents
        .iter()
        .enumerate()
        .map(|(i, swarm)| {
            let (swarm, url, bar) = (swarm.clone(), registry.url_for(i), display.node_bar(i));
            tokio::spawn(async move {
                let pulled = pull_image(&swarm, &url).await?;
                progress::finish(&bar, pulled.seconds(start));
                anyhow::Ok(pulled)
            })
        })
        .collect();
    let mut per_node = Vec::new();
    for (i, pull) in pulls.into_iter().enumerate() {
        let node = LocalCluster::node_id(i);
        let pulled = pull
            .await?
            .with_context(|| format!("{node} pulling the image"))?;
        // The registry's own count, not the agent's report: a pull's report
        // misses registry runs and peer requests still finishing when its
        // blob completes.
        let from_registry = registry.egress_to(i);
        per_node.push(NodeReport {
            dir: LocalCluster::node_dir(root, i),
            seconds: pulled.seconds(start),
            bytes_from_registry: from_registry,
            bytes_from_peers: image.bytes().saturating_sub(from_registry),
            complete: false,
            fell_back: pulled.fell_back,
            node,
        });
    }
    let egress = registry.egress();
    display.done(egress, start.elapsed().as_secs_f64());

    // The stores checked each blob's digest; compare the files with the image too.
    let checks: Vec<_> = cluster
        .agents
        .iter()
        .map(|swarm| {
            let (swarm, image) = (swarm.clone(), image.clone());
            tokio::task::spawn_blocking(move || same_as_image(&swarm, &image))
        })
        .collect();
    for (check, node) in checks.into_iter().zip(&mut per_node) {
        check
            .await?
            .with_context(|| format!("checking {}", node.node))?;
        node.complete = true;
    }
    drop(cluster);

    let image_bytes = image.bytes();
    let lower_bound_s = image_bytes as f64 / rate as f64;
    let last_s = per_node.iter().map(|n| n.seconds).fold(0.0, f64::max);
    let r = DemoReport {
        nodes: args.nodes,
        image: match &args.image {
            Some(dir) => dir.display().to_string(),
            None => format!("generated, {} tar+gzip layers", image.layers),
        },
        layers: image.layers,
        image_bytes,
        registry_mbps: args.registry_mbps,
        registry_egress_bytes: egress,
        egress_ratio: egress as f64 / image_bytes as f64,
        peer_bytes: per_node.iter().map(|n| n.bytes_from_peers).sum(),
        lower_bound_s,
        last_s,
        bound_ratio: last_s / lower_bound_s,
        direct_estimate_s: args.nodes as f64 * lower_bound_s,
        per_node,
    };
    crate::bench::emit(args.json, &r, print_table)
}

/// When one node had the whole image, and whether it needed the fallback.
struct Pulled {
    finished: Instant,
    fell_back: bool,
}

impl Pulled {
    fn seconds(&self, start: Instant) -> f64 {
        (self.finished - start).as_secs_f64()
    }
}

/// Fetches the manifest as a node would, then pulls the config and every
/// layer through the swarm at once.
async fn pull_image(swarm: &Arc<Swarm>, registry_url: &str) -> Result<Pulled> {
    let registry = Arc::new(RegistryClient::new(registry_url, None)?);
    let mut accept = reqwest::header::HeaderMap::new();
    accept.insert(
        reqwest::header::ACCEPT,
        reqwest::header::HeaderValue::from_static("application/vnd.oci.image.manifest.v1+json"),
    );
    let resp = registry
        .request(
            REPO,
            &format!("manifests/{TAG}"),
            reqwest::Method::GET,
            accept,
        )
        .await?;
    if !resp.status().is_success() {
        bail!("the registry answered {} for {REPO}:{TAG}", resp.status());
    }
    let manifest: Manifest = serde_json::from_slice(&resp.bytes().await?)
        .with_context(|| format!("the manifest of {REPO}:{TAG}"))?;
    let mut pulls = tokio::task::JoinSet::new();
    for (digest, _) in manifest.blobs()? {
        let (swarm, registry) = (swarm.clone(), registry.clone());
        pulls.spawn(async move {
            swarm
                .pull(&registry, REPO, digest)
                .await
                .with_context(|| format!("blob {digest}"))
        });
    }
    let mut fell_back = false;
    while let Some(report) = pulls.join_next().await {
        fell_back |= report??.fell_back;
    }
    Ok(Pulled {
        finished: Instant::now(),
        fell_back,
    })
}

/// Checks that the node's store holds every blob of the image, complete and
/// byte-identical to the image's file.
fn same_as_image(swarm: &Swarm, image: &Image) -> Result<()> {
    for (digest, _) in &image.blobs {
        let blob = swarm
            .node()
            .store()
            .get(digest)?
            .filter(|b| b.is_complete())
            .with_context(|| format!("{digest} is not complete in the store"))?;
        same_bytes(blob.path(), &image.blob_path(digest), digest)?;
    }
    Ok(())
}

fn same_bytes(a: &Path, b: &Path, digest: &BlobDigest) -> Result<()> {
    let open = |p: &Path| {
        std::fs::File::open(p)
            .map(|f| std::io::BufReader::with_capacity(1 << 20, f))
            .with_context(|| format!("opening {}", p.display()))
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut offset = 0u64;
    loop {
        let n = read_full(&mut fa, &mut ba).with_context(|| format!("reading {}", a.display()))?;
        let m = read_full(&mut fb, &mut bb).with_context(|| format!("reading {}", b.display()))?;
        if n != m || ba[..n] != bb[..m] {
            bail!(
                "{} differs from the image's {digest} in the 1 MiB from byte {offset}",
                a.display()
            );
        }
        if n == 0 {
            return Ok(());
        }
        offset += n as u64;
    }
}

/// Fills `buf` unless the reader ends first; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn print_table(r: &DemoReport) {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!();
    println!(
        "{} nodes pulled {REPO}:{TAG} ({}; {:.1} MiB) from a registry capped at {} Mbit/s",
        r.nodes,
        r.image,
        mib(r.image_bytes),
        r.registry_mbps
    );
    println!();
    println!(
        "{:<10} {:>8} {:>16} {:>16}",
        "node", "time s", "registry MiB", "peers MiB"
    );
    for n in &r.per_node {
        println!(
            "{:<10} {:>8.2} {:>16.1} {:>16.1}{}",
            n.node,
            n.seconds,
            mib(n.bytes_from_registry),
            mib(n.bytes_from_peers),
            if n.fell_back { "  (fell back)" } else { "" }
        );
    }
    println!();
    println!("image             {:>10.1} MiB", mib(r.image_bytes));
    println!(
        "registry egress   {:>10.1} MiB  {:.2}× the image",
        mib(r.registry_egress_bytes),
        r.egress_ratio
    );
    println!("peer traffic      {:>10.1} MiB", mib(r.peer_bytes));
    println!(
        "lower bound       {:>10.2} s    one copy of the image through the registry's uplink",
        r.lower_bound_s
    );
    println!(
        "last node         {:>10.2} s    {:.2}× the bound",
        r.last_s, r.bound_ratio
    );
    println!(
        "{:<17} {:>10.2} s    {} × image / registry rate, {:.1}× the swarm's time",
        format!("{} direct pulls", r.nodes),
        r.direct_estimate_s,
        r.nodes,
        r.direct_estimate_s / r.last_s
    );
    println!("every node's blobs are byte-identical to the image");
}
