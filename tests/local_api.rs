//! Issue 17 acceptance 4: the local API unpacks only under the snapshotter's
//! root (`local_api.unpack_roots`), whatever `..` or symlinks say; and the
//! shim gives each agent unpack a deadline (a floor plus the layer's size at
//! a slowest rate), past which it hangs up and containerd pulls the layer
//! itself: real containerd 1.6 with its CRI plugin, `dray snapshotter` as a
//! process, the distribution registry behind a throttled relay.
//!
//! Issue 37 finding 5: the local API's pulls keep the mirror's rules (only
//! registries the mirror serves; no blob held from one registry handed out
//! for another that cannot prove it holds the same bytes; no disk reserved
//! past what the manifest and the registry agree on), and a registry that
//! trickles is given up at the range deadline. A size another manifest
//! gave a layer does not fail its pull (finding 9). A `dray agent` process, the
//! real distribution registry for the honest image, and a lying registry
//! written here (plain HTTP on loopback) for the rest.

mod common;
#[path = "common/cri.rs"]
mod cri;

use common::*;
use dray_agent::serving::local_api::UnpackRequest;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// `POST /v1/layers/unpack` on the socket: the status and the error text.
async fn unpack(socket: &Path, target: &Path) -> (u16, String) {
    let request = UnpackRequest {
        image_ref: "127.0.0.1:9/never/fetched:1".into(),
        manifest_digest: format!("sha256:{}", "1".repeat(64)),
        layer_digest: format!("sha256:{}", "2".repeat(64)),
        target: target.to_path_buf(),
    };
    // This process's first client may be this one (the test run alone).
    dray_agent::pull::registry::install_crypto_provider();
    let resp = reqwest::Client::builder()
        .unix_socket(socket.to_path_buf())
        .build()
        .unwrap()
        .post("http://agent/v1/layers/unpack")
        .json(&request)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body: serde_json::Value = resp.json().await.unwrap();
    (
        status,
        body["error"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpack_outside_the_snapshotters_root_is_refused_however_the_path_gets_there() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().canonicalize().unwrap();
    issue_certificates(&work, &["node-a"]);
    let root = work.join("snapshotter");
    std::fs::create_dir(&root).unwrap();
    let d = |p: &str| work.join("node-a").join(p).display().to_string();
    let socket = work.join("agent.sock");
    let cfg = work.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             cert = {:?}\nkey = {:?}\nca = {:?}\n\
             [local_api]\nsocket = {socket:?}\nunpack_roots = [{root:?}]\n\
             [mirror]\nlisten = \"127.0.0.1:0\"\n\
             upstreams = {{ \"127.0.0.1:9\" = \"http://127.0.0.1:9\" }}\n",
            d("state"),
            d("agent.crt"),
            d("agent.key"),
            d("ca.crt"),
        ),
    )
    .unwrap();
    let _agent = DrayProc::start(
        &["agent", "-c", cfg.to_str().unwrap()],
        &work.join("agent.log"),
    );
    let roots = format!("[{}]", root.display());

    // Straight into /etc, as a systemd drop-in would go.
    let etc = PathBuf::from(format!("/etc/dray-test-{}.service.d", std::process::id()));
    let (status, error) = unpack(&socket, &etc).await;
    assert_eq!(status, 403, "{error}");
    assert_eq!(
        error,
        format!(
            "target {} is outside the unpack roots {roots}: the agent unpacks only under local_api.unpack_roots, which should name the snapshotter's root",
            etc.display()
        )
    );
    assert!(!etc.exists());

    // Through a symlink inside the root.
    std::os::unix::fs::symlink("/etc", root.join("to-etc")).unwrap();
    let linked = root.join("to-etc").join(etc.file_name().unwrap());
    let (status, error) = unpack(&socket, &linked).await;
    assert_eq!(status, 403, "{error}");
    assert!(
        error.starts_with(&format!(
            "target {} (resolved: {}) is outside the unpack roots {roots}",
            linked.display(),
            etc.display()
        )),
        "{error}"
    );
    assert!(!etc.exists());

    // Climbing out with `..`.
    let climbing = root.join("..").join("escaped");
    let (status, error) = unpack(&socket, &climbing).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(
        error,
        format!(
            "target {} must be an absolute path without ..",
            climbing.display()
        )
    );
    assert!(!work.join("escaped").exists());

    // A sibling of the root whose name merely starts like it.
    let sibling = work.join("snapshotter-not").join("x");
    std::fs::create_dir(work.join("snapshotter-not")).unwrap();
    let (status, error) = unpack(&socket, &sibling).await;
    assert_eq!(status, 403, "{error}");

    // Under the root the target passes the check: the failure is the
    // registry's (nothing listens on port 9), and nothing is left behind.
    let inside = root.join("snapshots-new");
    let (status, error) = unpack(&socket, &inside).await;
    assert_eq!(status, 502, "{error}");
    assert!(!inside.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_unpack_past_the_shims_deadline_falls_back_to_containerds_own_pull_and_the_image_runs()
 {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    let registry = Registry::start(None).await;
    build_image(&registry, &work.join("img"), "slow/app", 8 << 20, None);
    // The agent reads the registry at 1 MB/s: the 8 MiB layer needs 8 s.
    registry.throttle(1_000_000);
    let agent = Agent::alone("node-a", work);
    let upstreams = [(registry.host(), registry.url())];
    let api = LocalApiProc::start(&agent, &work.join("agent.sock"), &upstreams).await;
    // A deadline of 1 s per layer whatever its size (1 GB/s on top of 1 s).
    let shim = SnapshotterProc::start_configured(
        work,
        &api.socket,
        "unpack_deadline_floor = \"1s\"\nunpack_min_bytes_per_s = 1000000000\n",
    );
    // containerd's own pulls go straight to the registry, unthrottled.
    let side_door = registry.side_door().await;
    let hosts = hosts_dir(work, &registry.host(), &side_door.url(), &side_door.url());
    let ctrd = Containerd::start_cri(&hosts, "dray", &dray_proxy_plugin(&shim.socket));

    let image = format!("{}/slow/app:gzip", registry.host());
    let mut client = cri::client(Path::new(&ctrd.address)).await;
    let started = std::time::Instant::now();
    let pulled = tokio::time::timeout(
        Duration::from_secs(60),
        cri::pull_image(&mut client, &image),
    )
    .await
    .expect("PullImage ends");
    let took = started.elapsed();
    pulled.unwrap_or_else(|e| panic!("PullImage {image}: {e}\nshim log:\n{}", shim.log_text()));
    let log = shim.log_text();
    assert!(
        log.contains("within 1.0 s (unpack_deadline_floor"),
        "the shim gave up on an agent unpack at its deadline:\n{log}"
    );
    // containerd fetched the layers the agent was too slow for itself.
    let content = ok(&ctrd.ctr(&["-n", "k8s.io", "content", "ls"]), "content ls");
    let big = big_layer(&side_door.url(), "slow/app", "gzip");
    assert!(
        content.lines().any(|l| l.starts_with(&big)),
        "containerd pulled the slow layer {big} itself:\n{content}"
    );
    eprintln!(
        "PullImage took {took:?}; the relay for containerd sent {} bytes",
        side_door.egress()
    );
    let out = ctrd.ctr(&[
        "-n",
        "k8s.io",
        "run",
        "--rm",
        "--snapshotter",
        "dray",
        &image,
        "deadline",
        "/bin/cat",
        "/etc/greeting",
    ]);
    assert_eq!(ok(&out, "ctr run"), "hello from dray\n");

    // The agent abandoned the unpacks the shim hung up on: once its pull of
    // the slow layer ended, nothing but snapshots is left in the shim's root.
    let blob = agent.blob_path(&big);
    let verified = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        blob.exists() && file_digest(&blob) == big
    });
    assert!(verified, "the agent's pull of {big} went on and completed");
    std::thread::sleep(Duration::from_millis(500));
    let stray: Vec<_> = std::fs::read_dir(shim.root.join("snapshots"))
        .unwrap()
        .chain(std::fs::read_dir(shim.root.join("staging")).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.parse::<u64>().is_err())
        .collect();
    assert!(stray.is_empty(), "left in the shim's root: {stray:?}");
}

