//! Issue 17: dray as a system service. `dray agent` and `dray tracker` as
//! processes, the real registry, other agents pulling through them:
//! SIGTERM ends each within its grace, exit status 0; a stopping agent leaves
//! the tracker at once and the others complete without it; the same with the
//! tracker stopped; and `dray agent` as PID 1 of its PID namespace (a
//! container's entrypoint) stops on SIGTERM too.

mod common;

use common::*;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Polls `done` every 50 ms for at most `limit`; returns how long it took.
fn within(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if done() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn sigterm(child: &Child) {
    // SAFETY: kill(2) on a child of this test.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
}

/// Waits (at most `limit` after `sent`) for the exit: (status, time since `sent`).
fn exit_after(
    child: &mut Child,
    sent: Instant,
    limit: Duration,
) -> (std::process::ExitStatus, Duration) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, sent.elapsed());
        }
        assert!(
            sent.elapsed() < limit,
            "pid {} still running {limit:?} after SIGTERM",
            child.id()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends SIGTERM and waits (at most `limit`) for the exit.
fn terminate(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let sent = Instant::now();
    sigterm(child);
    exit_after(child, sent, limit)
}

/// The agent config of node `id` (certificates under `dir/id`), `extra`
/// appended at the top level.
fn agent_config(dir: &Path, id: &str, tracker: &str, extra: &str) -> PathBuf {
    let d = |p: &str| dir.join(id).join(p).display().to_string();
    let text = format!(
        "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         cert = {:?}\nkey = {:?}\nca = {:?}\n{extra}\n\
         [swarm]\ntrackers = [{tracker:?}]\npull_announce_ms = 150\nidle_announce_ms = 300\n\
         tracker_grace_ms = 1500\nstall_ms = 4000\n\
         [local_api]\nsocket = {:?}\n\
         [mirror]\nlisten = \"127.0.0.1:0\"\n",
        d("state"),
        d("agent.crt"),
        d("agent.key"),
        d("ca.crt"),
        d("agent.sock"),
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// A storm: the real registry holding a 64 MiB blob, a `dray tracker`, a
/// `dray agent` (node-a, uploads capped at 16 MB/s) that pulled the blob
/// through its mirror, and three `dray blob pull` processes pulling it now,
/// mostly from node-a.
struct Storm {
    dir: tempfile::TempDir,
    registry: Registry,
    digest: String,
    tracker: Child,
    tracker_addr: String,
    seeder: Child,
    seeder_admin: String,
    pullers: Vec<(String, Child)>,
}

const SEEDER_GRACE_S: u64 = 10;

/// Starts `dray ARGS` with stderr into `log`, after reading its banner line.
fn spawn_with_banner(args: &[&str], log: &Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .env("DRAY_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut banner = String::new();
    stderr.read_line(&mut banner).unwrap();
    let mut file = std::fs::File::create(log).unwrap();
    std::io::Write::write_all(&mut file, banner.as_bytes()).unwrap();
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut file));
    (child, banner)
}

fn field(banner: &str, marker: &str) -> String {
    banner
        .split(marker)
        .nth(1)
        .and_then(|rest| rest.split([' ', ')', ',', '\n']).next())
        .unwrap_or_else(|| panic!("no {marker:?} in banner {banner:?}"))
        .to_string()
}

impl Storm {
    async fn start() -> Storm {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::start(None).await;
        let src = dir.path().join("blob");
        random_file(&src, 64 << 20);
        let digest = registry.push("test/lifecycle", &src);
        issue_certificates(dir.path(), &["node-a", "node-b", "node-c", "node-d"]);
        // Agents are expired after 3 silent intervals: 30 s here, so that a
        // node gone within a second was dropped because it said it leaves.
        let tracker_toml = dir.path().join("tracker.toml");
        std::fs::write(
            &tracker_toml,
            tracker_tls_toml(dir.path())
                + "listen = \"127.0.0.1:0\"\nannounce_interval_ms = 10000\nmin_fetch_timeout_ms = 2000\n",
        )
        .unwrap();
        let (tracker, banner) = spawn_with_banner(
            &["tracker", "-c", tracker_toml.to_str().unwrap()],
            &dir.path().join("tracker.log"),
        );
        let tracker_addr = field(&banner, "listening on https://");
        let tracker_url = format!("https://{tracker_addr}");

        let seeder_cfg = agent_config(
            dir.path(),
            "node-a",
            &tracker_url,
            &format!(
                "shutdown_grace = \"{SEEDER_GRACE_S}s\"\n[peer]\nupload_bytes_per_s = 16000000"
            ),
        );
        let (seeder, banner) = spawn_with_banner(
            &[
                "agent",
                "-c",
                seeder_cfg.to_str().unwrap(),
                "--upstream",
                &format!("{}={}", registry.host(), registry.url()),
            ],
            &dir.path().join("node-a.log"),
        );
        let seeder_admin = field(&banner, "metrics on http://")
            .trim_end_matches("/metrics")
            .to_string();
        let url = format!(
            "{}/v2/test/lifecycle/blobs/{digest}?ns={}",
            field(&banner, "registry mirror on "),
            registry.host()
        );
        let seeded = dir.path().join("seeded");
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "60", "-o"])
            .arg(&seeded)
            .arg(&url)
            .output()
            .unwrap();
        ok(&out, "pulling the blob through node-a's mirror");
        assert_eq!(file_digest(&seeded), digest);

        let pullers = ["node-b", "node-c", "node-d"]
            .iter()
            .map(|id| {
                let cfg = agent_config(dir.path(), id, &tracker_url, "");
                let log = std::fs::File::create(dir.path().join(format!("{id}.log"))).unwrap();
                let child = Command::new(env!("CARGO_BIN_EXE_dray"))
                    .args(["blob", "pull", "-c", cfg.to_str().unwrap()])
                    .args(["--registry", &registry.url(), "--repo", "test/lifecycle"])
                    .args(["--digest", &digest])
                    .env("DRAY_LOG", "info")
                    .stdout(Stdio::piped())
                    .stderr(log)
                    .spawn()
                    .unwrap();
                (id.to_string(), child)
            })
            .collect();
        Storm {
            dir,
            registry,
            digest,
            tracker,
            tracker_addr,
            seeder,
            seeder_admin,
            pullers,
        }
    }

    /// Waits until node-a has uploaded `bytes`, with every puller still running.
    fn until_seeder_uploaded(&mut self, bytes: f64) {
        let admin = format!("http://{}", self.seeder_admin);
        within(Duration::from_secs(20), || {
            metric(self.dir.path(), &admin, "dray_agent_uploaded_bytes_total") >= bytes
        })
        .expect("node-a uploads to the pullers");
        for (id, p) in &mut self.pullers {
            assert!(
                p.try_wait().unwrap().is_none(),
                "{id} finished before the stop it should outlive"
            );
        }
    }

    /// Every puller exits 0 with the whole blob, verified.
    fn pullers_complete(&mut self) -> Vec<serde_json::Value> {
        let mut reports = Vec::new();
        for (id, p) in std::mem::take(&mut self.pullers) {
            let out = p.wait_with_output().unwrap();
            let log = std::fs::read_to_string(self.dir.path().join(format!("{id}.log")))
                .unwrap_or_default();
            assert!(out.status.success(), "{id} failed:\n{log}");
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let blob = self
                .dir
                .path()
                .join(&id)
                .join("state/blobs")
                .join(self.digest.trim_start_matches("sha256:"));
            assert_eq!(file_digest(&blob), self.digest, "{id}'s copy");
            eprintln!("{id}: {report}");
            reports.push(report);
        }
        reports
    }
}

