//! Issue 37, finding 1 (acceptance 1), end to end with real containerd 1.6
//! (CRI `PullImage`, as the kubelet sends it), `dray snapshotter` as a
//! process, an agent and the distribution registry: a layer the shim staged
//! for one image is never committed under another image's chain ID.
//!
//! The attack: a tenant pulls B2 = [broken layer, L]; the shim stages L
//! (verified against B2's true diffID) while B2's pull fails. The tenant then
//! pulls B = [public base U, L] whose config claims L's diffID is the top
//! diffID of the public image V = [U, V's top], so containerd's target for L
//! is V's chain ID. A shim that hands B the staged L commits the tenant's
//! files under V's chain ID, and the next pull of V on the node runs them.

mod common;
#[path = "common/cri.rs"]
mod cri;
#[path = "fixtures/hostile.rs"]
mod hostile;

use common::*;
use std::io::Write;
use std::path::{Path, PathBuf};

const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// One node: registry, agent (mirror and local API), shim and containerd
/// with its CRI plugin on the dray snapshotter, as `tests/cri.rs` runs it.
struct Node {
    registry: Registry,
    agent: Agent,
    _mirror: MirrorProc,
    _api: LocalApiProc,
    shim: SnapshotterProc,
    ctrd: Containerd,
}

async fn node(work: &Path) -> Node {
    let registry = Registry::start(None).await;
    let agent = Agent::alone("node-a", work);
    let upstreams = [(registry.host(), registry.url())];
    let mirror = MirrorProc::start(&agent, &upstreams).await;
    let api = LocalApiProc::start(&agent, &work.join("agent.sock"), &upstreams).await;
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
        _api: api,
        shim,
        ctrd,
    }
}

/// A layer: its gzipped blob and the diffID of its tar.
struct LayerFile {
    blob: PathBuf,
    diff_id: String,
}

/// Writes a tar of `files` (path, mode, body; a body starting with `->` is
/// a symlink to the rest) and its gzip as `<name>.tar.gz` under `dir`.
fn layer(dir: &Path, name: &str, files: &[(&str, u32, Vec<u8>)]) -> LayerFile {
    let tar_path = dir.join(format!("{name}.tar"));
    {
        let mut b = tar::Builder::new(std::fs::File::create(&tar_path).unwrap());
        for (path, mode, body) in files {
            let mut h = tar::Header::new_gnu();
            h.set_mode(*mode);
            h.set_mtime(1_600_000_000);
            if let Some(to) = body.strip_prefix(b"->") {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, path, std::str::from_utf8(to).unwrap())
                    .unwrap();
            } else {
                h.set_size(body.len() as u64);
                b.append_data(&mut h, path, body.as_slice()).unwrap();
            }
        }
        b.into_inner().unwrap().flush().unwrap();
    }
    let diff_id = file_digest(&tar_path);
    let blob = dir.join(format!("{name}.tar.gz"));
    hostile::gzip_to(std::fs::File::open(&tar_path).unwrap(), &blob);
    LayerFile { blob, diff_id }
}

/// Pushes `repo:v1` of `layers`, each with the diffID its config states.
fn push_image(registry: &Registry, work: &Path, repo: &str, layers: &[(&LayerFile, &str)]) {
    let descriptors: Vec<serde_json::Value> = layers
        .iter()
        .map(|(l, _)| {
            serde_json::json!({
                "mediaType": GZIP,
                "digest": registry.push(repo, &l.blob),
                "size": std::fs::metadata(&l.blob).unwrap().len(),
            })
        })
        .collect();
    let diff_ids: Vec<&str> = layers.iter().map(|(_, d)| *d).collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "config": { "Env": ["PATH=/bin"] }
    })
    .to_string();
    let config_path = work.join(format!("{}.config.json", repo.replace('/', "-")));
    std::fs::write(&config_path, &config).unwrap();
    let config_digest = registry.push(repo, &config_path);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len() },
        "layers": descriptors,
    })
    .to_string();
    registry.push_manifest(repo, "v1", &manifest);
}

/// The OCI chain ID of `diff_ids`.
fn chain_id(diff_ids: &[&str]) -> String {
    let mut chain = diff_ids[0].to_string();
    for d in &diff_ids[1..] {
        chain = dray_protocol::BlobDigest::of(format!("{chain} {d}").as_bytes()).to_string();
    }
    chain
}

