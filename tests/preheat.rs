//! Issue 19, preheat: a `dray tracker` and 8 `dray agent` processes in two
//! zones, the real registry. `dray preheat --percent 25` has the tracker
//! choose 2 nodes (one per zone), which pull the image's blobs into their
//! stores; then all 8 pull the image through their mirrors at once, and no
//! blob byte comes from the registry. A model artifact (CNCF ModelPack) is
//! preheated as an image is. The preheat API refuses a certificate the
//! tracker does not list.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const NODES: usize = 8;

fn dray(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .env("DRAY_LOG", "warn")
        .output()
        .unwrap()
}

/// `dray preheat` flags that speak to `tracker` with `id`'s certificate.
fn as_caller(dir: &Path, id: &str, tracker: &str) -> Vec<String> {
    let f = |n: &str| dir.join(id).join(n).display().to_string();
    // `ci` holds a preheater's certificate, the others a node's.
    let kind = if id == "ci" { "preheater" } else { "agent" };
    vec![
        "--cert".into(),
        f(&format!("{kind}.crt")),
        "--key".into(),
        f(&format!("{kind}.key")),
        "--ca".into(),
        f("ca.crt"),
        "--tracker".into(),
        tracker.into(),
    ]
}

/// `dray preheat TARGET FLAGS` as the preheater `ci`.
fn preheat_as_ci(dir: &Path, tracker: &str, target: &str, flags: &[&str]) -> std::process::Output {
    let mut args = vec!["preheat".to_string(), target.to_string()];
    args.extend(flags.iter().map(|f| f.to_string()));
    args.extend(as_caller(dir, "ci", tracker));
    dray(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The registry's blob bytes all agents received so far.
fn registry_bytes(dir: &Path, admins: &[String]) -> f64 {
    admins
        .iter()
        .map(|a| {
            metric(
                dir,
                a,
                "dray_agent_received_bytes_total{source=\"registry\"}",
            )
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preheated_image_rolls_out_with_no_registry_blob_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    build_image(
        &registry,
        &dir.path().join("img"),
        "test/preheat",
        24 << 20,
        None,
    );
    let image = format!("{}/test/preheat:gzip", registry.host());
    let mut ids: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    ids.push("intruder".to_string());
    issue_certificates(
        dir.path(),
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let ca_dir = dir.path().join("ca");
    let ci = dir.path().join("ci");
    dray_ok(&[
        "ca",
        "issue",
        "--ca-dir",
        ca_dir.to_str().unwrap(),
        "--peer-id",
        "ci",
        "--preheater",
        "--out",
        ci.to_str().unwrap(),
    ]);
    let (_tracker, tracker_url) = start_tracker(
        dir.path(),
        "announce_interval = \"2s\"\nmin_fetch_timeout = \"2s\"\npreheaters = [\"ci\"]\n",
    );
    let agents: Vec<DrayProc> = (0..NODES)
        .map(|i| {
            let id = format!("node-{i}");
            let zone = ["a", "b"][i % 2];
            let cfg = dir.path().join(format!("{id}.toml"));
            let text = agent_toml(
                dir.path(),
                &id,
                &tracker_url,
                &registry,
                &format!("labels = {{ zone = {zone:?} }}"),
            );
            std::fs::write(&cfg, text).unwrap();
            DrayProc::start(
                &["agent", "-c", cfg.to_str().unwrap()],
                &dir.path().join(format!("{id}.log")),
            )
        })
        .collect();
    let admins: Vec<String> = agents
        .iter()
        .map(|a| format!("http://{}", a.banner_field("metrics on http://")))
        .map(|a| a.trim_end_matches("/metrics").to_string())
        .collect();
    // Every agent announces to the coordinating replica, holding nothing.
    let started = Instant::now();
    while metric(dir.path(), &tracker_url, "dray_tracker_nodes") < NODES as f64 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the tracker knows {} of {NODES} idle agents",
            metric(dir.path(), &tracker_url, "dray_tracker_nodes")
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // A node's certificate may not preheat.
    let mut args = vec!["preheat".to_string(), image.clone(), "--json".into()];
    args.extend(as_caller(dir.path(), "intruder", &tracker_url));
    let out = dray(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("403")
            && err.contains("\"intruder\" presented a node's certificate, and the preheat API accepts only a preheater's"),
        "{err}"
    );

    // 25% of the 8 nodes: 2, one in each zone.
    let egress_before = registry.egress();
    let took = Instant::now();
    let out = preheat_as_ci(
        dir.path(),
        &tracker_url,
        &image,
        &["--percent", "25", "--timeout", "120s", "--json"],
    );
    let text = ok(&out, "dray preheat --percent 25 --json");
    let job: dray_protocol::preheat::PreheatJob = serde_json::from_str(&text).unwrap();
    let preheat_s = took.elapsed().as_secs_f64();
    let preheat_egress = registry.egress() - egress_before;
    assert!(job.done && job.failed == 0, "{job:?}");
    assert_eq!((job.matched, job.nodes.len()), (NODES as u32, 2), "{job:?}");
    let mut zones: Vec<&str> = job
        .nodes
        .iter()
        .map(|n| n.labels["zone"].as_str())
        .collect();
    zones.sort();
    assert_eq!(zones, ["a", "b"], "the 2 nodes are spread over the zones");
    let image_bytes = job.nodes[0].size;
    for n in &job.nodes {
        assert_eq!((n.have, n.size), (image_bytes, image_bytes), "{n:?}");
    }
    assert!(image_bytes > 24 << 20, "{image_bytes}");
    assert_eq!(
        metric(dir.path(), &tracker_url, "dray_tracker_preheat_jobs"),
        1.0
    );
    assert_eq!(
        metric(
            dir.path(),
            &tracker_url,
            "dray_tracker_preheat_nodes_pending"
        ),
        0.0
    );
    eprintln!(
        "preheat: 2 nodes hold {image_bytes} bytes after {preheat_s:.1} s; the registry sent {preheat_egress} bytes ({:.2} copies)",
        preheat_egress as f64 / image_bytes as f64
    );
    assert!(
        (preheat_egress as f64) < 1.5 * image_bytes as f64,
        "the 2 preheated nodes took {preheat_egress} bytes from the registry for a {image_bytes}-byte image"
    );

    // The rollout: all 8 pull the image through their mirrors at once.
    let manifest = registry_get(&registry, "test/preheat", "manifests/gzip");
    let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    let blobs: Vec<String> = std::iter::once(&manifest["config"])
        .chain(manifest["layers"].as_array().unwrap())
        .map(|d| d["digest"].as_str().unwrap().to_string())
        .collect();
    let from_registry_before = registry_bytes(dir.path(), &admins);
    let egress_before = registry.egress();
    let took = Instant::now();
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .flat_map(|(i, a)| {
            let mirror = a.banner_field("registry mirror on ");
            let host = registry.host();
            let dir = dir.path().to_path_buf();
            // containerd reads the manifest first, through the mirror.
            let got = Command::new("curl")
                .args(["-sSf", "-o", "/dev/null", "-H"])
                .arg("Accept: application/vnd.oci.image.manifest.v1+json")
                .arg(format!("{mirror}/v2/test/preheat/manifests/gzip?ns={host}"))
                .output()
                .unwrap();
            ok(&got, "the manifest through the mirror");
            blobs.iter().map(move |digest| {
                let url = format!("{mirror}/v2/test/preheat/blobs/{digest}?ns={host}");
                let out = dir.join(format!("node-{i}-{}", &digest[7..19]));
                let digest = digest.clone();
                std::thread::spawn(move || {
                    let got = Command::new("curl")
                        .args(["-sSf", "--max-time", "120", "-o"])
                        .arg(&out)
                        .arg(&url)
                        .output()
                        .unwrap();
                    ok(&got, &format!("GET {url}"));
                    assert_eq!(file_digest(&out), digest, "{url}");
                })
            })
        })
        .collect();
    for p in pulls {
        p.join().unwrap();
    }
    let rollout_s = took.elapsed().as_secs_f64();
    let rollout_egress = registry.egress() - egress_before;
    let from_registry = registry_bytes(dir.path(), &admins) - from_registry_before;
    eprintln!(
        "rollout: {NODES} nodes pulled {} blobs each in {rollout_s:.1} s; blob bytes from the registry {from_registry}, registry egress {rollout_egress} bytes (requests and headers)",
        blobs.len()
    );
    assert_eq!(from_registry, 0.0, "blob bytes came from the registry");
    assert!(
        rollout_egress < 256 << 10,
        "the registry sent {rollout_egress} bytes during the rollout"
    );

    // The text form: a job on one more node, which finds the image in the swarm.
    let out = preheat_as_ci(
        dir.path(),
        &tracker_url,
        &image,
        &["--count", "1", "--label", "zone=b", "--timeout", "60s"],
    );
    let text = ok(&out, "dray preheat --count 1 --label zone=b");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("node-")
            && lines[0].contains(" done ")
            && lines[0].ends_with("zone=b"),
        "{text}"
    );
    assert!(
        lines[1].starts_with(&format!("preheated {image} on 1 nodes in ")),
        "{text}"
    );
    // A model artifact (CNCF ModelPack: a model config, not an image's, and
    // raw weight blobs) is preheated as an image is: its blobs pulled
    // through the swarm, nothing unpacked.
    let model = common::model::push_model(&registry, dir.path(), "test/model", "v1", 8 << 20);
    let artifact = format!("{}/test/model:v1", registry.host());
    let out = preheat_as_ci(
        dir.path(),
        &tracker_url,
        &artifact,
        &["--count", "2", "--timeout", "60s", "--json"],
    );
    let text = ok(&out, &format!("dray preheat {artifact}"));
    let job: dray_protocol::preheat::PreheatJob = serde_json::from_str(&text).unwrap();
    assert!(
        job.done && job.failed == 0 && job.nodes.len() == 2,
        "{job:?}"
    );
    for n in &job.nodes {
        assert_eq!((n.have, n.size), (model.bytes, model.bytes), "{n:?}");
    }
    // And a label no node has: refused, saying so.
    let out = preheat_as_ci(dir.path(), &tracker_url, &image, &["--label", "zone=c"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("none of the 8 agents known here is labelled zone=c"),
        "{err}"
    );
    // An image of a registry the nodes' mirrors do not serve: every chosen
    // node refuses it without connecting anywhere, and the job fails saying why.
    let elsewhere = "127.0.0.2:5000/elsewhere/app:1";
    let out = preheat_as_ci(
        dir.path(),
        &tracker_url,
        elsewhere,
        &["--count", "2", "--timeout", "60s", "--json"],
    );
    assert!(!out.status.success());
    let job: dray_protocol::preheat::PreheatJob =
        serde_json::from_slice(&out.stdout).expect("the job's last state");
    assert_eq!(
        (job.failed, job.nodes.len(), job.done),
        (2, 2, false),
        "{job:?}"
    );
    for n in &job.nodes {
        let e = n.error.as_deref().unwrap_or_default();
        assert!(
            e.contains("registry 127.0.0.2:5000 is not one this node's mirror serves"),
            "{e}"
        );
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("preheating {elsewhere}: 2 of 2 nodes failed")),
        "{err}"
    );
}

/// A GET straight from the registry (not counted as the rollout's: it
/// happens before).
fn registry_get(registry: &Registry, repo: &str, path: &str) -> Vec<u8> {
    let out = Command::new("curl")
        .args([
            "-sSf",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!("{}/v2/{repo}/{path}", registry.url()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
