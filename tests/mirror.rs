//! Issue 4 acceptance: the agent as containerd's registry mirror, with real
//! containerd 1.6, skopeo and the distribution registry; and issue 39's
//! registry clients other than containerd (skopeo list-tags, curl): tag
//! lists, `/v2/` as JSON, the registry's own refusals, multi-range blobs.

mod common;

use common::*;
use dray_agent::identity::ClusterCa;
use dray_agent::peer::PeerConfig;
use std::path::Path;
use std::process::Command;

fn no_tracker() -> dray_agent::pull::swarm::SwarmConfig {
    quick_swarm(Vec::new())
}

/// A registry holding the test image as `repo`, and one agent (no tracker)
/// serving a mirror of it.
async fn one_node(
    work: &Path,
    auth: Option<(&str, &str)>,
    repo: &str,
    random_bytes: u64,
) -> (Registry, Agent, MirrorProc) {
    let registry = Registry::start(auth).await;
    let creds = auth.map(|(u, p)| format!("{u}:{p}"));
    build_image(
        &registry,
        &work.join("img"),
        repo,
        random_bytes,
        creds.as_deref(),
    );
    let agent = Agent::start(
        &ClusterCa::generate().unwrap(),
        "node-a",
        work,
        no_tracker(),
        PeerConfig::default(),
    );
    let mirror = MirrorProc::start(&agent, &[(registry.host(), registry.url())]).await;
    (registry, agent, mirror)
}

/// `curl` with headers on stdout; returns (status, headers and body as text).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-i"])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_pulls_gzip_and_zstd_images_through_the_mirror_and_runs_them() {
    let work = tempfile::tempdir().unwrap();
    let (registry, _agent, mirror) = one_node(work.path(), None, "test/img", 8 << 20).await;
    let side_door = registry.side_door().await;
    let hosts = hosts_dir(work.path(), &registry.host(), &side_door.url(), &mirror.url);
    let ctrd = Containerd::start();

    for tag in ["gzip", "zstd"] {
        let image = format!("{}/test/img:{tag}", registry.host());
        ok(&ctrd.pull(&hosts, &image, None), &format!("pull {image}"));
        let out = ok(
            &ctrd.ctr(&[
                "run",
                "--rm",
                &image,
                &format!("t-{tag}"),
                "cat",
                "/etc/greeting",
            ]),
            "ctr run",
        );
        assert_eq!(out.trim(), "hello from dray");
    }
    assert_eq!(
        side_door.egress(),
        0,
        "containerd fetched from the registry directly"
    );
    assert!(
        registry.egress() > 16 << 20,
        "the agent fetched both images' layers through the swarm"
    );

    // With the agent stopped, containerd falls back to the registry itself.
    mirror.stop();
    let ctrd2 = Containerd::start();
    let image = format!("{}/test/img:gzip", registry.host());
    ok(
        &ctrd2.pull(&hosts, &image, None),
        "pull with the agent stopped",
    );
    assert!(
        side_door.egress() > 8 << 20,
        "the fallback pull went to the registry"
    );
    let out = ok(
        &ctrd2.ctr(&["run", "--rm", &image, "t-fallback", "cat", "/etc/greeting"]),
        "ctr run",
    );
    assert_eq!(out.trim(), "hello from dray");
}