/// The chain IDs of the committed snapshots containerd lists in k8s.io.
fn committed(ctrd: &Containerd) -> Vec<String> {
    ok(
        &ctrd.ctr(&["-n", "k8s.io", "snapshots", "--snapshotter", "dray", "ls"]),
        "snapshots ls",
    )
    .lines()
    .filter(|l| l.contains("Committed"))
    .filter_map(|l| l.split_whitespace().next())
    .map(|k| k.rsplit('/').next().unwrap_or(k).to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layer_staged_for_one_image_is_never_committed_under_another_images_chain_id() {
    let work = tempfile::tempdir().unwrap();
    let n = node(work.path()).await;
    let host = n.registry.host();
    let dir = work.path().join("layers");
    std::fs::create_dir(&dir).unwrap();

    let busybox = std::fs::read("/bin/busybox").expect("busybox-static (scripts/test.sh)");
    let base = layer(
        &dir,
        "base",
        &[
            ("bin/busybox", 0o755, busybox),
            ("bin/cat", 0o777, b"->busybox".to_vec()),
            ("bin/sh", 0o777, b"->busybox".to_vec()),
            ("etc/base", 0o644, b"the public base\n".to_vec()),
        ],
    );
    let victim_top = layer(
        &dir,
        "victim-top",
        &[("marker", 0o644, b"the victim's own files\n".to_vec())],
    );
    let tenant = layer(
        &dir,
        "tenant",
        &[("marker", 0o644, b"the tenant's files\n".to_vec())],
    );
    let broken = layer(
        &dir,
        "broken",
        &[("broken", 0o644, b"a layer whose config lies\n".to_vec())],
    );
    let wrong = format!("sha256:{}", "0".repeat(64));

    // V, the public image; B2, the tenant's broken image that stages L; B,
    // the tenant's image that claims L is V's top layer.
    push_image(
        &n.registry,
        work.path(),
        "public/victim",
        &[(&base, &base.diff_id), (&victim_top, &victim_top.diff_id)],
    );
    push_image(
        &n.registry,
        work.path(),
        "tenant/broken",
        &[(&broken, &wrong), (&tenant, &tenant.diff_id)],
    );
    push_image(
        &n.registry,
        work.path(),
        "tenant/claims",
        &[(&base, &base.diff_id), (&tenant, &victim_top.diff_id)],
    );
    let victim_chain = chain_id(&[&base.diff_id, &victim_top.diff_id]);
    let tenant_blob = file_digest(&tenant.blob);

    let mut client = cri::client(Path::new(&n.ctrd.address)).await;

    // B2: its first layer fails (the agent, then containerd, find its tar is
    // not the diffID its config states); the shim staged L meanwhile.
    let b2 = cri::pull_image(&mut client, &format!("{host}/tenant/broken:v1")).await;
    assert!(b2.is_err(), "B2 must fail to pull: {b2:?}");
    // L was fetched and unpacked ahead into the shim's staging area.
    let staged_name = tenant_blob.replace(':', "-");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !n.agent.blob_path(&tenant_blob).exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the shim never prefetched L; shim log:\n{}",
            n.shim.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let staged: Vec<String> = std::fs::read_dir(n.shim.root.join("staging"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        staged.iter().any(|s| s.contains(&staged_name)),
        "L is not staged: {staged:?}"
    );

    // B: containerd's target for L is V's chain ID. The staged L (verified
    // against another diffID) must not be committed there, and L's tar is
    // not the diffID B's config states, so B's pull fails.
    let b = cri::pull_image(&mut client, &format!("{host}/tenant/claims:v1")).await;
    let committed_after_b = committed(&n.ctrd);
    assert!(
        !committed_after_b.contains(&victim_chain),
        "B's pull committed a snapshot under V's chain ID {victim_chain}: {committed_after_b:?}; shim log:\n{}",
        n.shim.log_text()
    );
    assert!(
        b.is_err(),
        "B (whose config gives L the victim's diffID) was pulled; shim log:\n{}",
        n.shim.log_text()
    );

    // B's failed pull leaves U's snapshot unreferenced: containerd's garbage
    // collector removes it (from its metadata, then from the shim) shortly
    // after. Wait for that, so V's pull does not reuse U while it goes.
    let snapshots = n.shim.root.join("snapshots");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::fs::read_dir(&snapshots).unwrap().next().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "containerd did not collect what the failed pulls left: {:?}",
            committed(&n.ctrd)
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // V, pulled afterwards on the node, runs its own files.
    let v = format!("{host}/public/victim:v1");
    cri::pull_image(&mut client, &v)
        .await
        .unwrap_or_else(|e| panic!("PullImage {v}: {e}\nshim log:\n{}", n.shim.log_text()));
    let out = n.ctrd.ctr(&[
        "-n",
        "k8s.io",
        "run",
        "--rm",
        "--snapshotter",
        "dray",
        &v,
        "staged-victim",
        "/bin/cat",
        "/marker",
        "/etc/base",
    ]);
    assert_eq!(
        ok(&out, "ctr run of V"),
        "the victim's own files\nthe public base\n",
        "V ran the wrong files; shim log:\n{}",
        n.shim.log_text()
    );
    // V's top snapshot holds V's top layer (the shim committed it under V's
    // chain ID from V's own unpack).
    let after = committed(&n.ctrd);
    assert!(
        after.contains(&victim_chain),
        "no {victim_chain} in {after:?}"
    );
}
