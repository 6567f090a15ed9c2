//! Issue 5 acceptance 1 and 4, end to end with real containerd 1.6 (its CRI
//! plugin configured for the dray snapshotter), `dray snapshotter` as a
//! process, an agent and the distribution registry: a CRI `PullImage`, as the
//! kubelet sends it, has the agent fetch and unpack every layer; containerd's
//! content store never receives a layer blob; `ctr run --snapshotter dray`
//! runs the image. Damaged blobs and a lying config leave no snapshot.

mod common;

use common::*;
use dray_agent::identity::ClusterCa;
use dray_agent::local_api::UnpackRequest;
use dray_agent::peer::PeerConfig;
use std::io::Write;
use std::path::Path;

mod cri {
    tonic::include_proto!("runtime.v1");
}
use cri::image_service_client::ImageServiceClient;

/// A CRI image-service client on containerd's socket, as the kubelet has.
async fn cri_client(socket: &Path) -> ImageServiceClient<tonic::transport::Channel> {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::try_from("http://containerd")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    ImageServiceClient::new(channel)
}

async fn pull_image(
    client: &mut ImageServiceClient<tonic::transport::Channel>,
    image: &str,
) -> Result<String, tonic::Status> {
    client
        .pull_image(cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            auth: None,
        })
        .await
        .map(|r| r.into_inner().image_ref)
}

/// The digests of a manifest's layers, read from the registry.
fn layer_digests(registry: &Registry, repo: &str, tag: &str) -> Vec<String> {
    let out = std::process::Command::new("curl")
        .args([
            "-sfS",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!("{}/v2/{repo}/manifests/{tag}", registry.url()))
        .output()
        .unwrap();
    let m: serde_json::Value = serde_json::from_slice(&ok(&out, "manifest").into_bytes()).unwrap();
    m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["digest"].as_str().unwrap().to_string())
        .collect()
}

/// Committed snapshots the dray snapshotter holds in containerd's k8s.io namespace.
fn committed(ctrd: &Containerd) -> usize {
    ok(
        &ctrd.ctr(&["-n", "k8s.io", "snapshots", "--snapshotter", "dray", "ls"]),
        "snapshots ls",
    )
    .lines()
    .filter(|l| l.contains("Committed"))
    .count()
}

struct Node {
    registry: Registry,
    agent: Agent,
    _mirror: MirrorProc,
    api: LocalApiProc,
    shim: SnapshotterProc,
    ctrd: Containerd,
}

async fn node(work: &Path) -> Node {
    let registry = Registry::start(None).await;
    let agent = Agent::start(
        &ClusterCa::generate().unwrap(),
        "node-a",
        work,
        quick_swarm(Vec::new()),
        PeerConfig::default(),
    );
    let upstreams = [(registry.host(), registry.url())];
    let mirror = MirrorProc::start(&agent, &upstreams).await;
    let api = LocalApiProc::start(&agent, &work.join("agent.sock"), &upstreams);
    let shim = SnapshotterProc::start(work, &api.socket);
    let side_door = registry.side_door().await;
    let hosts = hosts_dir(work, &registry.host(), &side_door.url(), &mirror.url);
    // The side door's relay must outlive the test; leak it with the node.
    std::mem::forget(side_door);
    let ctrd = Containerd::start_cri(&hosts, "dray", &dray_proxy_plugin(&shim.socket));
    Node {
        registry,
        agent,
        _mirror: mirror,
        api,
        shim,
        ctrd,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cri_pull_has_dray_unpack_every_layer_and_the_image_runs() {
    // A node per compression: both images unpack to the same chain, which a
    // node that has one would not fetch again.
    for tag in ["gzip", "zstd"] {
        let work = tempfile::tempdir().unwrap();
        let n = node(work.path()).await;
        build_image(
            &n.registry,
            &work.path().join("img"),
            "cri/app",
            4 << 20,
            None,
        );
        let mut client = cri_client(Path::new(&n.ctrd.address)).await;
        let image = format!("{}/cri/app:{tag}", n.registry.host());
        let image_ref = pull_image(&mut client, &image)
            .await
            .unwrap_or_else(|e| panic!("PullImage {image}: {e}\nshim log:\n{}", n.shim.log_text()));
        assert!(image_ref.starts_with("sha256:"), "{image_ref}");

        // containerd fetched the manifest and config, never a layer.
        let listing = ok(
            &n.ctrd.ctr(&["-n", "k8s.io", "content", "ls"]),
            "content ls",
        );
        let content: Vec<&str> = listing
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        let layers = layer_digests(&n.registry, "cri/app", tag);
        assert!(!layers.is_empty());
        for l in &layers {
            assert!(
                !content.contains(&l.as_str()),
                "containerd's content store received layer {l}:\n{listing}"
            );
        }
        // The agent holds every layer, verified.
        for l in &layers {
            let path = n.agent.blob_path(l);
            assert!(
                path.exists(),
                "the agent has no {}; shim log:\n{}",
                path.display(),
                n.shim.log_text()
            );
            assert_eq!(&file_digest(&path), l, "agent's copy of {l}");
        }
        assert!(committed(&n.ctrd) >= layers.len());

        let out = n.ctrd.ctr(&[
            "-n",
            "k8s.io",
            "run",
            "--rm",
            "--snapshotter",
            "dray",
            &image,
            &format!("cri-{tag}"),
            "/bin/cat",
            "/etc/greeting",
        ]);
        assert_eq!(ok(&out, "ctr run"), "hello from dray\n");
    }
}

/// A one-layer image whose config states `diff_id` for its layer.
fn push_single_layer(
    registry: &Registry,
    work: &Path,
    repo: &str,
    diff_id: Option<&str>,
) -> String {
    let tar_path = work.join(format!("{}.tar", repo.replace('/', "-")));
    {
        let mut b = tar::Builder::new(std::fs::File::create(&tar_path).unwrap());
        // Distinct content per repo, so no two images share a blob.
        let body = repo.as_bytes().repeat((3 << 20) / repo.len());
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, "payload.bin", body.as_slice())
            .unwrap();
        b.into_inner().unwrap().flush().unwrap();
    }
    let true_diff = file_digest(&tar_path);
    let gz_path = tar_path.with_extension("tar.gz");
    {
        let mut e = flate2::write::GzEncoder::new(
            std::fs::File::create(&gz_path).unwrap(),
            flate2::Compression::fast(),
        );
        std::io::copy(&mut std::fs::File::open(&tar_path).unwrap(), &mut e).unwrap();
        e.finish().unwrap();
    }
    let layer = registry.push(repo, &gz_path);
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": [diff_id.unwrap_or(&true_diff)] },
        "config": {}
    })
    .to_string();
    let config_path = work.join(format!("{}.config.json", repo.replace('/', "-")));
    std::fs::write(&config_path, &config).unwrap();
    let config_digest = registry.push(repo, &config_path);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len() },
        "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer, "size": std::fs::metadata(&gz_path).unwrap().len() }]
    })
    .to_string();
    registry.push_manifest(repo, "v1", &manifest);
    layer
}