/// The manifest digest and blob list of an OCI layout written by skopeo.
fn layout_digests(dir: &Path) -> (String, Vec<String>) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let manifest = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let mut blobs: Vec<String> = std::fs::read_dir(dir.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    blobs.sort();
    (manifest, blobs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skopeo_copies_from_the_mirror_give_the_same_digests_as_from_the_registry() {
    let work = tempfile::tempdir().unwrap();
    let (registry, _agent, mirror) = one_node(work.path(), None, "test/sk", 4 << 20).await;
    let mirror_host = mirror.url.trim_start_matches("http://").to_string();
    for (from, to) in [(registry.host(), "direct"), (mirror_host, "mirrored")] {
        let out = Command::new("skopeo")
            .args(["copy", "-q", "--src-tls-verify=false"])
            .arg(format!("docker://{from}/test/sk:zstd"))
            .arg(format!("oci:{}:zstd", work.path().join(to).display()))
            .output()
            .unwrap();
        ok(&out, &format!("skopeo copy from {from}"));
    }
    assert_eq!(
        layout_digests(&work.path().join("direct")),
        layout_digests(&work.path().join("mirrored"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_image_needs_the_clients_own_credentials_through_the_mirror() {
    let work = tempfile::tempdir().unwrap();
    let (registry, agent, mirror) = one_node(
        work.path(),
        Some(("alice", "s3cret")),
        "private/img",
        4 << 20,
    )
    .await;
    let side_door = registry.side_door().await;
    let hosts = hosts_dir(work.path(), &registry.host(), &side_door.url(), &mirror.url);
    let ctrd = Containerd::start();
    let image = format!("{}/private/img:gzip", registry.host());

    let anonymous = ctrd.pull(&hosts, &image, None);
    assert!(
        !anonymous.status.success(),
        "an anonymous pull of a private image succeeded"
    );
    let err = String::from_utf8_lossy(&anonymous.stderr);
    assert!(
        err.contains("401") || err.to_lowercase().contains("unauthorized"),
        "{err}"
    );
    let stored = std::fs::read_dir(agent.dir.join("blobs"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(stored, 0, "the agent fetched blobs for an anonymous client");
    let (status, body) = curl(&[&format!("{}/v2/private/img/manifests/gzip", mirror.url)]);
    assert_eq!(status, 401, "{body}");
    assert!(
        body.to_lowercase().contains("www-authenticate: basic"),
        "the challenge is relayed: {body}"
    );

    ok(
        &ctrd.pull(&hosts, &image, Some("alice:s3cret")),
        "pull with credentials",
    );
    let out = ok(
        &ctrd.ctr(&["run", "--rm", &image, "t-private", "cat", "/etc/greeting"]),
        "ctr run",
    );
    assert_eq!(out.trim(), "hello from dray");
    // containerd tries the next host after a 401 from the mirror: the registry's
    // own door may answer with 401 bodies, but must serve no image content.
    assert!(
        side_door.egress() < 4096,
        "containerd fetched {} bytes from the registry directly",
        side_door.egress()
    );
    assert!(
        registry.egress() > 4 << 20,
        "the layers came through the agent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_containerds_pulling_one_image_at_once_take_it_from_the_registry_about_once() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    build_image(
        &registry,
        &work.path().join("img"),
        "test/big",
        256 << 20,
        None,
    );
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let side_door = registry.side_door().await;
    let image = format!("{}/test/big:gzip", registry.host());
    // The image's compressed size: its blobs as the registry lists them.
    let (_, manifest) = curl(&[
        "-H",
        "Accept: application/vnd.oci.image.manifest.v1+json",
        &format!("{}/v2/test/big/manifests/gzip", registry.url()),
    ]);
    let manifest: serde_json::Value =
        serde_json::from_str(manifest.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let image_bytes: u64 = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum::<u64>()
        + manifest["config"]["size"].as_u64().unwrap();
    let before = registry.egress();

    let mut nodes = Vec::new();
    for i in 0..4 {
        let agent = Agent::start(
            &ca,
            &format!("node-{i}"),
            work.path(),
            quick_swarm(vec![tracker.url()]),
            PeerConfig::default(),
        );
        let mirror = MirrorProc::start(&agent, &[(registry.host(), registry.url())]).await;
        let hosts = hosts_dir(
            &work.path().join(format!("node-{i}")),
            &registry.host(),
            &side_door.url(),
            &mirror.url,
        );
        nodes.push((agent, mirror, hosts, Containerd::start()));
    }
    let pulls: Vec<_> = nodes
        .iter()
        .map(|(_, _, hosts, ctrd)| {
            let (hosts, address, image) = (hosts.clone(), ctrd.address.clone(), image.clone());
            std::thread::spawn(move || {
                Command::new("ctr")
                    .args([
                        "--address",
                        &address,
                        "image",
                        "pull",
                        "--hosts-dir",
                        hosts.to_str().unwrap(),
                        &image,
                    ])
                    .output()
                    .unwrap()
            })
        })
        .collect();
    for p in pulls {
        ok(&p.join().unwrap(), "concurrent pull");
    }

    let egress = registry.egress() - before;
    let ratio = egress as f64 / image_bytes as f64;
    eprintln!(
        "4 containerds: registry egress {egress} bytes for a {image_bytes}-byte image ({ratio:.3}x)"
    );
    assert_eq!(
        side_door.egress(),
        0,
        "containerd fetched from the registry directly"
    );
    assert!(ratio <= 1.10, "registry served {ratio:.3}x the image");
    for (i, (_, _, _, ctrd)) in nodes.iter().enumerate() {
        let out = ok(
            &ctrd.ctr(&[
                "run",
                "--rm",
                &image,
                &format!("t-{i}"),
                "cat",
                "/etc/greeting",
            ]),
            "ctr run",
        );
        assert_eq!(out.trim(), "hello from dray");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mirror_answers_ranges_heads_and_bad_requests_as_the_distribution_spec_says() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let src = work.path().join("blob");
    random_file(&src, 5 << 20);
    let digest = registry.push("test/api", &src);
    let bytes = std::fs::read(&src).unwrap();
    let agent = Agent::start(
        &ClusterCa::generate().unwrap(),
        "node-a",
        work.path(),
        no_tracker(),
        PeerConfig::default(),
    );
    let mirror = MirrorProc::start(&agent, &[(registry.host(), registry.url())]).await;
    let blob_url = format!(
        "{}/v2/test/api/blobs/{digest}?ns={}",
        mirror.url,
        registry.host()
    );

    let (status, head) = curl(&["-I", &blob_url]);
    assert_eq!(status, 200, "{head}");
    assert!(
        head.to_lowercase()
            .contains(&format!("content-length: {}", 5 << 20)),
        "{head}"
    );
    assert!(
        head.to_lowercase()
            .contains(&format!("docker-content-digest: {digest}")),
        "{head}"
    );

    let out = Command::new("curl")
        .args(["-s", "-H", "Range: bytes=4194300-4194315", &blob_url])
        .output()
        .unwrap();
    assert_eq!(
        out.stdout,
        &bytes[4194300..4194316],
        "a range across the chunk boundary"
    );
    let (status, head) = curl(&[
        "-H",
        "Range: bytes=5242870-",
        "-o",
        "/dev/null",
        "-D",
        "-",
        &blob_url,
    ]);
    assert_eq!(status, 206, "{head}");
    assert!(
        head.to_lowercase()
            .contains("content-range: bytes 5242870-5242879/5242880"),
        "{head}"
    );
    let whole = Command::new("curl")
        .args(["-s", &blob_url])
        .output()
        .unwrap();
    assert!(whole.stdout == bytes, "the whole blob");

    let unknown = format!("sha256:{}", "0".repeat(64));
    let (status, body) = curl(&[&format!("{}/v2/test/api/blobs/{unknown}", mirror.url)]);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("BLOB_UNKNOWN"), "{body}");
    let (status, body) = curl(&[&format!("{}/v2/test/api/manifests/nope", mirror.url)]);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("MANIFEST_UNKNOWN"), "{body}");
    let (status, body) = curl(&[&format!("{}/v2/test/api/blobs/sha256:abc", mirror.url)]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("DIGEST_INVALID"), "{body}");
    let (status, body) = curl(&[&format!("{}/v2/Test/API/manifests/latest", mirror.url)]);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("NAME_INVALID"), "{body}");
    let (status, body) = curl(&["-H", "Range: bytes=9999999-", &blob_url]);
    assert_eq!(status, 416, "{body}");
}

/// The parts of a `multipart/byteranges` body: (Content-Range, bytes) each.
fn byteranges(content_type: &str, body: &[u8]) -> Vec<(String, Vec<u8>)> {
    let boundary = content_type
        .split("boundary=")
        .nth(1)
        .unwrap_or_else(|| panic!("no boundary in {content_type:?}"));
    let delimiter = format!("--{boundary}");
    let find = |from: usize, what: &[u8]| {
        body[from..]
            .windows(what.len())
            .position(|w| w == what)
            .map(|i| from + i)
    };
    let mut parts = Vec::new();
    let mut at = find(0, delimiter.as_bytes()).expect("a first part");
    loop {
        at += delimiter.len();
        if body[at..].starts_with(b"--") {
            return parts;
        }
        let head_end = find(at, b"\r\n\r\n").expect("a part head");
        let head = String::from_utf8_lossy(&body[at..head_end]).to_lowercase();
        let range = head
            .lines()
            .find_map(|l| l.strip_prefix("content-range: "))
            .expect("a Content-Range per part")
            .to_string();
        let (a, b) = range
            .trim_start_matches("bytes ")
            .split('/')
            .next()
            .and_then(|r| r.split_once('-'))
            .unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        let data = head_end + 4;
        parts.push((range, body[data..data + b - a + 1].to_vec()));
        at = find(data + b - a + 1, delimiter.as_bytes()).expect("the next delimiter");
    }
}

/// `curl -s -i` of `url` with `headers`: status, headers (lowercase), body.
fn curl_raw(url: &str, headers: &[&str]) -> (u16, String, Vec<u8>) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-i"]);
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd.arg(url).output().unwrap();
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP answer");
    let head = String::from_utf8_lossy(&out.stdout[..split]).to_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head, out.stdout[split + 4..].to_vec())
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_clients_other_than_containerd_get_tags_json_the_registrys_refusals_and_multipart_ranges()
 {
    let work = tempfile::tempdir().unwrap();
    let (registry, _agent, mirror) = one_node(work.path(), None, "test/clients", 1 << 20).await;
    let mirror_host = mirror.url.trim_start_matches("http://").to_string();
    let direct = format!("http://{}", registry.host());

    // skopeo list-tags: the same answer through the mirror as from the registry.
    let list = |host: &str| {
        let out = Command::new("skopeo")
            .args(["list-tags", "--tls-verify=false"])
            .arg(format!("docker://{host}/test/clients"))
            .output()
            .unwrap();
        let text = ok(&out, &format!("skopeo list-tags at {host}"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["Tags"].clone()
    };
    let tags = list(&registry.host());
    assert_eq!(tags, serde_json::json!(["gzip", "zstd"]));
    assert_eq!(list(&mirror_host), tags);
    let ns = format!("ns={}", registry.host());
    let (status, head, body) = curl_raw(
        &format!("{}/v2/test/clients/tags/list?n=2&{ns}", mirror.url),
        &[],
    );
    assert_eq!(status, 200, "{head}");
    assert!(
        header(&head, "content-type").is_some_and(|t| t.starts_with("application/json")),
        "{head}"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["tags"], tags, "{v}");
    let (status, _, body) = curl_raw(
        &format!("{}/v2/test/clients/tags/list?n=many&{ns}", mirror.url),
        &[],
    );
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("PAGINATION_NUMBER_INVALID"), "{body}");
    let (status, _, body) = curl_raw(&format!("{}/v2/test/none/tags/list?{ns}", mirror.url), &[]);
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("NAME_UNKNOWN"),
        "the registry's own error: {body}"
    );

    // GET /v2/: `{}` as JSON, with the API version header.
    let (status, head, body) = curl_raw(&format!("{}/v2/?{ns}", mirror.url), &[]);
    assert_eq!((status, body.as_slice()), (200, &b"{}"[..]), "{head}");
    assert_eq!(
        header(&head, "content-type"),
        Some("application/json"),
        "{head}"
    );
    assert_eq!(
        header(&head, "docker-distribution-api-version"),
        Some("registry/2.0"),
        "{head}"
    );

    // An OCI manifest asked for with only Docker's type acceptable: the
    // registry's own status and reason, not "not found upstream".
    let docker_only = "Accept: application/vnd.docker.distribution.manifest.v2+json";
    let (want_status, _, want_body) = curl_raw(
        &format!("{direct}/v2/test/clients/manifests/gzip"),
        &[docker_only],
    );
    assert!(
        String::from_utf8_lossy(&want_body)
            .contains("accept header does not support OCI manifests"),
        "the registry's answer changed: {}",
        String::from_utf8_lossy(&want_body)
    );
    let (status, _, body) = curl_raw(
        &format!("{}/v2/test/clients/manifests/gzip?{ns}", mirror.url),
        &[docker_only],
    );
    assert_eq!(
        (status, String::from_utf8_lossy(&body)),
        (want_status, String::from_utf8_lossy(&want_body))
    );

    // Two ranges of a layer: 206 multipart/byteranges, the same parts as the
    // registry's; more than 16 ranges: 416 and why.
    let (_, _, manifest) = curl_raw(
        &format!("{direct}/v2/test/clients/manifests/gzip"),
        &["Accept: application/vnd.oci.image.manifest.v1+json"],
    );
    let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    // The layer holding the random megabyte: the largest.
    let layer = manifest["layers"]
        .as_array()
        .and_then(|l| l.iter().max_by_key(|l| l["size"].as_u64()))
        .and_then(|l| l["digest"].as_str())
        .unwrap_or_else(|| panic!("no layers in {manifest}"))
        .to_string();
    let ranges = "Range: bytes=0-9,500000-500015,-7";
    let (status, head, body) = curl_raw(
        &format!("{}/v2/test/clients/blobs/{layer}?{ns}", mirror.url),
        &[ranges],
    );
    assert_eq!(status, 206, "{head}");
    let ours = byteranges(header(&head, "content-type").unwrap(), &body);
    assert_eq!(
        header(&head, "content-length"),
        Some(body.len().to_string().as_str()),
        "{head}"
    );
    let (status, head, body) = curl_raw(
        &format!("{direct}/v2/test/clients/blobs/{layer}"),
        &[ranges],
    );
    assert_eq!(status, 206, "{head}");
    let theirs = byteranges(header(&head, "content-type").unwrap(), &body);
    assert_eq!(ours.len(), 3);
    assert_eq!(ours, theirs);
    let seventeen = format!("Range: bytes={}", vec!["0-0"; 17].join(","));
    let (status, _, body) = curl_raw(
        &format!("{}/v2/test/clients/blobs/{layer}?{ns}", mirror.url),
        &[&seventeen],
    );
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 416, "{body}");
    assert!(
        body.contains("17 ranges asked for") && body.contains("at most 16"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_default_hosts_every_registry_goes_through_the_mirror_and_a_shared_layer_leaves_a_registry_once()
 {
    let work = tempfile::tempdir().unwrap();
    let (a, agent, _) = one_node(work.path(), None, "shared/img", 8 << 20).await;
    // The same image, byte for byte, in a second registry.
    let b = Registry::start(None).await;
    let out = Command::new("skopeo")
        .args([
            "copy",
            "-q",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
        ])
        .arg(format!("docker://{}/shared/img:gzip", a.host()))
        .arg(format!("docker://{}/other/img:gzip", b.host()))
        .output()
        .unwrap();
    ok(&out, "skopeo copy between the registries");
    // Images are named by the counting relays' addresses, so containerd's own
    // fallback to a registry is counted too.
    let (name_a, name_b) = (relay_host(&a), relay_host(&b));
    let mirror = MirrorProc::start(
        &agent,
        &[(name_a.clone(), a.url()), (name_b.clone(), b.url())],
    )
    .await;
    let hosts = work.path().join("certs.d");
    ok(
        &Command::new(env!("CARGO_BIN_EXE_dray"))
            .args(["agent", "configure-containerd", "--all-registries"])
            .arg("--config-path")
            .arg(&hosts)
            .args(["--mirror", &mirror.url])
            .output()
            .unwrap(),
        "dray agent configure-containerd --all-registries",
    );
    assert!(hosts.join("_default/hosts.toml").is_file());
    assert_eq!(
        std::fs::read_dir(&hosts).unwrap().count(),
        1,
        "one file for all"
    );

    let ctrd = Containerd::start();
    let (before_a, before_b) = (a.egress(), b.egress());
    let image_a = format!("{name_a}/shared/img:gzip");
    ok(
        &ctrd.pull(&hosts, &image_a, None),
        "pull from the first registry",
    );
    let from_a = a.egress() - before_a;
    assert!(from_a > 8 << 20, "the layer came from the first registry");
    let image_b = format!("{name_b}/other/img:gzip");
    ok(
        &ctrd.pull(&hosts, &image_b, None),
        "pull from the second registry",
    );
    let from_b = b.egress() - before_b;
    // Its manifest and the two 4 KiB ranges that prove it holds the layer.
    assert!(
        from_b < 256 << 10,
        "the second registry sent {from_b} bytes, the first {from_a}: the shared layer was fetched twice"
    );
    let out = ok(
        &ctrd.ctr(&["run", "--rm", &image_b, "t-b", "cat", "/etc/greeting"]),
        "ctr run",
    );
    assert_eq!(out.trim(), "hello from dray");
}

/// `host:port` of a registry's counting relay.
fn relay_host(r: &Registry) -> String {
    r.url().trim_start_matches("http://").to_string()
}
