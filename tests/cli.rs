//! Issue 7: `dray pull` and `dray status` against a running `dray agent`
//! process, through its local API socket, with the real registry.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::process::Command;

fn dray_json(args: &[&str]) -> serde_json::Value {
    let out = dray_ok(args);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("dray {args:?} printed no JSON ({e}): {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dray_pull_fetches_every_layer_and_dray_status_shows_them() {
    dray_agent::pull::registry::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    build_image(&registry, &dir.path().join("img"), "cli/app", 6 << 20, None);
    issue_certificates(dir.path(), &["node-a"]);
    let d = |p: &str| dir.path().join("node-a").join(p).display().to_string();
    let socket = d("agent.sock");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             cert = {:?}\nkey = {:?}\nca = {:?}\n[local_api]\nsocket = {socket:?}\n\
             [mirror]\nlisten = \"127.0.0.1:0\"\nupstreams = {{ {:?} = {:?} }}\n",
            d("state"),
            d("agent.crt"),
            d("agent.key"),
            d("ca.crt"),
            registry.host(),
            registry.url(),
        ),
    )
    .unwrap();
    let agent = DrayProc::start(
        &["agent", "-c", config.to_str().unwrap()],
        &dir.path().join("agent.log"),
    );

    let image = format!("{}/cli/app:gzip", registry.host());
    let pulled = dray_json(&["pull", "--socket", &socket, "--json", &image]);
    assert_eq!(pulled["done"], true, "{pulled}");
    assert!(pulled["error"].is_null(), "{pulled}");
    let layers = pulled["layers"].as_array().unwrap();
    assert!(!layers.is_empty());
    let mut sizes = BTreeMap::new();
    let mut from_registry = 0;
    for l in layers {
        let digest = l["digest"].as_str().unwrap().to_string();
        let size = l["size"].as_u64().unwrap();
        assert_eq!(l["complete"], true, "{l}");
        assert_eq!(l["have"].as_u64(), Some(size), "{l}");
        // One node, no tracker: every byte came from the registry.
        assert_eq!(l["bytes_from_registry"].as_u64(), Some(size), "{l}");
        from_registry += size;
        let path = dir
            .path()
            .join("node-a/state/blobs")
            .join(digest.trim_start_matches("sha256:"));
        assert_eq!(file_digest(&path), digest);
        sizes.insert(digest, size);
    }

    let status = dray_json(&["status", "--socket", &socket, "--json"]);
    assert_eq!(status["peer_id"], "node-a", "{status}");
    for (digest, size) in &sizes {
        let b = status["blobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["digest"] == digest.as_str())
            .unwrap_or_else(|| panic!("status lacks {digest}: {status}"));
        assert_eq!(b["complete"], true);
        assert_eq!(b["size"].as_u64(), Some(*size));
    }

    // The agent's metrics count the same bytes.
    let metrics = reqwest::get(format!(
        "http://{}/metrics",
        agent
            .banner_field("metrics on http://")
            .trim_end_matches("/metrics")
    ))
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    let counted: f64 = metrics
        .lines()
        .find(|l| l.starts_with("dray_agent_received_bytes_total{source=\"registry\"}"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or_else(|| panic!("no registry byte counter in\n{metrics}"));
    assert_eq!(counted as u64, from_registry);

    // A bad image and a dead socket each give one clear line.
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(["pull", "--socket", &socket, "Not A Reference"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("image reference"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(["status", "--socket", &d("nobody.sock")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no agent answers on"),
        "{err}"
    );
}

#[test]
fn dray_sim_stops_quietly_when_its_reader_goes_away() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(["sim", "--scenario", "small", "--compare"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader leaves before the first line (as `| head -0` would).
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.is_empty(),
        "{:?}: {err}",
        out.status
    );
}
