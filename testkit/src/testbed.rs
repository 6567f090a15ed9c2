//! A registry testbed on loopback: the real distribution registry from Debian
//! (`docker-registry`) behind a relay that counts, and can pace, the bytes it
//! sends. Registry egress is measured here, on the registry's side, never from
//! the agents' own claims. Used by `dray bench` and by the tests.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// sha256 of a file, computed here rather than trusted from a store.
pub fn file_digest(path: &Path) -> String {
    crate::oci_image::sha256_file(path)
        .unwrap_or_else(|e| panic!("hashing {}: {e}", path.display()))
}

/// A TCP port on 127.0.0.1 free a moment ago.
pub fn free_port() -> u16 {
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
    dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry; with `auth`, behind htpasswd basic auth.
    pub async fn start(auth: Option<(&str, &str)>) -> Registry {
        Registry::start_with(auth, None).await
    }

    /// Starts a registry whose `auth:` section is `auth_yaml` (a YAML flow
    /// map), e.g. `{token: {realm: ..., service: ..., issuer: ..., rootcertbundle: ...}}`
    /// for a token server written by a test. `push` needs basic auth, so a
    /// test uploads through its own token there.
    pub async fn start_with_auth(auth_yaml: &str) -> Registry {
        Registry::start_with(None, Some(auth_yaml)).await
    }

    async fn start_with(auth: Option<(&str, &str)>, auth_yaml: Option<&str>) -> Registry {
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
        if let Some(yaml) = auth_yaml {
            cfg.push_str(&format!("auth: {yaml}\n"));
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
            dir,
        }
    }

    /// The registry process's id (to read its CPU time).
    pub fn pid(&self) -> u32 {
        self.child.id()
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

    /// Flips one bit of what the registry sends: the byte `offset` bytes
    /// into the first connection whose answers reach that far (a chunk's
    /// body, for an offset past the headers), once. A registry fetch that
    /// stores a wrong chunk, for tests of what a digest failure costs.
    pub fn corrupt_once(&self, offset: u64) {
        self.relay.corrupt.store(offset, Ordering::Relaxed);
    }

    /// Another counting relay to the same registry, for a second kind of client.
    pub async fn side_door(&self) -> Relay {
        Relay::start(self.port).await
    }

    /// The registry's own `host:port`, as image references name it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Where the registry keeps a blob's bytes (for tests that damage it).
    pub fn blob_file(&self, digest: &str) -> std::path::PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Runs `curl -sfS ARGS` against the registry itself (with its
    /// credentials, if any); panics naming `what` if it fails; returns stdout.
    fn curl(&self, what: &str, args: &[&str]) -> String {
        let mut cmd = Command::new("curl");
        cmd.arg("-sfS").args(args);
        if let Some((u, p)) = &self.auth {
            cmd.arg("-u").arg(format!("{u}:{p}"));
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Puts an image manifest as `repo:tag`, straight to the registry.
    pub fn push_manifest(&self, repo: &str, tag: &str, manifest: &str) {
        let url = format!("http://127.0.0.1:{}/v2/{repo}/manifests/{tag}", self.port);
        self.curl(
            "manifest upload",
            &[
                "-X",
                "PUT",
                "-H",
                "Content-Type: application/vnd.oci.image.manifest.v1+json",
                "--data-binary",
                manifest,
                &url,
            ],
        );
    }

    /// Uploads a file as a blob of `repo`, straight to the registry (not counted).
    pub fn push(&self, repo: &str, file: &Path) -> String {
        let digest = file_digest(file);
        let base = format!("http://127.0.0.1:{}", self.port);
        let start = format!("{base}/v2/{repo}/blobs/uploads/");
        let headers = self.curl(
            "upload start",
            &["-X", "POST", "-D", "-", "-o", "/dev/null", &start],
        );
        let put_url = upload_url(&base, &headers, &digest).expect("Location header");
        // `-T` streams the file (`--data-binary @` reads it into memory,
        // and fails past curl's limit of about 1 GiB).
        self.curl(
            "upload",
            &[
                "-H",
                "Content-Type: application/octet-stream",
                "-T",
                &file.display().to_string(),
                &put_url,
            ],
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

/// The URL that completes a monolithic upload: the `Location` of the
/// registry's answer to `POST .../blobs/uploads/` (made absolute against
/// `base`) with the blob's digest added; `None` without a `Location`.
pub fn upload_url(base: &str, upload_headers: &str, digest: &str) -> Option<String> {
    let location = upload_headers
        .lines()
        .find_map(|l| {
            l.strip_prefix("Location: ")
                .or_else(|| l.strip_prefix("location: "))
        })?
        .trim();
    let location = if location.starts_with("http") {
        location.to_string()
    } else {
        format!("{base}{location}")
    };
    let sep = if location.contains('?') { '&' } else { '?' };
    Some(format!("{location}{sep}digest={digest}"))
}

/// A TCP relay that counts (and can pace) bytes flowing from upstream to clients.
pub struct Relay {
    port: u16,
    down: Arc<AtomicU64>,
    rate: Arc<AtomicU64>,
    /// Stream offset of the next byte to flip; `u64::MAX`: none.
    corrupt: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start(upstream: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let down = Arc::new(AtomicU64::new(0));
        let rate = Arc::new(AtomicU64::new(0));
        let corrupt = Arc::new(AtomicU64::new(u64::MAX));
        let (d, r, c) = (down.clone(), rate.clone(), corrupt.clone());
        let task = tokio::spawn(async move {
            let pacer = Arc::new(tokio::sync::Mutex::new(tokio::time::Instant::now()));
            while let Ok((client, _)) = listener.accept().await {
                let (d, r, c, pacer) = (d.clone(), r.clone(), c.clone(), pacer.clone());
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
                    let mut sent = 0u64;
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let at = c.load(Ordering::Relaxed);
                        if (sent..sent + n as u64).contains(&at)
                            && c.compare_exchange(
                                at,
                                u64::MAX,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            )
                            .is_ok()
                        {
                            buf[(at - sent) as usize] ^= 0x01;
                        }
                        sent += n as u64;
                        let rate = r.load(Ordering::Relaxed);
                        if rate > 0 {
                            // One schedule for all connections caps the registry's total
                            // egress. Sleeping until an absolute time keeps timer
                            // rounding from adding up.
                            let due = {
                                let mut next = pacer.lock().await;
                                let now = tokio::time::Instant::now();
                                *next = (*next).max(now)
                                    + Duration::from_secs_f64(n as f64 / rate as f64);
                                *next
                            };
                            tokio::time::sleep_until(due).await;
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
            corrupt,
            task,
        }
    }
}

impl Relay {
    /// Base URL of the relay.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Bytes sent from upstream through this relay so far.
    pub fn egress(&self) -> u64 {
        self.down.load(Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
