//! Test harness: the real distribution registry from Debian behind a counting
//! (and optionally throttling) TCP relay, a tracker and agents in this process.

#![allow(dead_code, unused_imports)] // each test binary uses a different part of the harness

pub mod cluster;
pub mod model;

pub use dray_testkit::cluster::{InProcessTracker, start_agent};
pub use dray_testkit::oci_image;
pub use dray_testkit::testbed::{Registry, file_digest, free_port};

use dray_agent::identity::ClusterCa;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::pull::registry::{Credentials, RegistryClient};
use dray_agent::pull::swarm::{Swarm, SwarmConfig};
use dray_agent::serving::surfaces::Surfaces;
use dray_agent::store::ChunkStore;
use dray_tracker::{Tracker, TrackerConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Logs to the test's stderr, filtered by `DRAY_LOG` (e.g. `dray_agent=debug`).
pub fn init_logs() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("DRAY_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// `size` random bytes from the kernel into `path`.
pub fn random_file(path: &Path, size: u64) {
    let status = Command::new("head")
        .args(["-c", &size.to_string(), "/dev/urandom"])
        .stdout(std::fs::File::create(path).unwrap())
        .status()
        .unwrap();
    assert!(status.success());
}

/// This test process's cluster CA: the trackers of [`serve_tracker`] trust it
/// and present a certificate from it, so agents that talk to them must hold
/// certificates from it too (`Agent::start(&cluster_ca(), ...)`).
pub fn cluster_ca() -> ClusterCa {
    static CA: std::sync::OnceLock<ClusterCa> = std::sync::OnceLock::new();
    CA.get_or_init(|| ClusterCa::generate().unwrap()).clone()
}

/// A tracker served from this process over TLS (the benches' and `dray
/// demo`'s), with a certificate from [`cluster_ca`] for `localhost` and the
/// loopback addresses, on `addr`.
pub async fn serve_tracker(config: &TrackerConfig, addr: &str) -> InProcessTracker {
    init_logs();
    InProcessTracker::start(&cluster_ca(), config, addr)
        .await
        .unwrap()
}

/// Tracker settings that react within a test's patience.
pub fn quick_tracker() -> TrackerConfig {
    TrackerConfig {
        announce_interval: Duration::from_millis(500),
        min_fetch_timeout: Duration::from_secs(1),
        ..TrackerConfig::default()
    }
}

/// Swarm settings that react within a test's patience.
pub fn quick_swarm(trackers: Vec<String>) -> SwarmConfig {
    SwarmConfig {
        trackers,
        pull_announce: Duration::from_millis(150),
        idle_announce: Duration::from_millis(300),
        tracker_grace: Duration::from_millis(1_500),
        stall: Duration::from_secs(4),
        ..SwarmConfig::default()
    }
}

/// An agent in this process, started as `dray agent` starts one.
pub struct Agent {
    pub swarm: Arc<Swarm>,
    pub dir: PathBuf,
    agent: dray_agent::Agent,
}

impl Agent {
    /// An agent `id` of a CA of its own, with no tracker and the default
    /// peer settings: a node alone.
    pub fn alone(id: &str, work: &Path) -> Agent {
        let ca = ClusterCa::generate().unwrap();
        Agent::start(
            &ca,
            id,
            work,
            quick_swarm(Vec::new()),
            PeerConfig::default(),
        )
    }

    pub fn start(
        ca: &ClusterCa,
        id: &str,
        root: &Path,
        config: SwarmConfig,
        peer: PeerConfig,
    ) -> Agent {
        Agent::start_on(ca, id, root, "127.0.0.1:0".parse().unwrap(), config, peer)
    }

    /// An agent whose peer endpoint is bound to `listen`.
    pub fn start_on(
        ca: &ClusterCa,
        id: &str,
        root: &Path,
        listen: SocketAddr,
        config: SwarmConfig,
        peer: PeerConfig,
    ) -> Agent {
        let dir = root.join(id);
        let agent = start_agent(ca, id, &dir, listen, config, peer, None).unwrap();
        Agent {
            swarm: agent.swarm().clone(),
            dir,
            agent,
        }
    }

    /// The pulls its mirror and local API share, as in `dray agent`.
    pub fn pulls(&self) -> &Arc<dray_agent::pull::Pulls> {
        self.agent.pulls()
    }

    /// Path of a blob's file in this agent's store.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// Stops the agent as a crash would: no more announces, answers or uploads.
    pub fn kill(&self) {
        self.agent.kill();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn registry_client(url: &str, creds: Option<(&str, &str)>) -> Arc<RegistryClient> {
    let creds = creds.map(|(u, p)| Credentials {
        username: u.into(),
        password: p.into(),
    });
    Arc::new(RegistryClient::new(url, creds).unwrap())
}

/// A containerd 1.6 daemon with its own root, state and sockets in a
/// temporary directory (see `dray_testkit::oci_image`).
pub struct Containerd {
    daemon: oci_image::Containerd,
    pub dir: tempfile::TempDir,
    pub address: String,
}

impl Containerd {
    pub fn start() -> Containerd {
        Containerd::start_with("")
    }

    /// Starts containerd with `extra` appended to its config, e.g.
    /// [`dray_proxy_plugin`]'s section.
    pub fn start_with(extra: &str) -> Containerd {
        Containerd::launch(false, extra)
    }

    /// Starts containerd with its CRI plugin, pulling through the hosts.toml
    /// files under `hosts_dir` into `snapshotter` (with the snapshot labels
    /// remote snapshotters need), `extra` appended to its config.
    pub fn start_cri(hosts_dir: &Path, snapshotter: &str, extra: &str) -> Containerd {
        let cri = r#"plugins."io.containerd.grpc.v1.cri""#;
        Containerd::launch(
            true,
            &format!(
                "[{cri}.containerd]\n  snapshotter = \"{snapshotter}\"\n  disable_snapshot_annotations = false\n\
                 [{cri}.registry]\n  config_path = \"{}\"\n\
                 [{cri}.cni]\n  bin_dir = \"@DIR@/cni\"\n  conf_dir = \"@DIR@/cni\"\n{extra}",
                hosts_dir.display(),
            ),
        )
    }

    fn launch(cri: bool, extra: &str) -> Containerd {
        let dir = tempfile::tempdir().unwrap();
        let daemon = oci_image::Containerd::start_with(dir.path(), cri, extra)
            .expect("containerd (installed by scripts/test.sh) starts");
        let address = daemon.address.clone();
        Containerd {
            daemon,
            dir,
            address,
        }
    }

    /// Runs `ctr` against this daemon.
    pub fn ctr(&self, args: &[&str]) -> std::process::Output {
        self.daemon.ctr(args).unwrap()
    }

    /// `ctr image pull` through the hosts.toml files under `hosts_dir`.
    pub fn pull(&self, hosts_dir: &Path, image: &str, user: Option<&str>) -> std::process::Output {
        let mut args = vec!["image", "pull", "--hosts-dir", hosts_dir.to_str().unwrap()];
        if let Some(u) = user {
            args.extend(["--user", u]);
        }
        args.push(image);
        self.ctr(&args)
    }
}

/// containerd config: the proxy snapshotter `dray` served on `socket`.
pub fn dray_proxy_plugin(socket: &Path) -> String {
    format!(
        "[proxy_plugins.dray]\n  type = \"snapshot\"\n  address = \"{}\"\n",
        socket.display()
    )
}

/// A `dray snapshotter` process with its root and socket under `dir`.
pub struct SnapshotterProc {
    child: std::process::Child,
    pub socket: PathBuf,
    pub root: PathBuf,
    agent_socket: PathBuf,
    config: Option<PathBuf>,
    log: PathBuf,
}

impl SnapshotterProc {
    /// Starts the shim and waits (up to 10 s) for its socket.
    pub fn start(dir: &Path, agent_socket: &Path) -> SnapshotterProc {
        SnapshotterProc::launch(dir, agent_socket, None)
    }

    /// Starts the shim with `config` as its config file (TOML; the socket,
    /// root and agent socket still come from flags).
    pub fn start_configured(dir: &Path, agent_socket: &Path, config: &str) -> SnapshotterProc {
        let path = dir.join("snapshotter.toml");
        std::fs::write(&path, config).unwrap();
        SnapshotterProc::launch(dir, agent_socket, Some(path))
    }

    fn launch(dir: &Path, agent_socket: &Path, config: Option<PathBuf>) -> SnapshotterProc {
        let socket = dir.join("snapshotter.sock");
        let root = dir.join("snapshotter");
        let log = dir.join("snapshotter.log");
        let child = SnapshotterProc::spawn(&socket, &root, agent_socket, config.as_deref(), &log);
        let mut shim = SnapshotterProc {
            child,
            socket,
            root,
            agent_socket: agent_socket.to_path_buf(),
            config,
            log,
        };
        shim.wait_for_socket();
        shim
    }

    fn spawn(
        socket: &Path,
        root: &Path,
        agent_socket: &Path,
        config: Option<&Path>,
        log: &Path,
    ) -> std::process::Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dray"));
        cmd.arg("snapshotter");
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        cmd.arg("--socket")
            .arg(socket)
            .arg("--root")
            .arg(root)
            .arg("--agent-socket")
            .arg(agent_socket)
            .env("DRAY_LOG", "dray_snapshotter_shim=debug")
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn wait_for_socket(&mut self) {
        for _ in 0..100 {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "dray snapshotter exited with {status}:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!(
            "dray snapshotter did not listen on {}",
            self.socket.display()
        );
    }

    /// What the shim logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, as a graceful stop; returns whether it exited successfully.
    pub fn stop(&mut self) -> bool {
        terminate(&mut self.child)
    }

    /// Stops it (SIGTERM, or SIGKILL as a crash) and starts it again on the
    /// same socket and root.
    pub fn restart(&mut self, crash: bool) {
        if crash {
            self.child.kill().unwrap();
            self.child.wait().unwrap();
        } else {
            assert!(
                self.stop(),
                "dray snapshotter failed on SIGTERM:\n{}",
                self.log_text()
            );
        }
        self.child = SnapshotterProc::spawn(
            &self.socket,
            &self.root,
            &self.agent_socket,
            self.config.as_deref(),
            &self.log,
        );
        self.wait_for_socket();
    }
}

impl Drop for SnapshotterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds the two-layer busybox test image and pushes `REPO:gzip` and `REPO:zstd`.
pub fn build_image(
    registry: &Registry,
    work: &Path,
    repo: &str,
    random_bytes: u64,
    creds: Option<&str>,
) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/build-image.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(script)
        .arg(work)
        .arg(registry.host())
        .arg(repo)
        .arg(random_bytes.to_string());
    if let Some(c) = creds {
        cmd.arg(c);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "building the image: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A registry mirror of `agent`, served from this process as `dray agent`
/// serves it.
pub struct MirrorProc {
    pub url: String,
    surfaces: Surfaces,
}

impl MirrorProc {
    /// `upstreams` maps registry names (containerd's `ns`) to base URLs; the
    /// first is also the default registry for requests without `ns`.
    pub async fn start(agent: &Agent, upstreams: &[(String, String)]) -> MirrorProc {
        MirrorProc::start_for(agent.pulls(), upstreams).await
    }

    /// A mirror serving through `pulls` (an agent's).
    pub async fn start_for(
        pulls: &Arc<dray_agent::pull::Pulls>,
        upstreams: &[(String, String)],
    ) -> MirrorProc {
        let config = dray_agent::serving::mirror::MirrorConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstreams: upstreams.iter().cloned().collect(),
            default_registry: upstreams.first().map(|(n, _)| n.clone()),
            ..Default::default()
        };
        let surfaces = Surfaces::serve(pulls, config, None).await.unwrap();
        MirrorProc {
            url: surfaces.mirror_url(),
            surfaces,
        }
    }

    /// Stops serving, as a stopped agent would.
    pub fn stop(&self) {
        self.surfaces.abort();
    }
}

/// Writes `<dir>/<registry>/hosts.toml`: the mirror first, `server` second.
pub fn hosts_dir(dir: &Path, registry: &str, server: &str, mirror: &str) -> PathBuf {
    let hosts = dir.join("certs.d");
    dray_agent::serving::containerd::write_hosts(&hosts, registry, server, mirror).unwrap();
    hosts
}

/// Open file descriptors of process `pid`; `None` once it is gone.
pub fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// A `dray` process started by a test; killed when dropped.
pub struct DrayProc {
    child: std::process::Child,
    /// The first line the process wrote to stderr (its start-up banner).
    pub banner: String,
}

impl DrayProc {
    /// Starts `dray ARGS`, waits for its banner, and keeps draining its stderr
    /// into `log` so that the process never blocks on a full pipe.
    pub fn start(args: &[&str], log: &Path) -> DrayProc {
        DrayProc::start_until(args, &[], "", log)
    }

    /// As [`DrayProc::start`], with `envs` set, taking as its banner the first
    /// stderr line containing `marker` (lines before it, such as logs, go to
    /// `log` too).
    pub fn start_until(args: &[&str], envs: &[(&str, &str)], marker: &str, log: &Path) -> DrayProc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dray"));
        cmd.args(args).envs(envs.iter().copied());
        DrayProc::spawn(cmd, args, marker, log)
    }

    /// As [`DrayProc::start`], run by `wrapper` (a program and its first
    /// arguments, such as `unshare`), which gets the dray binary and `args`.
    pub fn start_wrapped(wrapper: &[&str], args: &[&str], log: &Path) -> DrayProc {
        let mut cmd = Command::new(wrapper[0]);
        cmd.args(&wrapper[1..])
            .arg(env!("CARGO_BIN_EXE_dray"))
            .args(args);
        DrayProc::spawn(cmd, args, "", log)
    }

    fn spawn(mut cmd: Command, args: &[&str], marker: &str, log: &Path) -> DrayProc {
        use std::io::{BufRead, Write};
        let mut child = cmd.stderr(std::process::Stdio::piped()).spawn().unwrap();
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut file = std::fs::File::create(log).unwrap();
        let mut banner = String::new();
        loop {
            banner.clear();
            assert_ne!(
                stderr.read_line(&mut banner).unwrap(),
                0,
                "dray {args:?} exited before its banner"
            );
            file.write_all(banner.as_bytes()).unwrap();
            if banner.contains(marker) {
                break;
            }
        }
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut file));
        DrayProc { child, banner }
    }

    /// The process id (for reading its /proc entries).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, the graceful stop of a restart; returns whether it exited
    /// successfully. (Dropping it is a crash: SIGKILL.)
    pub fn terminate(&mut self) -> bool {
        terminate(&mut self.child)
    }

    /// The text after `marker` in the banner, up to the next space or `)`.
    pub fn banner_field(&self, marker: &str) -> String {
        self.banner
            .split(marker)
            .nth(1)
            .and_then(|rest| rest.split([' ', ')', ',', '\n']).next())
            .unwrap_or_else(|| panic!("no {marker:?} in banner {:?}", self.banner))
            .to_string()
    }
}

impl Drop for DrayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every agent's copy of blob `digest` hashes to it (recomputed here).
pub fn assert_identical(agents: &[Agent], digest: &str) {
    for a in agents {
        assert_eq!(
            file_digest(&a.blob_path(digest)),
            digest,
            "{} holds a different blob",
            a.dir.display()
        );
    }
}

/// Every hash `tracker` hands out for `real`'s blob is `real`'s: no forged
/// hash reached a node.
pub fn assert_no_forged_hash(tracker: &Tracker, real: &dray_protocol::ChunkMap) {
    if let Some(map) = tracker.map(&real.digest()) {
        for (i, h) in map.hashes().iter().enumerate() {
            if h.is_some() {
                assert_eq!(
                    *h,
                    real.hashes()[i],
                    "chunk {i}: a forged hash is handed out"
                );
            }
        }
    }
}

/// A finished command's stdout; panics with its output if it failed.
pub fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `dray ARGS` to completion; panics with its output if it fails;
/// returns its stdout.
pub fn dray_ok(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .output()
        .unwrap();
    ok(&out, &format!("dray {args:?}"))
}

/// A cluster CA in `dir/ca` and an agent certificate in `dir/<id>` per id.
pub fn issue_certificates(dir: &Path, ids: &[&str]) {
    let ca = dir.join("ca");
    dray_ok(&["ca", "init", "--dir", ca.to_str().unwrap()]);
    for id in ids {
        dray_ok(&[
            "ca",
            "issue",
            "--ca-dir",
            ca.to_str().unwrap(),
            "--peer-id",
            id,
            "--out",
            dir.join(id).to_str().unwrap(),
        ]);
    }
    dray_ok(&[
        "ca",
        "issue",
        "--ca-dir",
        ca.to_str().unwrap(),
        "--tracker",
        "--name",
        "localhost",
        "--name",
        "127.0.0.1",
        "--out",
        dir.join("tracker").to_str().unwrap(),
    ]);
}

/// A `dray tracker` process on loopback with the certificate
/// [`issue_certificates`] wrote under `dir` and the config lines `extra`;
/// returns it and its URL.
pub fn start_tracker(dir: &Path, extra: &str) -> (DrayProc, String) {
    let toml = dir.join("tracker.toml");
    std::fs::write(
        &toml,
        tracker_tls_toml(dir) + "listen = \"127.0.0.1:0\"\n" + extra,
    )
    .unwrap();
    let tracker = DrayProc::start(
        &["tracker", "-c", toml.to_str().unwrap()],
        &dir.join("tracker.log"),
    );
    let url = format!("https://{}", tracker.banner_field("listening on https://"));
    (tracker, url)
}

/// The TLS lines of a `dray tracker` config for the tracker certificate
/// [`issue_certificates`] wrote under `dir`.
pub fn tracker_tls_toml(dir: &Path) -> String {
    let file = |f: &str| dir.join("tracker").join(f);
    format!(
        "cert = {:?}\nkey = {:?}\nca = {:?}\n",
        file("tracker.crt"),
        file("tracker.key"),
        file("ca.crt")
    )
}

/// The peak resident set (VmHWM) of process `pid` (`"self"`: this test
/// process), bytes.
pub fn peak_rss(pid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kib << 10
}

/// A GET of a small answer at `url` (http:// or https://; a tracker's
/// certificate is checked against the CA [`issue_certificates`] made under
/// `dir`), by curl: (status, body).
pub fn curl_get(dir: &Path, url: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(dir.join("tracker").join("ca.crt"))
        .arg(url)
        .output()
        .unwrap();
    let text = ok(&out, &format!("GET {url}"));
    let (body, status) = text.rsplit_once('\n').expect("curl's status line");
    (status.trim().parse().unwrap(), body.to_string())
}

/// A plain HTTP/1.1 GET of a small response on loopback: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    (status, body.to_string())
}

