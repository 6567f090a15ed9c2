//! Issue 39's Prometheus acceptance: the real Prometheus server (Debian's
//! `prometheus`) scrapes a real tracker and three `dray agent` processes (on
//! loopback, every second) while they pull a blob through the swarm from the
//! real registry, and while the tracker is then hung (SIGSTOP: connections
//! accepted, nothing answered). Then:
//! - every PromQL expression of `deploy/grafana/dray-dashboard.json`, read
//!   from the JSON with Grafana's variables replaced as Grafana would for
//!   this window (`$__rate_interval` 4 scrape intervals, `$__range` the
//!   window, `$instance` all), returns data through `/api/v1/query_range`,
//!   as the panels ask for it;
//! - the tracker-unreachable alert of `deploy/prometheus/dray-alerts.yaml`
//!   reaches `firing`, on every agent's `dray_agent_tracker_reachable` 0.
//!   The rule file is loaded as shipped except that alert's `for:` (2m),
//!   rewritten to 5s in the test's copy so the test stays short.
//!
//! With `DRAY_DASHBOARD_PICTURE=<file.png>` set, the dashboard is also
//! rendered from this run into that file (`scripts/dashboard-picture.py`,
//! which needs matplotlib; the operator guide's picture is made so).
//!
//! One refused request is sent to the tracker (from a caller without a
//! certificate) so that its refusals panel has a series, as it would in any
//! cluster that ever saw one.

mod common;

use common::cluster::*;
use common::*;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A Prometheus server started by the test; killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
}

impl Prometheus {
    /// Starts Prometheus with `config` (a file under `dir`), storing under
    /// `dir`, on a free loopback port; waits until it is ready.
    fn start(dir: &Path, config: &Path) -> Prometheus {
        let listen = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("the prometheus server (Debian package prometheus)");
        let prometheus = Prometheus {
            child,
            url: format!("http://{listen}"),
        };
        let started = Instant::now();
        while curl_status(&format!("{}/-/ready", prometheus.url)) != 200 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "prometheus not ready in 30 s; see prometheus.log"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        prometheus
    }

