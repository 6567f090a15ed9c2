//! `dray`: the one binary. Each subcommand is a thin layer over the crates.

mod bench;
mod client;
mod demo;
mod preheat;
mod service;
mod status_text;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use dray_agent::config::AgentConfig;
use dray_agent::identity::{ClusterCa, Identity};
use dray_agent::pull::fetch::{PeerAddr, fetch_from_peers};
use dray_agent::serving::containerd;
use dray_agent::serving::metrics::AgentMetrics;
use dray_protocol::identity::Role;

use dray_agent::pull::registry::{Credentials, RegistryClient};
use dray_agent::store::ChunkStore;

use dray_protocol::{ChunkMap, DEFAULT_CHUNK_SIZE, pb};
use dray_snapshotter_shim::SnapshotterConfig;
use dray_tracker::{Tracker, TrackerConfig, Transport};
use prost::Message;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Small same-sized blocks kept together per thread: the simulator's state is
/// millions of them (see the commit that chose it for the measurements).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "dray",
    version,
    about = "Peer-to-peer container image layer distribution"
)]
struct Cli {
    /// Log line format on stderr.
    #[arg(long, global = true, env = "DRAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Which logs to keep, as RUST_LOG filter directives, e.g. `info` or
    /// `warn,dray_agent::pull::swarm=debug` (default: warn; error for the demo).
    #[arg(long = "log", value_name = "FILTER", global = true, env = "DRAY_LOG", value_parser = log_filter)]
    log_filter: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    /// One JSON object per line.
    Json,
}