/// The manifest digest of `repo:v1`.
fn manifest_digest(registry: &Registry, repo: &str) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-sfSI",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!("{}/v2/{repo}/manifests/v1", registry.url()))
        .output()
        .unwrap();
    ok(&out, "manifest HEAD")
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("docker-content-digest: ")
                .map(|d| d.trim().to_string())
        })
        .expect("digest header")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn damaged_blobs_and_lying_configs_leave_nothing_unpacked() {
    let work = tempfile::tempdir().unwrap();
    let n = node(work.path()).await;
    let staging = work.path().join("targets");
    std::fs::create_dir(&staging).unwrap();
    let host = n.registry.host();

    // A config whose diffID is not the layer's.
    let wrong = format!("sha256:{}", "0".repeat(64));
    let lying = push_single_layer(&n.registry, work.path(), "bad/diffid", Some(&wrong));
    // A blob with one byte flipped on the registry's disk, and a truncated one.
    let flipped = push_single_layer(&n.registry, work.path(), "bad/flipped", None);
    let truncated = push_single_layer(&n.registry, work.path(), "bad/truncated", None);
    let file = n.registry.blob_file(&flipped);
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&file, bytes).unwrap();
    let file = n.registry.blob_file(&truncated);
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    for (repo, layer, expect) in [
        ("bad/diffid", &lying, "diffID mismatch"),
        ("bad/flipped", &flipped, "digest"),
        ("bad/truncated", &truncated, "the manifest says"),
    ] {
        let target = staging.join(repo.replace('/', "-"));
        let (status, body) = n
            .api
            .unpack(&UnpackRequest {
                image_ref: format!("{host}/{repo}:v1"),
                manifest_digest: manifest_digest(&n.registry, repo),
                layer_digest: layer.clone(),
                target: target.clone(),
            })
            .await;
        let error = body["error"].as_str().unwrap_or_default().to_string();
        assert!(status >= 400, "{repo}: unpack answered {status}: {body}");
        assert!(error.contains(expect), "{repo}: {error}");
        assert!(
            !target.exists(),
            "{repo}: {} was left behind",
            target.display()
        );
        eprintln!("{repo}: {status} {error}");

        // Through CRI: the shim falls back to containerd, which fails the
        // same way; nothing is committed.
        let mut client = cri_client(Path::new(&n.ctrd.address)).await;
        let before = committed(&n.ctrd);
        let pulled = pull_image(&mut client, &format!("{host}/{repo}:v1")).await;
        assert!(
            pulled.is_err(),
            "{repo}: PullImage of a damaged image succeeded"
        );
        assert_eq!(
            committed(&n.ctrd),
            before,
            "{repo}: a snapshot was committed"
        );
    }
    assert!(
        std::fs::read_dir(&staging).unwrap().next().is_none(),
        "leftovers in {}",
        staging.display()
    );
}
