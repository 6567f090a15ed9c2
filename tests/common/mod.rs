//! Test harness: the real distribution registry from Debian behind a counting
//! (and optionally throttling) TCP relay, a tracker and agents in this process.

#![allow(dead_code)] // each test binary uses a different part of the harness

use dray_agent::identity::ClusterCa;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::registry::{Credentials, RegistryClient};
use dray_agent::store::ChunkStore;
use dray_agent::swarm::{Swarm, SwarmConfig};
use dray_tracker::{Tracker, TrackerConfig};
use sha2::Digest;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// sha256 of a file, computed here rather than trusted from the store.
pub fn file_digest(path: &Path) -> String {
    let mut f = std::fs::File::open(path).unwrap();
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    format!("sha256:{}", hex::encode(h.finalize()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `docker-registry` process on loopback, reached through a counting relay.
pub struct Registry {
    child: Child,
    pub port: u16,
    relay: Relay,
    auth: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry; with `auth`, behind htpasswd basic auth.
    pub async fn start(auth: Option<(&str, &str)>) -> Registry {
        init_logs();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cfg = format!(
            "version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {}}}, delete: {{enabled: true}}}}\nhttp: {{addr: \"127.0.0.1:{port}\", secret: test}}\n",
            dir.path().join("data").display()
        );
        if let Some((user, pass)) = auth {
            let htpasswd = dir.path().join("htpasswd");
            let ok = Command::new("htpasswd")
                .args(["-Bbc", htpasswd.to_str().unwrap(), user, pass])
                .stderr(Stdio::null())
                .status()
                .expect("htpasswd (apache2-utils) is installed by scripts/test.sh");
            assert!(ok.success());
            cfg.push_str(&format!(
                "auth: {{htpasswd: {{realm: test, path: {}}}}}\n",
                htpasswd.display()
            ));
        }
        let cfg_path = dir.path().join("config.yml");
        std::fs::write(&cfg_path, cfg).unwrap();
        let child = Command::new("docker-registry")
            .args(["serve", cfg_path.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry is installed by scripts/test.sh");
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let relay = Relay::start(port).await;
        Registry {
            child,
            port,
            relay,
            auth: auth.map(|(u, p)| (u.into(), p.into())),
            _dir: dir,
        }
    }

    /// Base URL through the counting relay (what agents use).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.relay.port)
    }

    /// Bytes the registry sent through the relay so far.
    pub fn egress(&self) -> u64 {
        self.relay.down.load(Ordering::Relaxed)
    }

    /// Limits what the registry sends through the relay, bytes per second.
    pub fn throttle(&self, bytes_per_s: u64) {
        self.relay.rate.store(bytes_per_s, Ordering::Relaxed);
    }

    /// Uploads a file as a blob of `repo`, straight to the registry (not counted).
    pub fn push(&self, repo: &str, file: &Path) -> String {
        let digest = file_digest(file);
        let base = format!("http://127.0.0.1:{}", self.port);
        let mut auth = Vec::new();
        if let Some((u, p)) = &self.auth {
            auth = vec!["-u".to_string(), format!("{u}:{p}")];
        }
        let out = Command::new("curl")
            .args(["-sfS", "-X", "POST", "-D", "-", "-o", "/dev/null"])
            .args(&auth)
            .arg(format!("{base}/v2/{repo}/blobs/uploads/"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "upload start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let headers = String::from_utf8(out.stdout).unwrap();
        let location = headers
            .lines()
            .find_map(|l| {
                l.strip_prefix("Location: ")
                    .or_else(|| l.strip_prefix("location: "))
            })
            .expect("Location header")
            .trim()
            .to_string();
        let location = if location.starts_with("http") {
            location
        } else {
            format!("{base}{location}")
        };
        let sep = if location.contains('?') { '&' } else { '?' };
        let out = Command::new("curl")
            .args([
                "-sfS",
                "-X",
                "PUT",
                "-H",
                "Content-Type: application/octet-stream",
                "--data-binary",
            ])
            .arg(format!("@{}", file.display()))
            .args(&auth)
            .arg(format!("{location}{sep}digest={digest}"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "upload: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        digest
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP relay that counts (and can pace) bytes flowing from upstream to clients.
struct Relay {
    port: u16,
    down: Arc<AtomicU64>,
    rate: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = Arc::new(AtomicU64::new(0));
        let rate = Arc::new(AtomicU64::new(0));
        let (d, r) = (down.clone(), rate.clone());
        let task = tokio::spawn(async move {
            let pacer = Arc::new(tokio::sync::Mutex::new(()));
            while let Ok((client, _)) = listener.accept().await {
                let (d, r, pacer) = (d.clone(), r.clone(), pacer.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                        let _ = sw.shutdown().await;
                    });
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let rate = r.load(Ordering::Relaxed);
                        if rate > 0 {
                            // One pacer for all connections: the registry's total egress is capped.
                            let _g = pacer.lock().await;
                            tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64))
                                .await;
                        }
                        d.fetch_add(n as u64, Ordering::Relaxed);
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    up.abort();
                });
            }
        });
        Relay {
            port,
            down,
            rate,
            task,
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A tracker served from this process.
pub struct TrackerProc {
    pub tracker: Arc<Tracker>,
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TrackerProc {
    pub async fn start(config: &TrackerConfig, addr: &str) -> TrackerProc {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tracker = Tracker::new(config);
        let task = tokio::spawn(dray_tracker::serve(listener, tracker.clone()));
        TrackerProc {
            tracker,
            addr,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving, as a crash would: every connection is dropped.
    pub fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for TrackerProc {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Tracker settings that react within a test's patience.
pub fn quick_tracker() -> TrackerConfig {
    TrackerConfig {
        announce_interval_ms: 500,
        min_fetch_timeout_ms: 1_000,
        ..TrackerConfig::default()
    }
}

/// Swarm settings that react within a test's patience.
pub fn quick_swarm(trackers: Vec<String>) -> SwarmConfig {
    SwarmConfig {
        trackers,
        pull_announce_ms: 150,
        idle_announce_ms: 300,
        tracker_grace_ms: 1_500,
        stall_ms: 4_000,
        ..SwarmConfig::default()
    }
}

/// An agent in this process.
pub struct Agent {
    pub swarm: Arc<Swarm>,
    pub dir: PathBuf,
    announcer: tokio::task::JoinHandle<()>,
}

impl Agent {
    pub fn start(
        ca: &ClusterCa,
        id: &str,
        root: &Path,
        config: SwarmConfig,
        peer: PeerConfig,
    ) -> Agent {
        let dir = root.join(id);
        let store = Arc::new(ChunkStore::open(&dir).unwrap());
        let node = PeerNode::bind(
            ca.issue(id).unwrap(),
            store,
            "127.0.0.1:0".parse().unwrap(),
            peer,
        )
        .unwrap();
        let swarm = Swarm::new(node, config);
        let announcer = swarm.spawn_announcer();
        Agent {
            swarm,
            dir,
            announcer,
        }
    }

    /// Path of a blob's file in this agent's store.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// Stops the agent as a crash would: no more announces, answers or uploads.
    pub fn kill(&self) {
        self.announcer.abort();
        self.swarm.node().close();
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