impl Drop for Storm {
    fn drop(&mut self) {
        for c in [&mut self.tracker, &mut self.seeder]
            .into_iter()
            .chain(self.pullers.iter_mut().map(|(_, c)| c))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_an_uploading_agent_within_its_grace_it_leaves_the_tracker_at_once_and_the_others_complete()
 {
    let mut storm = Storm::start().await;
    storm.until_seeder_uploaded(8.0 * 1024.0 * 1024.0);
    let tracker = format!("https://{}", storm.tracker_addr);
    let dir = storm.dir.path().to_path_buf();
    let nodes_before = metric(&dir, &tracker, "dray_tracker_nodes");
    assert_eq!(nodes_before, 4.0, "node-a and three pullers");

    let sent = Instant::now();
    sigterm(&storm.seeder);
    let dropped = within(Duration::from_secs(2), || {
        metric(&dir, &tracker, "dray_tracker_left_nodes_total") >= 1.0
    })
    .expect("the tracker drops node-a within 2 s of its SIGTERM, not after 3 intervals of 10 s");
    assert_eq!(
        metric(&dir, &tracker, "dray_tracker_expired_nodes_total"),
        0.0
    );
    let (status, took) = exit_after(
        &mut storm.seeder,
        sent,
        Duration::from_secs(SEEDER_GRACE_S + 3),
    );
    let log = std::fs::read_to_string(storm.dir.path().join("node-a.log")).unwrap();
    assert!(status.success(), "node-a exited with {status}:\n{log}");
    assert!(
        took < Duration::from_secs(SEEDER_GRACE_S),
        "node-a took {took:?}, more than its shutdown_grace:\n{log}"
    );
    assert!(log.contains("dray agent: stopped"), "{log}");
    eprintln!(
        "node-a: left the tracker {dropped:?} after SIGTERM, exited 0 after {took:?}; registry sent {} bytes so far",
        storm.registry.egress()
    );

    let reports = storm.pullers_complete();
    let from_registry: u64 = reports
        .iter()
        .map(|r| r["bytes_from_registry"].as_u64().unwrap())
        .sum();
    eprintln!("the pullers took {from_registry} bytes from the registry after node-a left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_tracker_at_once_and_the_agents_fall_back_and_complete() {
    let mut storm = Storm::start().await;
    storm.until_seeder_uploaded(8.0 * 1024.0 * 1024.0);
    let (status, took) = terminate(&mut storm.tracker, Duration::from_secs(5));
    let log = std::fs::read_to_string(storm.dir.path().join("tracker.log")).unwrap();
    assert!(status.success(), "the tracker exited with {status}:\n{log}");
    assert!(
        took < Duration::from_secs(2),
        "the tracker took {took:?} to stop"
    );
    eprintln!("tracker: exited 0 {took:?} after SIGTERM");
    storm.pullers_complete();
    // The seeder keeps serving without a tracker, and stops cleanly too.
    let (status, took) = terminate(&mut storm.seeder, Duration::from_secs(SEEDER_GRACE_S + 3));
    assert!(status.success(), "node-a exited with {status}");
    eprintln!("node-a: exited 0 {took:?} after SIGTERM with no tracker to leave");
}

#[test]
fn sigterm_stops_an_agent_that_is_pid_1_of_its_pid_namespace() {
    let dir = tempfile::tempdir().unwrap();
    issue_certificates(dir.path(), &["node-a"]);
    let cfg = agent_config(dir.path(), "node-a", "https://127.0.0.1:9", "");
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc"])
        .arg(env!("CARGO_BIN_EXE_dray"))
        .args(["agent", "-c", cfg.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .expect("unshare (util-linux) runs");
    let mut stderr = std::io::BufReader::new(unshare.stderr.take().unwrap());
    // Logs may come first: its announce to the dead tracker fails at once.
    let mut banner = String::new();
    while !banner.contains("dray agent") {
        banner.clear();
        assert_ne!(stderr.read_line(&mut banner).unwrap(), 0, "no banner");
    }
    // unshare --fork waits for its child, the namespace's PID 1.
    let children = format!("/proc/{0}/task/{0}/children", unshare.id());
    let agent: i32 = std::fs::read_to_string(&children)
        .unwrap()
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .expect("unshare has forked the agent");
    let ns_pid = std::fs::read_to_string(format!("/proc/{agent}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:").map(str::to_string))
        .unwrap();
    assert_eq!(
        ns_pid.split_whitespace().last(),
        Some("1"),
        "the agent is PID 1 in its namespace: NSpid {ns_pid}"
    );
    let sent = Instant::now();
    // SAFETY: kill(2) on the agent this test started.
    unsafe { libc::kill(agent, libc::SIGTERM) };
    let stopped = within(Duration::from_secs(5), || {
        unshare.try_wait().unwrap().is_some()
    });
    let _ = unshare.kill();
    let status = unshare.wait().unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    let took = stopped.unwrap_or_else(|| {
        panic!(
            "dray agent as PID 1 still ran {:?} after SIGTERM:\n{rest}",
            sent.elapsed()
        )
    });
    assert!(status.success(), "exited with {status}:\n{rest}");
    assert!(rest.contains("SIGTERM"), "{rest}");
    eprintln!("dray agent as PID 1: exited 0 {took:?} after SIGTERM");
}