/// The local API of `agent` (what `dray agent` serves on its unix socket),
/// served from this process on `socket` as `dray agent` serves it (beside a
/// mirror on a free port); registry names map to base URLs.
pub struct LocalApiProc {
    pub socket: PathBuf,
    _surfaces: Surfaces,
}

impl LocalApiProc {
    pub async fn start(
        agent: &Agent,
        socket: &Path,
        upstreams: &[(String, String)],
    ) -> LocalApiProc {
        let mirror = dray_agent::serving::mirror::MirrorConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstreams: upstreams.iter().cloned().collect(),
            ..Default::default()
        };
        let config = dray_agent::serving::local_api::LocalApiConfig {
            socket: socket.to_path_buf(),
            unpack_concurrency: 0,
            // Tests unpack beside the socket (the snapshotter's root among them).
            unpack_roots: socket.parent().into_iter().map(Path::to_path_buf).collect(),
        };
        let limits = dray_agent::unpack::UnpackLimits::default();
        LocalApiProc {
            socket: socket.to_path_buf(),
            _surfaces: Surfaces::serve(agent.pulls(), mirror, Some((&config, limits)))
                .await
                .unwrap(),
        }
    }

    /// `POST /v1/layers/unpack`: the status and the JSON answer.
    pub async fn unpack(
        &self,
        request: &dray_agent::serving::local_api::UnpackRequest,
    ) -> (u16, serde_json::Value) {
        let resp = reqwest::Client::builder()
            .unix_socket(self.socket.clone())
            .build()
            .unwrap()
            .post("http://agent/v1/layers/unpack")
            .json(request)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }
}