/// The digest of the image's last (largest) layer, read from the registry at `base`.
fn big_layer(base: &str, repo: &str, tag: &str) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sfS",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!("{base}/v2/{repo}/manifests/{tag}"))
        .output()
        .unwrap();
    let m: serde_json::Value = serde_json::from_str(&ok(&out, "manifest")).unwrap();
    m["layers"].as_array().unwrap().last().unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

/// One image of one layer: its manifest, config and layer bytes.
struct OneLayer {
    manifest: String,
    config: Vec<u8>,
    config_digest: String,
    layer: Vec<u8>,
    layer_digest: String,
}

impl OneLayer {
    /// An image whose layer is `layer` (never unpacked by these tests) and
    /// whose manifest gives the layer `claimed` bytes.
    fn new(layer: Vec<u8>, claimed: u64) -> OneLayer {
        let layer_digest = format!("sha256:{}", hex::encode(sha256(&layer)));
        let config = format!(
            r#"{{"architecture":"amd64","os":"linux","rootfs":{{"type":"layers","diff_ids":["{layer_digest}"]}}}}"#
        )
        .into_bytes();
        let config_digest = format!("sha256:{}", hex::encode(sha256(&config)));
        let manifest = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{layer_digest}","size":{claimed}}}]}}"#,
            config.len()
        );
        OneLayer {
            manifest,
            config,
            config_digest,
            layer,
            layer_digest,
        }
    }

    /// Pushes it to the real registry as `repo:1`.
    fn push(&self, registry: &Registry, dir: &Path, repo: &str) {
        for (name, bytes) in [("config", &self.config), ("layer", &self.layer)] {
            let file = dir.join(format!("{}-{name}", repo.replace('/', "-")));
            std::fs::write(&file, bytes).unwrap();
            registry.push(repo, &file);
        }
        registry.push_manifest(repo, "1", &self.manifest);
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// How the lying registry answers a range of the layer.
#[derive(Clone, Copy)]
enum Ranges {
    /// At once, with zeros: bytes it does not have.
    Zeros,
    /// 1 KiB every 100 ms: never idle long enough for a read timeout.
    Trickle,
}

/// A registry that lies, on loopback: it serves `image` (any repository,
/// tag `1`), says its layer has `head_size` bytes, answers ranges of it as
/// `ranges` says; counts the connections it gets. Plain HTTP/1.1, one
/// request per connection.
struct LyingRegistry {
    port: u16,
    connections: Arc<AtomicU64>,
}

impl LyingRegistry {
    fn start(image: OneLayer, head_size: u64, ranges: Ranges) -> LyingRegistry {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicU64::new(0));
        let (count, image) = (connections.clone(), Arc::new(image));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { break };
                count.fetch_add(1, Ordering::Relaxed);
                let image = image.clone();
                std::thread::spawn(move || answer(stream, &image, head_size, ranges));
            }
        });
        LyingRegistry { port, connections }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn url(&self) -> String {
        format!("http://{}", self.host())
    }

    fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