    /// `GET /api/v1/<path>` with `params`; the answer's `data`.
    async fn api(&self, path: &str, params: &[(&str, String)]) -> serde_json::Value {
        let resp: serde_json::Value = reqwest::Client::new()
            .get(format!("{}/api/v1/{path}", self.url))
            .query(params)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(resp["status"], "success", "{path} {params:?}: {resp}");
        resp["data"].clone()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn curl_status(url: &str) -> u16 {
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "2",
            url,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The alert rules as shipped, with DrayTrackerUnreachable's `for: 2m`
/// shortened to 5 s.
fn rules_for_the_test() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/dray-alerts.yaml")).unwrap();
    let (before, after) = rules
        .split_once("- alert: DrayTrackerUnreachable")
        .expect("the alert in the rule file");
    let (alert, rest) = after.split_once("- alert: ").expect("an alert after it");
    assert!(
        alert.contains("for: 2m"),
        "the alert's `for` changed: {alert}"
    );
    format!(
        "{before}- alert: DrayTrackerUnreachable{}- alert: {rest}",
        alert.replace("for: 2m", "for: 5s")
    )
}

/// Every PromQL expression of the dashboard, with the panel's title.
fn dashboard_exprs() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("deploy/grafana/dray-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let rows = panel["panels"].as_array().cloned().unwrap_or_default();
        for p in std::iter::once(panel).chain(rows.iter()) {
            for t in p["targets"].as_array().into_iter().flatten() {
                let title = p["title"].as_str().unwrap().to_string();
                out.push((title, t["expr"].as_str().unwrap().to_string()));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_a_swarm_every_dashboard_expression_has_data_and_a_hung_tracker_fires_its_alert()
 {
    const SIZE: u64 = 64 << 20;
    dray_agent::pull::registry::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let blob = dir.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/prometheus", &blob);
    let ids: Vec<String> = (0..3).map(|i| format!("node-{i}")).collect();
    let certified: Vec<&str> = ids.iter().map(String::as_str).collect();
    issue_certificates(dir.path(), &certified);
    let (tracker, tracker_url) = start_tracker(dir.path(), "announce_interval_ms = 500\n");
    // A budget, so the store's budget has a series to draw; the DHT, so
    // its panels have one too.
    let agents = start_agents_tuned(dir.path(), &ids, &tracker_url, &registry, Some(&[]), |t| {
        t + "[gc]\nbudget = 10000000000\n"
    });

    let agent_targets: Vec<String> = agents
        .iter()
        .map(|a| admin_of(a).trim_start_matches("http://").to_string())
        .collect();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, rules_for_the_test()).unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}}\n\
             rule_files: [{rules:?}]\n\
             scrape_configs:\n\
             - job_name: dray-agent\n  static_configs: [{{targets: {agent_targets:?}}}]\n\
             - job_name: dray-tracker\n  scheme: https\n  tls_config: {{ca_file: {:?}}}\n  \
               static_configs: [{{targets: [{:?}]}}]\n",
            dir.path().join("tracker/ca.crt"),
            tracker_url.trim_start_matches("https://"),
        ),
    )
    .unwrap();
    let prometheus = Prometheus::start(dir.path(), &config);
    let window_start = unix_now();
    let up = || async {
        let data = prometheus.api("query", &[("query", "up".into())]).await;
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["value"][1] == "1")
            .count()
    };
    let started = Instant::now();
    while up().await < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "Prometheus does not scrape the tracker and three agents: {}",
            prometheus.api("targets", &[]).await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // A refused request: an announce without a node certificate.
    let refused = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .arg("--cacert")
        .arg(dir.path().join("tracker/ca.crt"))
        .args(["--data-binary", "no certificate"])
        .arg(format!("{tracker_url}/v1/tracker"))
        .output()
        .unwrap();
    let code = String::from_utf8_lossy(&refused.stdout).to_string();
    assert_eq!(
        code, "401",
        "the tracker's answer to a caller without a certificate"
    );

    // The three pull through their mirrors at once, over a few seconds of
    // scrapes (the registry sends 32 MiB/s).
    registry.throttle(32 << 20);
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| {
            pull_through(
                a,
                &registry,
                "test/prometheus",
                &digest,
                dir.path().join(format!("out-{i}")),
            )
        })
        .collect();
    for p in pulls {
        let (out, _) = p.join().unwrap();
        assert_eq!(file_digest(&out), digest);
    }
    registry.throttle(0);
    eprintln!(
        "swarm pull done: registry sent {:.2} copies",
        registry.egress() as f64 / SIZE as f64
    );
    // A few scrapes with the tracker answering, then it hangs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pid = tracker.pid() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let hung_at = Instant::now();

    let firing = loop {
        let alerts = prometheus.api("alerts", &[]).await;
        let state = alerts["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["labels"]["alertname"] == "DrayTrackerUnreachable")
            .map(|a| a["state"].as_str().unwrap().to_string());
        if state.as_deref() == Some("firing") {
            break alerts;
        }
        assert!(
            hung_at.elapsed() < Duration::from_secs(60),
            "DrayTrackerUnreachable not firing 60 s after the tracker hung: {alerts}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "DrayTrackerUnreachable firing {:.1} s after the tracker hung",
        hung_at.elapsed().as_secs_f64()
    );
    let unreachable = prometheus
        .api(
            "query",
            &[("query", "dray_agent_tracker_reachable == 0".into())],
        )
        .await;
    let unreachable = unreachable["result"].as_array().unwrap().len();
    assert_eq!(
        unreachable, 3,
        "agents reporting the tracker unreachable; {firing}"
    );

    // Every expression of the dashboard over the window, as the panels ask.
    let end = unix_now();
    let range = format!("{}s", (end - window_start).ceil() as u64);
    let mut empty = Vec::new();
    let exprs = dashboard_exprs();
    for (title, expr) in &exprs {
        let query = expr
            .replace("$__rate_interval", "4s")
            .replace("$__range", &range)
            .replace("$__interval", "1s")
            .replace("$instance", ".*");
        assert!(!query.contains('$'), "{title}: a variable left in {query}");
        let data = prometheus
            .api(
                "query_range",
                &[
                    ("query", query.clone()),
                    ("start", format!("{window_start:.3}")),
                    ("end", format!("{end:.3}")),
                    ("step", "1".into()),
                ],
            )
            .await;
        if data["result"].as_array().is_none_or(Vec::is_empty) {
            empty.push(format!("{title}: {query}"));
        }
    }
    eprintln!(
        "{} dashboard expressions over {range}; {} without data",
        exprs.len(),
        empty.len()
    );
    assert!(
        empty.is_empty(),
        "expressions without data:\n{}",
        empty.join("\n")
    );
    // The operator guide's picture of the dashboard, rendered from this run.
    if let Ok(out) = std::env::var("DRAY_DASHBOARD_PICTURE") {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/dashboard-picture.py");
        let made = Command::new(script)
            .args(["--prometheus", &prometheus.url, "--out", &out])
            .args(["--start", &format!("{window_start:.0}")])
            .args(["--end", &format!("{end:.0}")])
            .output()
            .unwrap();
        ok(&made, "scripts/dashboard-picture.py");
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
}