/// Sends `child` SIGTERM and waits for it; whether it exited successfully.
fn terminate(child: &mut std::process::Child) -> bool {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    child.wait().unwrap().success()
}

/// Waits until `series` at `base` reaches `at_least`; fails with `what`
/// after `within`.
pub fn until_metric(
    dir: &Path,
    base: &str,
    series: &str,
    at_least: f64,
    within: Duration,
    what: &str,
) {
    let started = Instant::now();
    while metric(dir, base, series) < at_least {
        assert!(started.elapsed() < within, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of the sample `series` in the exposition at `base` (0 if
/// absent); `dir` holds the test's CA.
pub fn metric(dir: &Path, base: &str, series: &str) -> f64 {
    let (status, body) = curl_get(dir, &format!("{base}/metrics"));
    assert_eq!(status, 200, "{base}/metrics: {body}");
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// A `dray agent` config for node `id` (certificates from
/// [`issue_certificates`] under `dir`), announcing to `tracker` (to none if it is empty), mirroring
/// `registry`; `swarm_extra` is added to its `[swarm]` table.
pub fn agent_toml(
    dir: &Path,
    id: &str,
    tracker: &str,
    registry: &Registry,
    swarm_extra: &str,
) -> String {
    let d = |p: &str| dir.join(id).join(p).display().to_string();
    // No tracker: an empty list.
    let trackers = if tracker.is_empty() {
        "[]".to_string()
    } else {
        format!("[{tracker:?}]")
    };
    format!(
        "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         cert = {:?}\nkey = {:?}\nca = {:?}\n\
         [peer]\nrequest_timeout = \"10s\"\n\
         [swarm]\ntrackers = {trackers}\npull_announce_ms = 150\nidle_announce_ms = 300\n\
         tracker_grace_ms = 5000\nstall_ms = 10000\n{swarm_extra}\n\
         [local_api]\nsocket = {:?}\n\
         [mirror]\nlisten = \"127.0.0.1:0\"\nupstreams = {{ {:?} = {:?} }}\n",
        d("state"),
        d("agent.crt"),
        d("agent.key"),
        d("ca.crt"),
        d("agent.sock"),
        registry.host(),
        registry.url(),
    )
}
