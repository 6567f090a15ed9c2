//! Issue 5 acceptance 1 and 4, end to end with real containerd 1.6 (its CRI
//! plugin configured for the dray snapshotter), `dray snapshotter` as a
//! process, an agent and the distribution registry: a CRI `PullImage`, as the
//! kubelet sends it, has the agent fetch and unpack every layer; containerd's
//! content store never receives a layer blob; `ctr run --snapshotter dray`
//! runs the image. Damaged blobs and a lying config leave no snapshot.

mod common;
#[path = "common/cri.rs"]
mod cri;
#[path = "fixtures/hostile.rs"]
mod hostile;

use common::*;
use dray_agent::serving::local_api::UnpackRequest;
use dray_agent::unpack::UnpackLimits;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
        let mut client = cri::client(Path::new(&n.ctrd.address)).await;
        let image = format!("{}/cri/app:{tag}", n.registry.host());
        let image_ref = cri::pull_image(&mut client, &image)
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
    hostile::gzip_to(std::fs::File::open(&tar_path).unwrap(), &gz_path);
    push_layer(
        registry,
        work,
        repo,
        &gz_path,
        "application/vnd.oci.image.layer.v1.tar+gzip",
        diff_id.unwrap_or(&true_diff),
    )
}

/// Pushes `repo:v1`, an image of the one layer `blob` (of `media_type`,
/// whose tar's diffID the config states as `diff_id`); returns its digest.
fn push_layer(
    registry: &Registry,
    work: &Path,
    repo: &str,
    blob: &Path,
    media_type: &str,
    diff_id: &str,
) -> String {
    let layer = registry.push(repo, blob);
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
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
        "layers": [{ "mediaType": media_type, "digest": layer, "size": std::fs::metadata(blob).unwrap().len() }]
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
        let mut client = cri::client(Path::new(&n.ctrd.address)).await;
        let before = committed(&n.ctrd);
        let pulled = cri::pull_image(&mut client, &format!("{host}/{repo}:v1")).await;
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

// ---- issue 17: the hostile-tar corpus ----

const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// A diffID for layers refused before theirs is checked.
fn unchecked_diff_id() -> String {
    format!("sha256:{}", "0".repeat(64))
}

/// The sparse corpus file: 1 GiB, six 4 KiB chunks, gzipped into `dir`;
/// (the blob, the tar's diffID, the chunks).
fn sparse_layer(dir: &Path) -> (PathBuf, String, Vec<(u64, Vec<u8>)>) {
    let chunks = hostile::sparse_chunks(1 << 30);
    let tar = hostile::sparse_file("var/log/lastlog", 1 << 30, &chunks);
    let blob = dir.join("sparse.tar.gz");
    hostile::gzip_to(&tar[..], &blob);
    (blob, hostile::diff_id(&tar[..]), chunks)
}

/// The unpacked sparse file holds its chunks in 1 GiB of apparent size and
/// at most 1 MiB of disk.
fn assert_sparse(path: &Path, chunks: &[(u64, Vec<u8>)]) {
    use std::os::unix::fs::FileExt;
    let m = std::fs::metadata(path).unwrap();
    assert_eq!(m.len(), 1 << 30, "{}", path.display());
    assert!(
        m.blocks() * 512 <= 1 << 20,
        "{} takes {} blocks",
        path.display(),
        m.blocks()
    );
    let f = std::fs::File::open(path).unwrap();
    for (off, data) in chunks {
        let mut got = vec![0u8; data.len()];
        f.read_exact_at(&mut got, *off).unwrap();
        assert_eq!(&got, data, "chunk at {off}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hostile_tar_corpus_is_refused_through_the_local_api_and_the_agent_stays_up() {
    let work = tempfile::tempdir().unwrap();
    let n = node(work.path()).await;
    let staging = work.path().join("targets");
    std::fs::create_dir(&staging).unwrap();
    let corpus = work.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    let host = n.registry.host();
    let blob = |name: &str| corpus.join(name);
    let started = Instant::now();
    hostile::gzip_to(
        hostile::special_header_bomb(b'L', 2 << 30),
        &blob("long-name.tar.gz"),
    );
    hostile::gzip_to(
        hostile::special_header_bomb(b'x', 2 << 30),
        &blob("pax.tar.gz"),
    );
    let max_entries = UnpackLimits::default().max_entries;
    hostile::gzip_to(
        hostile::many_entries(max_entries + 1),
        &blob("entries.tar.gz"),
    );
    hostile::zstd_to(hostile::zeros_file(1 << 30), &blob("ratio.tar.zst"));
    hostile::gzip_to(&hostile::deep_path(2100)[..], &blob("deep.tar.gz"));
    eprintln!("corpus generated in {:?}", started.elapsed());

    let cases = [
        (
            "hostile/long-name",
            "long-name.tar.gz",
            GZIP,
            "its GNU long name is 2147483648 bytes, over the 1048576-byte cap".to_string(),
        ),
        (
            "hostile/pax",
            "pax.tar.gz",
            GZIP,
            "its PAX extended header is 2147483648 bytes, over the 1048576-byte cap".into(),
        ),
        (
            "hostile/entries",
            "entries.tar.gz",
            GZIP,
            format!("the layer has more than max_entries = {max_entries} entries"),
        ),
        (
            "hostile/ratio",
            "ratio.tar.zst",
            ZSTD,
            "past max_layer_ratio = 2000".into(),
        ),
        (
            "hostile/deep",
            "deep.tar.gz",
            GZIP,
            "its path is 4201 bytes, past max_path_bytes = 4096".into(),
        ),
    ];
    for (repo, file, media_type, expect) in cases {
        let layer = push_layer(
            &n.registry,
            work.path(),
            repo,
            &blob(file),
            media_type,
            &unchecked_diff_id(),
        );
        let target = staging.join(repo.replace('/', "-"));
        let started = Instant::now();
        let (status, body) = n
            .api
            .unpack(&UnpackRequest {
                image_ref: format!("{host}/{repo}:v1"),
                manifest_digest: manifest_digest(&n.registry, repo),
                layer_digest: layer,
                target: target.clone(),
            })
            .await;
        let error = body["error"].as_str().unwrap_or_default().to_string();
        eprintln!("{repo}: {status} after {:?}: {error}", started.elapsed());
        assert_eq!(status, 422, "{repo}: {body}");
        assert!(error.contains(&expect), "{repo}: {error}");
        assert!(!target.exists(), "{repo}: {} left", target.display());
    }
    assert!(
        std::fs::read_dir(&staging).unwrap().next().is_none(),
        "leftovers in {}",
        staging.display()
    );

    // The sparse file unpacks, sparse.
    let (sparse, diff_id, chunks) = sparse_layer(&corpus);
    let layer = push_layer(
        &n.registry,
        work.path(),
        "hostile/sparse",
        &sparse,
        GZIP,
        &diff_id,
    );
    let target = staging.join("sparse");
    let (status, body) = n
        .api
        .unpack(&UnpackRequest {
            image_ref: format!("{host}/hostile/sparse:v1"),
            manifest_digest: manifest_digest(&n.registry, "hostile/sparse"),
            layer_digest: layer,
            target: target.clone(),
        })
        .await;
    assert_eq!(status, 200, "{body}");
    assert_sparse(&target.join("var/log/lastlog"), &chunks);

    // The agent stays up: a good layer after them all unpacks.
    let good = push_single_layer(&n.registry, work.path(), "good/after", None);
    let target = staging.join("good");
    let (status, body) = n
        .api
        .unpack(&UnpackRequest {
            image_ref: format!("{host}/good/after:v1"),
            manifest_digest: manifest_digest(&n.registry, "good/after"),
            layer_digest: good,
            target: target.clone(),
        })
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(target.join("payload.bin").exists());
    let peak = peak_rss("self");
    eprintln!("peak RSS of the agent's process: {} MiB", peak >> 20);
    assert!(peak < 512 << 20, "peak RSS {peak} bytes");
}

/// Files named `name` anywhere below `dir`.
fn find_named(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            find_named(&p, name, out);
        } else if e.file_name() == name {
            out.push(p);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_cri_a_long_name_bomb_commits_nothing_and_a_sparse_file_unpacks_sparse() {
    let work = tempfile::tempdir().unwrap();
    let n = node(work.path()).await;
    let host = n.registry.host();
    let bomb = work.path().join("long-name.tar.gz");
    hostile::gzip_to(hostile::special_header_bomb(b'L', 2 << 30), &bomb);
    push_layer(
        &n.registry,
        work.path(),
        "hostile/long-name",
        &bomb,
        GZIP,
        &unchecked_diff_id(),
    );
    let (sparse, diff_id, chunks) = sparse_layer(work.path());
    push_layer(
        &n.registry,
        work.path(),
        "hostile/sparse",
        &sparse,
        GZIP,
        &diff_id,
    );

    // The agent refuses the bomb; the shim falls back to containerd, whose
    // archive/tar refuses a long name over 1 MiB too. Nothing is committed.
    let mut client = cri::client(Path::new(&n.ctrd.address)).await;
    let before = committed(&n.ctrd);
    let pulled = cri::pull_image(&mut client, &format!("{host}/hostile/long-name:v1")).await;
    assert!(pulled.is_err(), "PullImage of the bomb succeeded");
    assert_eq!(committed(&n.ctrd), before, "a snapshot was committed");
    let log = n.shim.log_text();
    assert!(
        log.contains("its GNU long name is 2147483648 bytes, over the 1048576-byte cap"),
        "the agent did not refuse the bomb:\n{log}"
    );

    // The agent is up: the sparse image pulls, its file sparse in the
    // dray snapshot.
    cri::pull_image(&mut client, &format!("{host}/hostile/sparse:v1"))
        .await
        .unwrap_or_else(|e| panic!("PullImage: {e}\nshim log:\n{}", n.shim.log_text()));
    let mut found = Vec::new();
    find_named(&n.shim.root, "lastlog", &mut found);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_sparse(&found[0], &chunks);
    let peak = peak_rss("self");
    eprintln!("peak RSS of the agent's process: {} MiB", peak >> 20);
    assert!(peak < 512 << 20, "peak RSS {peak} bytes");
}

// ---- issue 17: parent directories a layer leaves out ----

/// A tar of `entries`: (path, type byte, mode, uid, content), no entry for
/// any directory not listed.
fn layer_tar(entries: &[(&str, u8, u32, u64, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, mode, uid, content) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_entry_type(tar::EntryType::new(*kind));
        h.set_mode(*mode);
        h.set_uid(*uid);
        h.set_gid(*uid);
        h.set_mtime(1_700_000_000);
        h.set_size(content.len() as u64);
        h.set_cksum();
        b.append(&h, *content).unwrap();
    }
    b.into_inner().unwrap()
}

/// Pushes `repo:v1`, an image of `layers` (gzipped tars, lowest first).
fn push_image(registry: &Registry, work: &Path, repo: &str, layers: &[Vec<u8>]) -> Vec<String> {
    let mut descriptors = Vec::new();
    let mut diff_ids = Vec::new();
    for (i, tar) in layers.iter().enumerate() {
        let blob = work.join(format!("{}-{i}.tar.gz", repo.replace('/', "-")));
        hostile::gzip_to(&tar[..], &blob);
        let digest = registry.push(repo, &blob);
        descriptors.push(serde_json::json!({
            "mediaType": GZIP, "digest": digest, "size": std::fs::metadata(&blob).unwrap().len()
        }));
        diff_ids.push(hostile::diff_id(&tar[..]));
    }
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
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
        "layers": descriptors
    })
    .to_string();
    registry.push_manifest(repo, "v1", &manifest);
    diff_ids
}

/// The directory of the committed snapshot `chain_id` of `snapshotter` in
/// `namespace`, read from the mounts of a view of it.
fn snapshot_dir(ctrd: &Containerd, namespace: &str, snapshotter: &str, chain_id: &str) -> PathBuf {
    let key = format!("view-{}", &chain_id[7..19]);
    let args = ["-n", namespace, "snapshots", "--snapshotter", snapshotter];
    let view = [&args[..], &["view", "--mounts", &key, chain_id]].concat();
    let mounts = ok(&ctrd.ctr(&view), "snapshots view");
    ctrd.ctr(&[&args[..], &["rm", &key]].concat());
    let dir = mounts
        .split(|c: char| c.is_whitespace() || ",:=\"[]".contains(c))
        .find(|w| w.starts_with('/') && w.ends_with("/fs"))
        .unwrap_or_else(|| panic!("no snapshot dir in {mounts:?}"));
    PathBuf::from(dir)
}

/// Every xattr of `p` (not following a symlink), by name.
fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut names = vec![0u8; 64 << 10];
    // SAFETY: a valid C string and a writable buffer of its length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "listxattr {}", p.display());
    names.truncate(n as usize);
    names
        .split(|&b| b == 0)
        .filter(|k| !k.is_empty())
        .map(|k| {
            let key = std::ffi::CString::new(k).unwrap();
            let mut v = vec![0u8; 64 << 10];
            // SAFETY: valid C strings and a writable buffer of its length.
            let n = unsafe {
                libc::lgetxattr(c.as_ptr(), key.as_ptr(), v.as_mut_ptr().cast(), v.len())
            };
            assert!(n >= 0, "getxattr {}", p.display());
            v.truncate(n as usize);
            (String::from_utf8_lossy(k).into_owned(), v)
        })
        .collect()
}

/// Type, mode, owner, content or link target and xattrs of every entry
/// below `root`, and the mtime of all but directories (an implicit parent's
/// is when its last child was written, in containerd as here).
fn tree(root: &Path) -> std::collections::BTreeMap<PathBuf, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let m = std::fs::symlink_metadata(&p).unwrap();
        let mut d = format!("mode {:o} uid {} gid {}", m.mode(), m.uid(), m.gid());
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(rel.join(e.unwrap().file_name()));
            }
        } else {
            d += &format!(" mtime {} content {}", m.mtime(), file_digest(&p));
        }
        for (k, v) in xattrs(&p) {
            d += &format!(" xattr {k}={v:?}");
        }
        out.insert(rel, d);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn directories_a_layer_leaves_out_keep_the_lower_layers_mode_and_owner_as_in_containerd() {
    let work = tempfile::tempdir().unwrap();
    let n = node(work.path()).await;
    let host = n.registry.host();
    // The lower layer: a 1777 /tmp and a /home/app of uid 1000.
    let lower = layer_tar(&[
        ("tmp", b'5', 0o1777, 0, b""),
        ("home", b'5', 0o755, 0, b""),
        ("home/app", b'5', 0o750, 1000, b""),
        ("home/app/.profile", b'0', 0o644, 1000, b"# app\n"),
    ]);
    // The upper layer adds below them with no directory entries, and below
    // a directory no layer has.
    let upper = layer_tar(&[
        ("tmp/x", b'0', 0o644, 0, b"x\n"),
        ("home/app/data/y", b'0', 0o600, 1000, b"y\n"),
        ("home/app/z", b'0', 0o640, 1000, b"z\n"),
    ]);
    let diff_ids = push_image(
        &n.registry,
        work.path(),
        "implicit/parents",
        &[lower, upper],
    );
    let chains = oci_image::chain_ids(&diff_ids);

    let mut client = cri::client(Path::new(&n.ctrd.address)).await;
    cri::pull_image(&mut client, &format!("{host}/implicit/parents:v1"))
        .await
        .unwrap_or_else(|e| panic!("PullImage: {e}\nshim log:\n{}", n.shim.log_text()));

    // containerd's own unpack of the same image, with its overlayfs snapshotter.
    let plain = work.path().join("containerd-plain");
    std::fs::create_dir(&plain).unwrap();
    let reference = oci_image::Containerd::start(&plain).unwrap();
    reference
        .ctr_ok(&[
            "images",
            "pull",
            "--plain-http",
            &format!("{host}/implicit/parents:v1"),
        ])
        .unwrap();

    for (i, chain) in chains.iter().enumerate() {
        let ours = tree(&snapshot_dir(&n.ctrd, "k8s.io", "dray", chain));
        let theirs = tree(&reference.snapshot_dir(chain).unwrap());
        assert_eq!(
            ours, theirs,
            "layer {i}: dray's snapshot differs from containerd's"
        );
    }
    let top = snapshot_dir(&n.ctrd, "k8s.io", "dray", &chains[1]);
    let m = std::fs::metadata(top.join("tmp")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o1777);
    let m = std::fs::metadata(top.join("home/app")).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o7777), (1000, 0o750));
    let m = std::fs::metadata(top.join("home/app/data")).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o755));
}