/// Answers one request of the lying registry.
fn answer(stream: std::net::TcpStream, image: &OneLayer, head_size: u64, ranges: Ranges) {
    use std::io::{BufRead, Write};
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let mut range = None;
    for _ in 0..100 {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
            let (a, b) = v.trim().split_once('-').unwrap();
            range = Some((a.parse::<u64>().unwrap(), b.parse::<u64>().unwrap() + 1));
        }
    }
    let path = path.split('?').next().unwrap_or("");
    let mut out = stream;
    let mut send = |status: &str, headers: &str, body: &[u8]| {
        let head = format!(
            "HTTP/1.1 {status}\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        );
        let _ = out.write_all(head.as_bytes());
        if method != "HEAD" {
            let _ = out.write_all(body);
        }
    };
    if path.ends_with("/manifests/1") {
        let ct = "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n";
        return send("200 OK", ct, image.manifest.as_bytes());
    }
    if path.ends_with(&format!("/blobs/{}", image.config_digest)) {
        return send("200 OK", "", &image.config);
    }
    if !path.ends_with(&format!("/blobs/{}", image.layer_digest)) {
        return send("404 Not Found", "", b"");
    }
    let (start, end) = match (method, range) {
        ("HEAD", _) | (_, None) => {
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {head_size}\r\n\r\n");
            let _ = out.write_all(head.as_bytes());
            return;
        }
        (_, Some(r)) => r,
    };
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\nConnection: close\r\nContent-Range: bytes {start}-{}/{head_size}\r\nContent-Length: {}\r\n\r\n",
        end - 1,
        end - start
    );
    if out.write_all(head.as_bytes()).is_err() {
        return;
    }
    let piece = match ranges {
        Ranges::Zeros => vec![0u8; (end - start) as usize],
        Ranges::Trickle => vec![0u8; 1024],
    };
    let mut left = end - start;
    while left > 0 {
        let n = left.min(piece.len() as u64) as usize;
        if out.write_all(&piece[..n]).is_err() {
            return;
        }
        left -= n as u64;
        if matches!(ranges, Ranges::Trickle) {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A `dray agent` process with its local API on `dir/agent.sock`,
/// mirroring `upstreams` (registry name, base URL), with `extra` TOML at
/// the end; its mirror's base URL.
fn start_agent(dir: &Path, upstreams: &[(String, String)], extra: &str) -> (DrayProc, String) {
    issue_certificates(dir, &["node-a"]);
    let d = |p: &str| dir.join("node-a").join(p).display().to_string();
    let upstreams = upstreams
        .iter()
        .map(|(n, u)| format!("{n:?} = {u:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let cfg = dir.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             cert = {:?}\nkey = {:?}\nca = {:?}\n\
             [local_api]\nsocket = {:?}\nunpack_roots = [{:?}]\n\
             [mirror]\nlisten = \"127.0.0.1:0\"\nupstreams = {{ {upstreams} }}\n{extra}",
            d("state"),
            d("agent.crt"),
            d("agent.key"),
            d("ca.crt"),
            dir.join("agent.sock"),
            dir,
        ),
    )
    .unwrap();
    let agent = DrayProc::start(
        &["agent", "-c", cfg.to_str().unwrap()],
        &dir.join("agent.log"),
    );
    let mirror = agent.banner_field("registry mirror on ");
    (agent, mirror)
}

/// `POST /v1/images/pull` on `dir/agent.sock` for `image`, read to its end
/// or for at most `patience`: the status, and the error (the refusal, or
/// the last progress line's) or whether every layer is done.
async fn pull_image(dir: &Path, image: &str, patience: Duration) -> (u16, Result<bool, String>) {
    dray_agent::pull::registry::install_crypto_provider();
    let resp = reqwest::Client::builder()
        .unix_socket(dir.join("agent.sock"))
        .build()
        .unwrap()
        .post("http://agent/v1/images/pull")
        .json(&serde_json::json!({ "image": image }))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = match tokio::time::timeout(patience, resp.text()).await {
        Ok(body) => body.unwrap(),
        Err(_) => return (status, Err(format!("no end within {patience:?}"))),
    };
    let last: serde_json::Value = body
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_default();
    let result = match last["error"].as_str() {
        Some(e) => Err(e.to_string()),
        None => Ok(last["done"].as_bool().unwrap_or(false)),
    };
    (status, result)
}

/// The blob files in the agent's store under `dir`.
fn stored_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("node-a/state/blobs"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_api_pulls_only_from_served_registries_and_never_a_blob_held_from_another() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().canonicalize().unwrap();
    let registry = Registry::start(None).await;
    random_file(&work.join("layer"), 1 << 20);
    let layer = std::fs::read(work.join("layer")).unwrap();
    let honest = OneLayer::new(layer.clone(), layer.len() as u64);
    honest.push(&registry, &work, "team/app");
    let size = layer.len() as u64;
    // A server the operator lists, which names the honest layer in its own
    // manifest and says yes to its HEAD, but does not have its bytes.
    let listed = LyingRegistry::start(OneLayer::new(layer.clone(), size), size, Ranges::Zeros);
    // One nobody listed.
    let unlisted = LyingRegistry::start(OneLayer::new(layer.clone(), size), size, Ranges::Zeros);
    let upstreams = [
        (registry.host(), registry.url()),
        (listed.host(), listed.url()),
    ];
    let (_agent, mirror) = start_agent(&work, &upstreams, "");
    let patience = Duration::from_secs(60);

    // A registry the mirror does not serve: refused before any connection.
    let (status, result) =
        pull_image(&work, &format!("{}/any/app:1", unlisted.host()), patience).await;
    assert_eq!(status, 403, "{result:?}");
    let error = result.unwrap_err();
    assert!(
        error.contains(&format!(
            "registry {} is not one this node's mirror serves",
            unlisted.host()
        )),
        "{error}"
    );
    assert_eq!(unlisted.connections(), 0, "the agent connected to it");

    // A host process has the mirror read a manifest of its own naming the
    // layer with another size (issue 37 finding 9): that size admits only
    // itself, and the layer's real size still pulls.
    OneLayer::new(layer.clone(), size + 1).push(&registry, &work, "team/liar");
    let lie = reqwest::Client::new()
        .get(format!(
            "{mirror}/v2/team/liar/manifests/1?ns={}",
            registry.host()
        ))
        .header("Accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .await
        .unwrap();
    assert_eq!(
        lie.status().as_u16(),
        200,
        "the lying manifest went through"
    );

    // The honest image: pulled into the store.
    let (status, result) =
        pull_image(&work, &format!("{}/team/app:1", registry.host()), patience).await;
    assert_eq!((status, result), (200, Ok(true)));

    // The listed server's image names the same layer: it is not handed out
    // for it, and that server does not become one of the layer's origins.
    let (status, result) =
        pull_image(&work, &format!("{}/evil/app:1", listed.host()), patience).await;
    assert_eq!(status, 403, "{result:?}");
    let error = result.unwrap_err();
    assert!(
        error.contains(&format!(
            "blob {} on this node came from {}, not from {}",
            honest.layer_digest,
            registry.url(),
            listed.url()
        )),
        "{error}"
    );
    let url = format!(
        "{mirror}/v2/evil/app/blobs/{}?ns={}",
        honest.layer_digest,
        listed.host()
    );
    let status = reqwest::get(&url).await.unwrap().status().as_u16();
    assert_eq!(status, 404, "the mirror hands the layer out for the liar");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_trickles_or_lies_about_sizes_holds_no_disk() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().canonicalize().unwrap();
    random_file(&work.join("layer"), 2 << 20);
    let layer = std::fs::read(work.join("layer")).unwrap();
    let size = layer.len() as u64;
    // Its manifest says 256 MiB; its HEAD says what the layer has.
    let inflating =
        LyingRegistry::start(OneLayer::new(layer.clone(), 256 << 20), size, Ranges::Zeros);
    // Its manifest and HEAD agree; it sends 10 KiB/s.
    let trickling = LyingRegistry::start(OneLayer::new(layer.clone(), size), size, Ranges::Trickle);
    let upstreams = [
        (inflating.host(), inflating.url()),
        (trickling.host(), trickling.url()),
    ];
    // A 2 MiB range gets 2 s plus 2 s at 1 MiB/s.
    let extra = "[registry]\nrange_floor = \"2s\"\nrange_min_bytes_per_s = 1048576\n";
    let (_agent, _) = start_agent(&work, &upstreams, extra);

    let (status, result) = pull_image(
        &work,
        &format!("{}/big/app:1", inflating.host()),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(status, 502, "{result:?}");
    let error = result.unwrap_err();
    assert!(
        error.contains(&format!(
            "the registry holds {size} bytes, the manifest says {}",
            256 << 20
        )),
        "{error}"
    );
    assert!(stored_files(&work).is_empty(), "{:?}", stored_files(&work));

    // 10 KiB/s would take 200 s; the pull gives up at the range deadline
    // and gives back the disk it reserved.
    let started = std::time::Instant::now();
    let (status, result) = pull_image(
        &work,
        &format!("{}/slow/app:1", trickling.host()),
        Duration::from_secs(40),
    )
    .await;
    assert_eq!(status, 200);
    let error = result.unwrap_err();
    assert!(
        error.contains(
            "within 4s (registry.range_floor plus its length at registry.range_min_bytes_per_s)"
        ),
        "{error} after {:?}",
        started.elapsed()
    );
    let freed = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        stored_files(&work).is_empty()
    });
    assert!(freed, "still reserved: {:?}", stored_files(&work));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_the_store_could_never_hold_is_refused_before_any_blob_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().canonicalize().unwrap();
    let layer = vec![7u8; 4096];
    // Manifest and HEAD agree on 900 MiB: under the 1 GiB budget, so each
    // blob passes on its own, but over the 0.8 GiB the store may hold at
    // its high watermark.
    let claimed = 900 << 20;
    let registry = LyingRegistry::start(OneLayer::new(layer, claimed), claimed, Ranges::Zeros);
    let upstreams = [(registry.host(), registry.url())];
    let (agent, _) = start_agent(&work, &upstreams, "[gc]\nbudget = 1073741824\n");
    let connections = registry.connections();
    let (status, result) = pull_image(
        &work,
        &format!("{}/huge/app:1", registry.host()),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(status, 507, "{result:?}");
    let error = result.unwrap_err();
    assert!(
        error.contains(&format!(
            "image refused: its blobs not held here take {claimed} bytes, more than the {} bytes the chunk store could ever hold (gc.high_watermark of gc.budget",
            (0.8 * (1u64 << 30) as f64) as u64
        )),
        "{error}"
    );
    assert!(stored_files(&work).is_empty(), "{:?}", stored_files(&work));
    // The manifest and the config; no HEAD and no range of the layer.
    assert_eq!(registry.connections() - connections, 2);
    let refusals = metric(
        &work,
        format!("http://{}", agent.banner_field("metrics on http://")).trim_end_matches("/metrics"),
        "dray_agent_space_refusals_total",
    );
    assert_eq!(refusals, 1.0);
}
