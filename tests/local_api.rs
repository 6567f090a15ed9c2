//! Issue 17 acceptance 4: the local API unpacks only under the snapshotter's
//! root (`local_api.unpack_roots`), whatever `..` or symlinks say; and the
//! shim gives each agent unpack a deadline (a floor plus the layer's size at
//! a slowest rate), past which it hangs up and containerd pulls the layer
//! itself: real containerd 1.6 with its CRI plugin, `dray snapshotter` as a
//! process, the distribution registry behind a throttled relay.

mod common;
#[path = "common/cri.rs"]
mod cri;

use common::*;
use dray_agent::identity::ClusterCa;
use dray_agent::local_api::UnpackRequest;
use dray_agent::peer::PeerConfig;
use std::path::{Path, PathBuf};
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
    dray_agent::registry::install_crypto_provider();
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
             [mirror]\nlisten = \"127.0.0.1:0\"\n",
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
    let agent = Agent::start(
        &ClusterCa::generate().unwrap(),
        "node-a",
        work,
        quick_swarm(Vec::new()),
        PeerConfig::default(),
    );
    let upstreams = [(registry.host(), registry.url())];
    let api = LocalApiProc::start(&agent, &work.join("agent.sock"), &upstreams);
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
