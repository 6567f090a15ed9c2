//! `dray demo` from the outside: the built binary, its JSON report, and the
//! node directories it keeps, hashed here rather than trusted from the demo.

mod common;

use common::{Registry, build_image, file_digest};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dray(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .output()
        .expect("running dray")
}

/// Runs a demo that must succeed; returns its one JSON object.
fn demo_json(args: &[&str]) -> Value {
    let out = dray(args);
    assert!(
        out.status.success(),
        "dray {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Each file in `dir` (blobs named by their hex digest) by name, with its sha256.
fn blob_hashes(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, file_digest(&path))
        })
        .collect()
}

/// Checks the report's totals and that every node holds the same blobs, each
/// hashing to its name; returns those blobs.
fn check_nodes(report: &Value, nodes: usize) -> BTreeMap<String, String> {
    assert_eq!(report["nodes"], nodes);
    let ratio = report["egress_ratio"].as_f64().unwrap();
    assert!(
        (1.0..=1.1).contains(&ratio),
        "registry egress {ratio}× the image: {report}"
    );
    let image_bytes = report["image_bytes"].as_u64().unwrap();
    let rate = report["registry_mbps"].as_f64().unwrap() * 1e6 / 8.0;
    let bound = report["lower_bound_s"].as_f64().unwrap();
    assert!((bound - image_bytes as f64 / rate).abs() < 1e-6, "{report}");
    assert!((report["direct_estimate_s"].as_f64().unwrap() - nodes as f64 * bound).abs() < 1e-6);
    let per_node = report["per_node"].as_array().unwrap();
    assert_eq!(per_node.len(), nodes);
    let mut first: Option<BTreeMap<String, String>> = None;
    for n in per_node {
        assert_eq!(n["complete"], true, "{n}");
        assert!(n["seconds"].as_f64().unwrap() <= report["last_s"].as_f64().unwrap());
        let blobs = blob_hashes(&PathBuf::from(n["dir"].as_str().unwrap()).join("blobs"));
        for (name, hash) in &blobs {
            assert_eq!(hash, &format!("sha256:{name}"), "{}", n["dir"]);
        }
        match &first {
            None => first = Some(blobs),
            Some(f) => assert_eq!(
                &blobs, f,
                "{} holds other blobs than the first node",
                n["dir"]
            ),
        }
    }
    first.unwrap()
}

#[test]
fn four_nodes_pull_a_generated_image_which_leaves_the_registry_about_once() {
    let keep = tempfile::tempdir().unwrap();
    let report = demo_json(&[
        "demo",
        "--nodes",
        "4",
        "--size-mib",
        "32",
        "--json",
        "--keep",
        keep.path().to_str().unwrap(),
    ]);
    let blobs = check_nodes(&report, 4);
    // Four layers and the config, the same files as the generated layout's.
    assert_eq!(report["layers"], 4);
    assert_eq!(blobs.len(), 5);
    let image = blob_hashes(&keep.path().join("image/blobs/sha256"));
    for name in blobs.keys() {
        assert!(image.contains_key(name), "{name} is not in the image");
    }
    let total: u64 = blobs
        .keys()
        .map(|n| {
            std::fs::metadata(keep.path().join("node-0/blobs").join(n))
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(report["image_bytes"].as_u64().unwrap(), total);
    assert!(total >= 32 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_layout_given_with_image_is_served_and_pulled_by_every_node() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    build_image(&registry, work.path(), "test/demo", 6 << 20, None);
    let layout = work.path().join("oci");

    // The layout holds two tagged manifests: without --tag the demo says so.
    let out = dray(&["demo", "--image", layout.to_str().unwrap(), "--json"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("choose one with --tag"), "{err}");

    let keep = tempfile::tempdir().unwrap();
    let report = demo_json(&[
        "demo",
        "--nodes",
        "3",
        "--image",
        layout.to_str().unwrap(),
        "--tag",
        "gzip",
        "--json",
        "--keep",
        keep.path().to_str().unwrap(),
    ]);
    let blobs = check_nodes(&report, 3);
    // Every layer of the manifest tagged gzip, and the config.
    let read_json =
        |p: PathBuf| -> Value { serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap() };
    let index = read_json(layout.join("index.json"));
    let manifest = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == "gzip")
        .unwrap();
    let digest = manifest["digest"].as_str().unwrap();
    let manifest = read_json(layout.join("blobs/sha256").join(&digest[7..]));
    let layers = manifest["layers"].as_array().unwrap().len();
    assert_eq!(report["layers"], layers);
    assert_eq!(blobs.len(), layers + 1);
    for (name, hash) in &blobs {
        let source = layout.join("blobs/sha256").join(name);
        assert_eq!(
            &file_digest(&source),
            hash,
            "{name} differs from the layout's"
        );
    }
}

#[test]
fn a_bad_image_path_fails_with_one_clear_line() {
    let out = dray(&["demo", "--image", "/nonexistent/dray-layout", "--json"]);
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<_> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("dray: "), "{err}");
    assert!(
        lines[0].contains("/nonexistent/dray-layout/index.json"),
        "{err}"
    );
    assert!(lines[0].contains("not an OCI image layout"), "{err}");
}

#[test]
fn a_keep_dir_with_files_in_it_is_refused() {
    let keep = tempfile::tempdir().unwrap();
    std::fs::write(keep.path().join("old"), b"from an earlier run").unwrap();
    let out = dray(&["demo", "--json", "--keep", keep.path().to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not empty"), "{err}");
}
