//! `dray status` (issue 39, item 4) against `dray agent` processes, a real
//! tracker and the real registry: while two agents pull a throttled blob
//! through their mirrors, `dray status --json` on one of them shows that
//! pull (its repository, registry, size, bytes held, from peers and the
//! registry, rate, ETA and the other node among its peers), and the text
//! form prints it as a table row; once done the pull is gone from the list
//! and the blob is complete. Then the tracker hangs (SIGSTOP): the status
//! says it is unreachable, and a pull that falls back to the registry for
//! it shows as a recent event with its reason.

mod common;

use common::cluster::*;
use common::*;
use std::time::{Duration, Instant};

/// `dray status --json` on the agent whose local API is `socket`.
fn status_json(socket: &str) -> serde_json::Value {
    let text = dray_ok(&["status", "--socket", socket, "--json"]);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Polls `dray status --json` every 100 ms until `done` holds, for at most
/// `within`; the last answer.
fn status_until(
    socket: &str,
    within: Duration,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let s = status_json(socket);
        if done(&s) {
            return s;
        }
        assert!(started.elapsed() < within, "{what} within {within:?}: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_pull_in_progress_its_peers_and_the_fallbacks_of_a_hung_tracker() {
    const SIZE: u64 = 48 << 20;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let blob = dir.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/status", &blob);
    let ids = ["node-a".to_string(), "node-b".to_string()];
    issue_certificates(dir.path(), &["node-a", "node-b"]);
    let (mut tracker, url) = start_tracker(dir.path(), "announce_interval_ms = 500\n");
    let agents = start_agents(dir.path(), &ids, &url, &registry, None);
    let socket = dir.path().join("node-a/agent.sock");
    let socket = socket.to_str().unwrap();

    let idle = status_json(socket);
    assert_eq!(idle["peer_id"], "node-a", "{idle}");
    assert_eq!(idle["pulls"].as_array().map(Vec::len), Some(0), "{idle}");
    let gc = &idle["gc"];
    let share = gc["use_share"].as_f64().unwrap();
    assert!(share > 0.0 && share <= 1.0, "{idle}");
    assert_eq!(gc["config"]["high_watermark"].as_f64(), Some(0.8), "{idle}");

    // 6 s from the registry at least: the pull is seen under way.
    registry.throttle(8 << 20);
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let out = dir.path().join(format!("pulled-{i}"));
            pull_through(a, &registry, "test/status", &digest, out)
        })
        .collect();
    // A chunk is held a moment before the attempt counts it (the store's
    // write, then the count under the transfer's lock, on a blocking
    // thread a busy host may deschedule between the two): CI once read
    // `have` 4 MiB with both counters at 0. The pull is under way once both
    // show it.
    let running = status_until(socket, Duration::from_secs(30), "a pull half way", |s| {
        s["pulls"].as_array().unwrap().iter().any(|p| {
            let have = p["have"].as_u64().unwrap();
            let counted = p["bytes_from_peers"].as_u64().unwrap()
                + p["bytes_from_registry"].as_u64().unwrap();
            p["digest"] == digest.as_str()
                && have > 0
                && have < SIZE
                && counted > 0
                && p["peer_count"] == 1
        })
    });
    eprintln!("dray status --json during the pull: {running}");
    let p = running["pulls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["digest"] == digest.as_str())
        .unwrap();
    assert_eq!(p["repository"], "test/status", "{p}");
    assert_eq!(p["registry"], registry.url(), "{p}");
    assert_eq!(p["size"].as_u64(), Some(SIZE), "{p}");
    let fetched =
        p["bytes_from_peers"].as_u64().unwrap() + p["bytes_from_registry"].as_u64().unwrap();
    assert!(fetched > 0 && fetched <= SIZE, "{p}");
    assert!(p["rate"].as_f64().unwrap() > 0.0, "{p}");
    let eta = p["eta_s"].as_f64().expect("an ETA once bytes came");
    assert!(eta > 0.0 && eta < 3600.0, "{p}");
    assert_eq!(p["peers"], serde_json::json!(["node-b"]), "{p}");
    assert_eq!(running["pulls_running"].as_u64(), Some(1), "{running}");
    assert_eq!(running["tracker_reachable"], true, "{running}");
    assert!(
        running["blobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["digest"] == digest.as_str() && b["complete"] == false),
        "{running}"
    );

    // The text form: the pull as a table row, under its header.
    let text = dray_ok(&["status", "--socket", socket]);
    eprintln!("dray status during the pull:\n{text}");
    let lines: Vec<&str> = text.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("BLOB") && l.contains("ETA"))
        .unwrap_or_else(|| panic!("no pull table in\n{text}"));
    let row = lines[header + 1];
    assert!(row.starts_with(&digest[..19]), "{text}");
    assert!(
        row.contains("test/status") && row.ends_with("   1"),
        "{text}"
    );
    assert!(text.contains(&format!("{url}: reachable")), "{text}");

    for (i, pull) in pulls.into_iter().enumerate() {
        let (out, _) = pull.join().unwrap();
        assert_eq!(file_digest(&out), digest, "node {i}");
    }
    registry.throttle(0);
    let done = status_until(
        socket,
        Duration::from_secs(10),
        "the pull gone from the list",
        |s| s["pulls"].as_array().unwrap().is_empty(),
    );
    assert!(
        done["blobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["digest"] == digest.as_str() && b["complete"] == true),
        "{done}"
    );

    // The tracker hangs: the node says so, and a new pull falls back to the
    // registry for it (swarm.tracker_grace, 5 s here) and shows as an event.
    let pid = tracker.pid() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let second = dir.path().join("second");
    random_file(&second, 4 << 20);
    let second_digest = registry.push("test/status", &second);
    let out = dir.path().join("pulled-second");
    let pull = pull_through(&agents[0], &registry, "test/status", &second_digest, out);
    let hung = status_until(
        socket,
        Duration::from_secs(30),
        "the fallback as an event",
        |s| {
            s["events"].as_array().unwrap().iter().any(|e| {
                e["digest"] == second_digest.as_str()
                    && e["kind"] == "fallback"
                    && e["reason"] == "tracker_silent"
            })
        },
    );
    assert_eq!(hung["tracker_reachable"], false, "{hung}");
    let text = dray_ok(&["status", "--socket", socket]);
    eprintln!("dray status with the tracker hung:\n{text}");
    assert!(text.contains(&format!("{url}: UNREACHABLE")), "{text}");
    assert!(
        text.lines().any(|l| l.contains("fallback")
            && l.contains(&second_digest[..19])
            && l.ends_with("tracker_silent")),
        "{text}"
    );
    let (out, _) = pull.join().unwrap();
    assert_eq!(file_digest(&out), second_digest);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(tracker.terminate(), "the tracker stops cleanly");
}
