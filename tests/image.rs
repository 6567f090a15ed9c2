//! Issue 17 acceptance 8: `scripts/build-image.sh` builds the dray image with
//! no container engine and pushes it with skopeo to the real registry;
//! containerd 1.6 pulls it and `ctr run` of it prints `dray --version`; the
//! manifests in deploy/kubernetes/ (the chart's default rendering) name that
//! image's name and tag.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_image_runs_dray_under_containerd_and_the_manifests_name_it() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("scripts/build-image.sh"))
        .args(["--binary", env!("CARGO_BIN_EXE_dray"), "--insecure"])
        .arg(registry.host())
        .output()
        .unwrap();
    let pushed = ok(&out, "scripts/build-image.sh").trim().to_string();
    let version = dray_ok(&["--version"]).trim().to_string();
    let tag = version.strip_prefix("dray ").expect("dray VERSION");
    assert_eq!(pushed, format!("{}/dray:{tag}", registry.host()));

    let ctrd = Containerd::start();
    let hosts = hosts_dir(
        work.path(),
        &registry.host(),
        &registry.url(),
        &registry.url(),
    );
    ok(&ctrd.pull(&hosts, &pushed, None), "ctr image pull");
    let run = ctrd.ctr(&[
        "run",
        "--rm",
        &pushed,
        "dray-version",
        "/usr/bin/dray",
        "--version",
    ]);
    assert_eq!(ok(&run, "ctr run"), format!("{version}\n"));
    // The default command is the entrypoint's help: the image runs as is.
    let help = ctrd.ctr(&["run", "--rm", &pushed, "dray-help"]);
    assert!(ok(&help, "ctr run").contains("Usage: dray"), "{help:?}");

    // Every container of the rendered manifests runs that image: the name
    // and tag the script pushed, under whatever registry the operator sets.
    let mut named = 0;
    for entry in std::fs::read_dir(root.join("deploy/kubernetes")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text
            .lines()
            .filter(|l| l.trim_start().starts_with("image:"))
        {
            assert_eq!(line.trim(), format!("image: dray:{tag}"), "{line}");
            named += 1;
        }
    }
    assert!(
        named >= 4,
        "agent, init, snapshotter and tracker containers: {named}"
    );
}