/// Checks a `--log` filter so that a typo is a clap error, not silence.
fn log_filter(s: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(s)
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

#[derive(Subcommand)]
enum Command {
    /// See it work, nothing to install: an embedded registry with a capped
    /// uplink, a tracker and N agents in this process pull one image at once.
    Demo(demo::DemoArgs),
    /// Run the node agent: the registry mirror for containerd, announces to the
    /// tracker, and the authenticated peer endpoint serving verified chunks.
    Agent(AgentArgs),
    /// Run the tracker: announces, peer selection, registry-fetch scheduling.
    Tracker(TrackerArgs),
    /// Create the cluster CA or issue agent certificates.
    #[command(subcommand)]
    Ca(CaCommand),
    /// Move single blobs in and out of an agent's chunk store.
    #[command(subcommand)]
    Blob(BlobCommand),
    /// Simulate a scale-out storm with the real scheduler and chunk picker.
    Sim(SimArgs),
    /// Pull an image's layers into the running agent's store, with progress.
    Pull {
        /// Image reference, e.g. registry.example:5000/team/app:1.0.
        image: String,
        #[command(flatten)]
        socket: SocketArg,
        /// Print the final progress as one JSON object instead of bars.
        #[arg(long)]
        json: bool,
    },
    /// Show what the running agent is doing: pulls in progress (bytes from peers
    /// and the registry, rate, ETA, peers), the store against its watermarks,
    /// the tracker and DHT, recent fallbacks and bans, and the blobs held.
    Status {
        #[command(flatten)]
        socket: SocketArg,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run the agent's garbage collection now; with --dry-run, list what
    /// it would evict and evict nothing.
    Gc {
        #[command(flatten)]
        socket: SocketArg,
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Pin an image on this node: its config and layers (for an index, this
    /// node's platform's), resolved through the agent, are never evicted,
    /// across restarts too. Pinning a tag again takes what it names now.
    Pin {
        /// Image reference, e.g. registry.example:5000/team/app:1.0.
        #[arg(required_unless_present = "list", conflicts_with = "list")]
        image: Option<String>,
        /// List the pinned images instead.
        #[arg(long)]
        list: bool,
        #[command(flatten)]
        socket: SocketArg,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Unpin an image pinned with `dray pin` (named as `dray pin --list` shows it, or as pinned).
    Unpin {
        image: String,
        #[command(flatten)]
        socket: SocketArg,
    },
    /// Have the tracker pull an image into chosen nodes' stores ahead of a
    /// rollout (spread over zones and racks), and follow it per node.
    Preheat(preheat::PreheatArgs),
    /// Measure dray against baselines in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run the containerd proxy snapshotter (`[proxy_plugins.dray]`), which
    /// asks the local agent to unpack the layers of CRI pulls.
    Snapshotter(SnapshotterArgs),
}

#[derive(Args)]
struct SnapshotterArgs {
    /// Snapshotter configuration file (TOML); defaults apply without one.
    #[arg(long, short, env = "DRAY_SNAPSHOTTER_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `socket`.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Overrides `root`.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Overrides `agent_socket`.
    #[arg(long)]
    agent_socket: Option<PathBuf>,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
struct AgentArgs {
    #[command(subcommand)]
    action: Option<AgentAction>,
    #[command(flatten)]
    config: ConfigArgs,
}

#[derive(Subcommand)]
enum AgentAction {
    /// Write containerd's hosts.toml so that pulls of each registry try this
    /// agent's mirror first and the registry itself second (idempotent; a
    /// different file is kept as a backup).
    ConfigureContainerd {
        /// containerd's registry config_path directory.
        #[arg(long, default_value = "/etc/containerd/certs.d")]
        config_path: PathBuf,
        /// A registry to mirror, as NAME or NAME=SERVER_URL (default server:
        /// https://NAME; docker.io maps to its real registry host); repeat.
        #[arg(long = "registry", required_unless_present = "all_registries")]
        registries: Vec<String>,
        /// Also write `_default/hosts.toml`: every registry without a file of
        /// its own tries the mirror first (the agent's `mirror.registries`
        /// still decides which it serves; the others fall through to the
        /// registry itself).
        #[arg(long)]
        all_registries: bool,
        /// The mirror's URL as containerd reaches it.
        #[arg(long, default_value = "http://127.0.0.1:5050")]
        mirror: String,
    },
}

/// Where a running agent's local API listens.
#[derive(Args)]
struct SocketArg {
    /// The agent's local API socket (`local_api.socket` in its config).
    #[arg(
        long = "socket",
        env = "DRAY_AGENT_SOCKET",
        default_value = "/run/dray/agent.sock"
    )]
    path: PathBuf,
}

#[derive(Args)]
struct SimArgs {
    /// Scenario name (small, kraken-2600, storm-10k, storm-100k, churn-10k, rack-oversub, outage-1k).
    #[arg(long, default_value = "small")]
    scenario: String,
    /// Also run dray without a tracker (dray-dht) and the reference
    /// strategies (direct, kraken-like, spegel-like) on the same scenario.
    #[arg(long)]
    compare: bool,
    /// Also run dray without a tracker (dray-dht: the DHT finds the peers
    /// and splits the registry's work), side by side with the tracker.
    #[arg(long, conflicts_with = "compare")]
    no_tracker: bool,
    /// Random seed; the same seed gives the same results.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How unevenly flows share a link: the sigma of their lognormal weights
    /// (0: equal shares; `dray bench storm`'s links fit 0.5). Default: the
    /// scenario's own.
    #[arg(long)]
    flow_weight_sigma: Option<f64>,
    /// Print JSON lines (time series included) instead of a table.
    #[arg(long)]
    json: bool,
    /// Write a chart (completion CDF, registry egress over time) as SVG here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// A chaos sweep instead of a scenario: each seed draws a cluster and
    /// one or two faults (tracker hang, crash or partition, a slow registry
    /// or a burst of its server errors, crashing, frozen, lying or late
    /// nodes), runs it with and without them, and checks that every node
    /// completes within the fault class's bounds on registry egress and
    /// time, that no node keeps a chunk failing its hash, and that liars
    /// and only they are banned. Exits 1 if a seed fails; each failure
    /// prints the command that reproduces it.
    #[arg(long, conflicts_with_all = ["compare", "no_tracker", "svg"])]
    chaos: bool,
    /// With --chaos: how many seeds.
    #[arg(long, default_value_t = 200, requires = "chaos")]
    seeds: u64,
    /// With --chaos: the first seed.
    #[arg(long, default_value_t = 1, requires = "chaos")]
    seed_from: u64,
    /// With --chaos: turn on a deliberately broken rule (test builds only),
    /// to see the sweep catch it: silence-ignored, starve-unpublished,
    /// late-runs-kept, hash-unchecked, no-retry, no-deadline.
    #[arg(long, requires = "chaos")]
    plant: Option<String>,
}

#[derive(Args)]
struct TrackerArgs {
    /// Tracker configuration file (TOML); defaults apply without one.
    #[arg(long, short, env = "DRAY_TRACKER_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `listen`.
    #[arg(long, env = "DRAY_TRACKER_LISTEN", value_parser = dray_agent::config::parse_socket_addr)]
    listen: Option<std::net::SocketAddr>,
    /// Overrides `cert` (the tracker's certificate, from `dray ca issue --tracker`).
    #[arg(long, env = "DRAY_TRACKER_CERT")]
    cert: Option<PathBuf>,
    /// Overrides `key`.
    #[arg(long, env = "DRAY_TRACKER_KEY")]
    key: Option<PathBuf>,
    /// Overrides `ca` (the cluster CA agents' certificates must chain to).
    #[arg(long, env = "DRAY_TRACKER_CA")]
    ca: Option<PathBuf>,
    /// Sets `insecure_plain_http`: no TLS, and any client may speak as any peer.
    #[arg(long)]
    insecure_plain_http: bool,
}

/// The agent's TOML config and the flags that override it.
#[derive(Args)]
struct ConfigArgs {
    /// Agent configuration file (TOML); defaults apply without one.
    #[arg(long, short, env = "DRAY_AGENT_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `state_dir`.
    #[arg(long, env = "DRAY_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Overrides `peer_listen`.
    #[arg(long, env = "DRAY_PEER_LISTEN", value_parser = dray_agent::config::parse_socket_addr)]
    peer_listen: Option<std::net::SocketAddr>,
    /// Overrides `admin_listen` (metrics and health checks).
    #[arg(long, env = "DRAY_ADMIN_LISTEN", value_parser = dray_agent::config::parse_socket_addr)]
    admin_listen: Option<std::net::SocketAddr>,
    /// Overrides `swarm.advertise`: the peer addresses other agents dial,
    /// comma-separated (one of each family on a dual-stack node); a bare IP
    /// address takes the peer endpoint's port.
    #[arg(long, env = "DRAY_ADVERTISE", value_delimiter = ',')]
    advertise: Vec<dray_agent::discovery::advertise::Advertised>,
    /// Overrides `swarm.dht.listen`: the DHT's TCP address (setting it joins
    /// the DHT).
    #[arg(long, env = "DRAY_DHT_LISTEN", value_parser = dray_agent::config::parse_socket_addr)]
    dht_listen: Option<std::net::SocketAddr>,
    /// Overrides `swarm.dht.bootstrap`: host:port of DHT nodes to join
    /// through (a name may resolve to many); repeat (DRAY_DHT_BOOTSTRAP:
    /// comma-separated).
    #[arg(
        long = "dht-bootstrap",
        env = "DRAY_DHT_BOOTSTRAP",
        value_delimiter = ','
    )]
    dht_bootstrap: Vec<String>,
    /// Overrides `peer.download_bytes_per_s`.
    #[arg(long, env = "DRAY_DOWNLOAD_BYTES_PER_S")]
    download_bytes_per_s: Option<u64>,
    /// Overrides `peer.upload_bytes_per_s`.
    #[arg(long, env = "DRAY_UPLOAD_BYTES_PER_S")]
    upload_bytes_per_s: Option<u64>,
    /// Overrides `swarm.trackers`: a tracker replica URL; repeat for several
    /// (DRAY_TRACKERS: comma-separated).
    #[arg(long = "tracker", env = "DRAY_TRACKERS", value_delimiter = ',')]
    trackers: Vec<String>,
    /// Overrides `mirror.listen`.
    #[arg(long, env = "DRAY_MIRROR_LISTEN", value_parser = dray_agent::config::parse_socket_addr)]
    mirror_listen: Option<std::net::SocketAddr>,
    /// Overrides `local_api.socket`.
    #[arg(long, env = "DRAY_LOCAL_SOCKET")]
    local_socket: Option<PathBuf>,
    /// Adds to `mirror.upstreams`: REGISTRY=URL (e.g. 127.0.0.1:5000=http://127.0.0.1:5000);
    /// repeat (DRAY_UPSTREAMS: comma-separated).
    #[arg(long = "upstream", env = "DRAY_UPSTREAMS", value_delimiter = ',')]
    upstreams: Vec<String>,
}

impl ConfigArgs {
    fn load(&self) -> Result<AgentConfig> {
        let mut cfg = match &self.config {
            Some(p) => AgentConfig::load(p)?,
            None => AgentConfig::default(),
        };
        if let Some(d) = &self.state_dir {
            cfg.state_dir = d.clone();
        }
        if let Some(a) = self.peer_listen {
            cfg.peer_listen = a;
        }
        if let Some(a) = self.admin_listen {
            cfg.admin_listen = a;
        }
        if !self.advertise.is_empty() {
            cfg.swarm.advertise = self.advertise.clone();
        }
        if self.dht_listen.is_some() {
            cfg.swarm.dht.listen = self.dht_listen;
        }
        if !self.dht_bootstrap.is_empty() {
            cfg.swarm.dht.bootstrap = self.dht_bootstrap.clone();
        }
        if self.download_bytes_per_s.is_some() {
            cfg.peer.download_bytes_per_s = self.download_bytes_per_s;
        }
        if self.upload_bytes_per_s.is_some() {
            cfg.peer.upload_bytes_per_s = self.upload_bytes_per_s;
        }
        if !self.trackers.is_empty() {
            cfg.swarm.trackers = self.trackers.clone();
        }
        if let Some(l) = self.mirror_listen {
            cfg.mirror.listen = l;
        }
        if let Some(s) = &self.local_socket {
            cfg.local_api.socket = s.clone();
        }
        for u in &self.upstreams {
            let (name, url) = u
                .split_once('=')
                .with_context(|| format!("--upstream {u:?} must look like REGISTRY=URL"))?;
            cfg.mirror
                .upstreams
                .insert(name.to_string(), url.to_string());
        }
        Ok(cfg)
    }

    /// Opens the store, binds the peer endpoint and joins the swarm as configured.
    fn open(&self) -> Result<dray_agent::Agent> {
        open_agent(&self.load()?, Arc::default())
    }
}

/// The agent of `cfg` (its identity read from the configured files),
/// counting into `metrics`.
fn open_agent(cfg: &AgentConfig, metrics: Arc<AgentMetrics>) -> Result<dray_agent::Agent> {
    let identity = Identity::load(&cfg.cert, &cfg.key, &cfg.ca)?;
    Ok(dray_agent::Agent::open(cfg, identity, metrics)?)
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create a cluster CA: writes ca.crt and ca.key into DIR.
    Init {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue an agent (node) certificate signed by the CA in --ca-dir:
    /// writes agent.crt, agent.key and ca.crt into --out (with --preheater:
    /// a preheater's, preheater.crt and preheater.key; with --tracker: the
    /// tracker's, tracker.crt and tracker.key).
    Issue {
        #[arg(long)]
        ca_dir: PathBuf,
        /// The agent's peer id (a DNS name such as the node name).
        #[arg(long, required_unless_present = "tracker", conflicts_with = "tracker")]
        peer_id: Option<String>,
        /// Issue a preheater's certificate (for `dray preheat`: the
        /// tracker's preheat API only; refused by the peer plane, the DHT
        /// and the tracker's agent API) for --peer-id.
        #[arg(long, requires = "peer_id")]
        preheater: bool,
        /// Issue the tracker's certificate (server authentication only) for
        /// each --name.
        #[arg(long, requires = "names")]
        tracker: bool,
        /// A DNS name or IP address agents reach the tracker by (repeat; the
        /// first must be a DNS name), e.g. each replica's name.
        #[arg(long = "name", requires = "tracker")]
        names: Vec<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = dray_agent::identity::DEFAULT_VALIDITY_DAYS)]
        days: u32,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum BlobCommand {
    /// Copy a local file into the store as a complete blob and write its chunk map.
    Import {
        #[command(flatten)]
        config: ConfigArgs,
        file: PathBuf,
        /// Where to write the chunk map (protobuf).
        #[arg(long)]
        map_out: PathBuf,
        #[arg(long, default_value_t = DEFAULT_CHUNK_SIZE)]
        chunk_size: u32,
    },
    /// Fetch a blob described by a chunk map from peers, resuming what the store
    /// holds; prints a JSON report.
    Fetch {
        #[command(flatten)]
        config: ConfigArgs,
        /// The chunk map (protobuf), as written by `import`.
        #[arg(long)]
        map: PathBuf,
        /// A peer as PEER_ID@HOST:PORT; repeat for several.
        #[arg(long = "peer", required = true)]
        peers: Vec<String>,
    },
    /// Pull a blob through the swarm (tracker, peers, registry); prints a JSON report.
    Pull {
        #[command(flatten)]
        config: ConfigArgs,
        /// Registry base URL, e.g. https://registry.example or http://127.0.0.1:5000.
        #[arg(long)]
        registry: String,
        /// Repository, e.g. library/busybox.
        #[arg(long)]
        repo: String,
        /// Blob digest, sha256:<hex>.
        #[arg(long)]
        digest: String,
        /// Registry user name (the password comes from DRAY_REGISTRY_PASSWORD).
        #[arg(long)]
        username: Option<String>,
        /// Keep serving peers after the pull, until interrupted.
        #[arg(long)]
        serve: bool,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The demo's display is its output: agents' warnings would scroll it away.
    let quiet = matches!(cli.command, Command::Demo(_));
    let filter = cli
        .log_filter
        .as_deref()
        .unwrap_or(if quiet { "error" } else { "warn" });
    init_logging(cli.log_format, filter);
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let outcome = runtime.block_on(run(cli.command));
    // Blocking work a graceful stop cut short (an unpack past the agent's
    // shutdown_grace) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dray: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Makes mimalloc commit its arenas page by page as they are touched, not
/// whole on creation, for the services that run on every node for months
/// (`dray agent`, `tracker`, `snapshotter`). With transparent huge pages on
/// (`always`, common on nodes), an eagerly committed arena turns into resident
/// 2 MiB pages: measured on a `dray agent` at rest, 44 MiB of anonymous memory
/// with it and 2.5 MiB without; at the peak of a 512 MiB mirror pull 126-135
/// MiB with it and 73-95 MiB without, the agent's CPU time unchanged. Purging
/// freed memory at once instead (`purge_delay` 0) saves less, 109 MiB, and
/// doubles the pull's system time. The simulator keeps the default: lazily
/// committed it took 12% more CPU (kraken-2600, 47 against 42 s).
///
/// The option must be set before the first allocation, which Rust's runtime
/// makes before `main`, so this runs from `.init_array`, where glibc passes
/// the program's arguments.
extern "C" fn commit_heap_on_touch(
    argc: libc::c_int,
    argv: *const *const libc::c_char,
    _envp: *const *const libc::c_char,
) {
    let service = (1..usize::try_from(argc).unwrap_or(0)).any(|i| {
        // SAFETY: glibc calls `.init_array` functions with the argc/argv it
        // gives `main`: argc valid, NUL-terminated strings.
        let arg = unsafe { std::ffi::CStr::from_ptr(*argv.add(i)) };
        matches!(arg.to_bytes(), b"agent" | b"tracker" | b"snapshotter")
    });
    if service {
        // SAFETY: mi_option_set only stores an option value, read when
        // mimalloc creates its first arena; only this thread exists yet.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0) };
    }
}

#[used]
#[unsafe(link_section = ".init_array")]
static COMMIT_HEAP_ON_TOUCH: extern "C" fn(
    libc::c_int,
    *const *const libc::c_char,
    *const *const libc::c_char,
) = commit_heap_on_touch;

/// `mi_option_arena_eager_commit` in the `mi_option_e` enum of mimalloc.h
/// (the same place in the v2 and v3 headers libmimalloc-sys builds); the
/// crate names no constant for it.
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// Logs to stderr, keeping what `filter` selects.
fn init_logging(format: LogFormat, filter: &str) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn run(command: Command) -> Result<()> {
    match command {
        Command::Agent(args) => agent(args).await,
        Command::Pull {
            image,
            socket,
            json,
        } => client::pull(&socket.path, &image, json).await,
        Command::Status { socket, json } => client::status(&socket.path, json).await,
        Command::Gc {
            socket,
            dry_run,
            json,
        } => client::gc(&socket.path, dry_run, json).await,
        Command::Pin {
            image,
            list,
            socket,
            json,
        } => client::pin(&socket.path, image.as_deref().filter(|_| !list), json).await,
        Command::Unpin { image, socket } => client::unpin(&socket.path, &image).await,
        Command::Snapshotter(args) => snapshotter(args).await,
        Command::Sim(args) => sim(args),
        Command::Bench(cmd) => bench::run(cmd).await,
        Command::Preheat(args) => preheat::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Tracker(args) => tracker(args).await,
        Command::Ca(cmd) => ca(cmd),
        Command::Blob(cmd) => blob(cmd).await,
    }
}

/// `dray agent`, and its `configure-containerd`.
async fn agent(args: AgentArgs) -> Result<()> {
    match args {
        AgentArgs {
            action:
                Some(AgentAction::ConfigureContainerd {
                    config_path,
                    registries,
                    all_registries,
                    mirror,
                }),
            ..
        } => {
            if all_registries {
                let outcome =
                    containerd::write_default_hosts(&config_path, &mirror).with_context(|| {
                        format!("writing {}/_default/hosts.toml", config_path.display())
                    })?;
                println!("{}: {outcome:?}", containerd::DEFAULT_HOSTS);
            }
            for r in &registries {
                let (name, server) = match r.split_once('=') {
                    Some((n, s)) => (n.to_string(), s.to_string()),
                    None => (r.clone(), containerd::default_server(r)),
                };
                let outcome = containerd::write_hosts(&config_path, &name, &server, &mirror)
                    .with_context(|| {
                        format!("writing {}/{name}/hosts.toml", config_path.display())
                    })?;
                println!("{name}: {outcome:?}");
            }
            Ok(())
        }
        AgentArgs {
            action: None,
            config,
        } => service::run_agent(config.load()?).await,
    }
}

/// `dray tracker`: serves until SIGTERM or SIGINT.
async fn tracker(args: TrackerArgs) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => TrackerConfig::load(p)?,
        None => TrackerConfig::default(),
    };
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    for (flag, key) in [
        (args.cert, &mut cfg.cert),
        (args.key, &mut cfg.key),
        (args.ca, &mut cfg.ca),
    ] {
        if let Some(path) = flag {
            *key = path;
        }
    }
    cfg.insecure_plain_http |= args.insecure_plain_http;
    let (transport, scheme) = if cfg.insecure_plain_http {
        tracing::warn!(
            "insecure_plain_http: the tracker serves plain HTTP, and anyone who reaches it may announce, publish and report as any peer"
        );
        (Transport::InsecurePlainHttp, "http")
    } else {
        let id = Identity::load(&cfg.cert, &cfg.key, &cfg.ca).context(
                "loading the tracker's certificate (`cert`, `key`, `ca`; issue one with `dray ca issue --tracker`)",
            )?;
        id.warn_if_expiring("tracker")?;
        let config = Arc::new(id.tracker_server_tls()?);
        let max_connections = cfg.max_connections;
        (
            Transport::Tls {
                config,
                max_connections,
            },
            "https",
        )
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding the tracker to {}", cfg.listen))?;
    eprintln!(
        "dray tracker listening on {scheme}://{}",
        listener.local_addr()?
    );
    let signer = match &cfg.signer {
        Some(s) => Some(
            dray_tracker::signer::Signer::new(s, &cfg.ca)
                .context("starting the certificate signer ([signer])")?,
        ),
        None => None,
    };
    let stop = service::shutdown_signal()?;
    tokio::select! {
        served = dray_tracker::serve(listener, Tracker::with_signer(&cfg, signer), transport) => served?,
        signal = stop => eprintln!("dray tracker: {signal}: stopped"),
    }
    Ok(())
}

/// `dray ca`: the cluster CA and the certificates it issues.
fn ca(cmd: CaCommand) -> Result<()> {
    match cmd {
        CaCommand::Init { dir } => {
            let ca = ClusterCa::generate()?;
            write_new(&dir, &[("ca.crt", &ca.cert_pem), ("ca.key", &ca.key_pem)])
        }
        CaCommand::Issue {
            ca_dir,
            peer_id,
            preheater,
            tracker,
            names,
            days,
            out,
        } => {
            let ca = ClusterCa::load(&ca_dir.join("ca.crt"), &ca_dir.join("ca.key"))?;
            let (id, name) = match peer_id {
                Some(peer) if preheater => (
                    ca.issue_role(
                        &peer,
                        Role::Preheater,
                        std::time::Duration::from_secs(u64::from(days) * 86_400),
                    )?,
                    "preheater",
                ),
                Some(peer) => (ca.issue_for_days(&peer, days)?, "agent"),
                None if tracker => (ca.issue_tracker(&names, days)?, "tracker"),
                None => anyhow::bail!("`dray ca issue` needs --peer-id or --tracker"),
            };
            let (crt, key) = (format!("{name}.crt"), format!("{name}.key"));
            write_new(
                &out,
                &[
                    (crt.as_str(), &id.cert_pem()),
                    (key.as_str(), &id.key_pem()),
                    ("ca.crt", &ca.cert_pem),
                ],
            )
        }
    }
}

/// `dray blob`: one blob into, out of or through an agent's store.
async fn blob(cmd: BlobCommand) -> Result<()> {
    match cmd {
        BlobCommand::Import {
            config,
            file,
            map_out,
            chunk_size,
        } => {
            let cfg = config.load()?;
            let store = ChunkStore::open(&cfg.state_dir)?;
            let map = store.import(&file, chunk_size)?;
            std::fs::write(&map_out, map.to_pb().encode_to_vec())
                .with_context(|| format!("writing {}", map_out.display()))?;
            println!("{}", map.digest());
            Ok(())
        }
        BlobCommand::Fetch { config, map, peers } => {
            let raw = std::fs::read(&map).with_context(|| format!("reading {}", map.display()))?;
            let map = pb::ChunkMap::decode(raw.as_slice())
                .map_err(anyhow::Error::from)
                .and_then(|m| Ok(ChunkMap::from_pb(&m)?))
                .with_context(|| format!("chunk map {}", map.display()))?;
            let peers = peers
                .iter()
                .map(|p| parse_peer(p))
                .collect::<Result<Vec<_>>>()?;
            let agent = config.open()?;
            let report = fetch_from_peers(agent.node(), &map, &peers).await?;
            agent.kill();
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        BlobCommand::Pull {
            config,
            registry,
            repo,
            digest,
            username,
            serve,
        } => {
            let digest: dray_protocol::BlobDigest = digest.parse()?;
            let credentials = match username {
                Some(username) => Some(Credentials {
                    username,
                    password: std::env::var("DRAY_REGISTRY_PASSWORD")
                        .context("--username needs the password in DRAY_REGISTRY_PASSWORD")?,
                }),
                None => None,
            };
            let registry = Arc::new(RegistryClient::new(&registry, credentials)?);
            let stop = service::shutdown_signal()?;
            let mut agent = config.open()?;
            agent.spawn_loops(false);
            let swarm = agent.swarm();
            let report = swarm.pull(&registry, &repo, digest).await?;
            println!("{}", serde_json::to_string(&report)?);
            if serve {
                stop.await;
            }
            agent.stop_loops();
            swarm.leave().await;
            agent.kill();
            agent.node().closed(std::time::Duration::from_secs(1)).await;
            Ok(())
        }
    }
}

async fn snapshotter(args: SnapshotterArgs) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => SnapshotterConfig::load(p)?,
        None => SnapshotterConfig::default(),
    };
    if let Some(s) = args.socket {
        cfg.socket = s;
    }
    if let Some(r) = args.root {
        cfg.root = r;
    }
    if let Some(a) = args.agent_socket {
        cfg.agent_socket = a;
    }
    let stop = service::shutdown_signal()?;
    let shutdown = async move {
        let signal = stop.await;
        eprintln!("dray snapshotter: {signal}: finishing the calls in flight");
    };
    eprintln!(
        "dray snapshotter serving {} (root {}, agent {})",
        cfg.socket.display(),
        cfg.root.display(),
        cfg.agent_socket.display()
    );
    let agent =
        dray_snapshotter_shim::agent::AgentClient::new(&cfg.agent_socket, cfg.unpack_deadline());
    dray_snapshotter_shim::serve(&cfg, agent, shutdown).await?;
    Ok(())
}

/// `dray sim`. A reader that goes away early (`dray sim | head -1`) ends it
/// quietly, as it would any Unix filter.
fn sim(args: SimArgs) -> Result<()> {
    match sim_report(args) {
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        done => done,
    }
}

fn sim_report(args: SimArgs) -> Result<()> {
    use dray_simulations::Strategy;
    use std::io::Write;
    if args.chaos {
        return chaos(args);
    }
    let mut out = std::io::stdout().lock();
    let mut scenario = dray_simulations::scenario(&args.scenario)?;
    if let Some(sigma) = args.flow_weight_sigma {
        scenario.flow_weight_sigma = sigma;
    }
    let strategies: &[Strategy] = if args.compare {
        &Strategy::ALL
    } else if args.no_tracker {
        &[Strategy::Dray, Strategy::DrayDht]
    } else {
        &[Strategy::Dray]
    };
    let mut reports = Vec::new();
    if !args.json {
        writeln!(
            out,
            "{:<12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>11} {:>7}",
            "strategy",
            "nodes",
            "p50 s",
            "p99 s",
            "max s",
            "bound s",
            "p99/T*",
            "egress/img",
            "wall s"
        )?;
    }
    for &strategy in strategies {
        let r = dray_simulations::run(&scenario, strategy, args.seed)?;
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&r)?)?;
        } else {
            writeln!(
                out,
                "{:<12} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>9.2} {:>7.2} {:>11.2} {:>7.1}",
                r.strategy,
                r.nodes,
                r.p50_s,
                r.p99_s,
                r.max_s,
                r.lower_bound_s,
                r.bound_ratio,
                r.registry_egress_ratio,
                r.wall_s
            )?;
        }
        reports.push(r);
    }
    if !args.json {
        for r in &reports {
            let Some(d) = &r.dht else { continue };
            writeln!(
                out,
                "{}: the DHT's own cost. A node joins in {} rounds ({:.3} s, {:.0} KiB); \
                 the storm's {} lookups moved {:.1} MiB ({:.0} KiB per node); \
                 the busiest key's stores each answered {:.0} lookups/s ({:.1} MB/s); \
                 nodes saw at most {} members of a blob",
                r.strategy,
                d.join_rounds_p50,
                d.join_s_p50,
                d.join_bytes_p50 as f64 / 1024.0,
                d.lookups,
                d.bytes / f64::from(1 << 20),
                d.bytes_per_node / 1024.0,
                d.hottest_store_requests_per_s,
                d.hottest_store_bytes_per_s / 1e6,
                d.max_members,
            )?;
        }
    }
    if let Some(path) = args.svg {
        dray_simulations::write_svg(&reports, &path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A class's time bound as `dray sim --chaos` prints it: `k,c,r`, and the
/// seconds for each node hit in each layer where the class has them.
fn time_bound(c: &dray_simulations::chaos::ClassSummary) -> String {
    let (k, f, r) = c.time_bound;
    let hit = c.time_bound_per_node_hit_and_layer;
    if hit > 0.0 {
        format!("{k},{f},{r}+{hit}/hit/layer")
    } else {
        format!("{k},{f},{r}")
    }
}

/// `dray sim --chaos`.
fn chaos(args: SimArgs) -> Result<()> {
    use dray_protocol::planted::{self, Bug};
    use std::io::Write;
    let planted = match args.plant.as_deref() {
        None => None,
        Some(name) => {
            let Some(bug) = Bug::named(name) else {
                let known: Vec<_> = Bug::ALL.iter().map(|b| b.name()).collect();
                bail!("no planted bug {name:?}; known: {}", known.join(", "));
            };
            if !planted::plant(bug) {
                bail!(
                    "this dray was built without planted bugs (build with --features dray/hostile)"
                );
            }
            Some(bug.name())
        }
    };
    let mut out = std::io::stdout().lock();
    let report = dray_simulations::chaos::sweep(args.seed_from, args.seeds, planted, |o| {
        if !args.json && !o.violations.is_empty() {
            let faults: Vec<_> = o.faults.iter().map(|f| f.class).collect();
            eprintln!(
                "seed {} ({}): {}",
                o.seed,
                faults.join(" + "),
                o.violations.join("; ")
            );
        }
    })?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(
            out,
            "{:<18} {:>6} {:>11} {:>7} {:>13} {:>9} {:>11} {:>18}",
            "fault class",
            "seeds",
            "max egress",
            "alone",
            "bound",
            "of bound",
            "max time x",
            "bound k,c,r"
        )?;
        for c in &report.classes {
            writeln!(
                out,
                "{:<18} {:>6} {:>11.3} {:>7.3} {:>13} {:>9.3} {:>11.2} {:>18}",
                c.class,
                c.seeds,
                c.max_egress_copies,
                c.max_egress_copies_alone,
                format!("{}+{}/hit", c.egress_bound, c.egress_bound_per_node_hit),
                c.max_egress_of_bound,
                c.max_time_ratio,
                time_bound(c)
            )?;
        }
        writeln!(
            out,
            "{} seeds from {}, {} failed; {:.0} seeds a minute, {:.0} events a second",
            report.seeds,
            report.first_seed,
            report.failed,
            report.seeds_per_minute,
            report.events_per_s
        )?;
        for f in &report.failures {
            writeln!(out, "reproduce: {}", f.reproduce)?;
        }
    }
    out.flush()?;
    if report.failed > 0 {
        drop(out);
        std::process::exit(1);
    }
    Ok(())
}

fn parse_peer(s: &str) -> Result<PeerAddr> {
    let Some((id, addr)) = s.split_once('@') else {
        bail!("peer {s:?} must look like PEER_ID@HOST:PORT");
    };
    Ok(PeerAddr {
        peer_id: id.to_string(),
        addr: addr
            .parse()
            .with_context(|| format!("peer {s:?}: bad address {addr:?}"))?,
    })
}

/// Writes files into `dir`, refusing to overwrite keys that exist.
fn write_new(dir: &Path, files: &[(&str, &str)]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, text) in files {
        let path = dir.join(name);
        if path.exists() {
            bail!("{} exists; refusing to overwrite it", path.display());
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        if name.ends_with(".key") {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
    }
    Ok(())
}
