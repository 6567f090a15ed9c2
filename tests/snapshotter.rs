//! `dray snapshotter` as containerd 1.6's proxy snapshotter: a real pull
//! (containerd applies the layers into the shim's mounts), a container run
//! from its snapshots, a shim restart and a kill -9 that keep them, and a
//! clean removal.
//! No agent runs: `ctr image pull` sends no CRI labels, so the shim is a plain
//! overlayfs snapshotter here (the remote-layer path needs a CRI `PullImage`).

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Output;
use std::time::{Duration, Instant};

/// Runs `ctr` until it succeeds, for at most 20 s: after the shim restarts,
/// containerd's connection to it sits in gRPC backoff for a few seconds.
fn ctr_retrying(ctrd: &Containerd, args: &[&str]) -> Output {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = ctrd.ctr(args);
        if out.status.success() || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `ctr snapshots ls` rows, sorted (key, parent, kind).
fn snapshot_rows(ctrd: &Containerd) -> Vec<String> {
    let out = ok(
        &ctr_retrying(ctrd, &["snapshots", "--snapshotter", "dray", "ls"]),
        "snapshots ls",
    );
    let mut rows: Vec<String> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    rows.sort();
    rows
}

/// The shim's snapshot directories.
fn snapshot_dirs(shim: &SnapshotterProc) -> usize {
    std::fs::read_dir(shim.root.join("snapshots"))
        .unwrap()
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerd_pulls_runs_and_removes_an_image_on_the_dray_snapshotter_across_a_restart() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    build_image(
        &registry,
        &work.path().join("image"),
        "test/shim",
        1 << 20,
        None,
    );
    let image = format!("{}/test/shim:gzip", registry.host());

    let mut shim = SnapshotterProc::start(work.path(), &work.path().join("no-agent.sock"));
    let mode = std::fs::metadata(&shim.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o660, "socket mode {mode:o}");
    let ctrd = Containerd::start_with(&dray_proxy_plugin(&shim.socket));

    let started = Instant::now();
    ok(
        &ctrd.ctr(&[
            "image",
            "pull",
            "--plain-http",
            "--snapshotter",
            "dray",
            &image,
        ]),
        "pull",
    );
    eprintln!(
        "pull and unpack into the dray snapshotter: {:?}",
        started.elapsed()
    );
    let rows = snapshot_rows(&ctrd);
    // One committed snapshot per layer (the fixture's layers, whatever their number).
    let layers = ok(&ctrd.ctr(&["content", "ls"]), "content ls")
        .matches("containerd.io/uncompressed=")
        .count();
    assert!(layers >= 1);
    assert_eq!(
        rows.len(),
        layers,
        "one committed snapshot per layer: {rows:?}"
    );
    assert!(rows.iter().all(|r| r.ends_with(" Committed")), "{rows:?}");
    assert_eq!(snapshot_dirs(&shim), layers);

    let run = |id: &str| {
        ok(
            &ctr_retrying(
                &ctrd,
                &[
                    "run",
                    "--rm",
                    "--snapshotter",
                    "dray",
                    &image,
                    id,
                    "cat",
                    "/etc/greeting",
                ],
            ),
            "ctr run",
        )
    };
    assert_eq!(run("t-shim-1").trim(), "hello from dray");
    // The container's active snapshot is gone with it.
    assert_eq!(snapshot_rows(&ctrd), rows);

    let usage = ok(
        &ctrd.ctr(&["snapshots", "--snapshotter", "dray", "usage"]),
        "snapshots usage",
    );
    // A graceful restart, then a crash (kill -9 leaves a stale socket behind).
    for (crash, id) in [(false, "t-shim-2"), (true, "t-shim-3")] {
        shim.restart(crash);
        assert_eq!(
            snapshot_rows(&ctrd),
            rows,
            "the same snapshots after a restart"
        );
        // Usage asks the shim itself for every snapshot: its metadata survived.
        let usage_after = ok(
            &ctr_retrying(&ctrd, &["snapshots", "--snapshotter", "dray", "usage"]),
            "snapshots usage after restart",
        );
        assert_eq!(usage_after, usage, "crash: {crash}");
        assert_eq!(run(id).trim(), "hello from dray");
    }

    ok(&ctrd.ctr(&["image", "rm", "--sync", &image]), "image rm");
    assert_eq!(snapshot_rows(&ctrd), Vec::<String>::new());
    assert_eq!(
        snapshot_dirs(&shim),
        0,
        "the shim removed every directory:\n{}",
        shim.log_text()
    );
    assert!(shim.stop(), "graceful stop on SIGTERM");
    assert!(!shim.socket.exists(), "the socket is removed on exit");
}
