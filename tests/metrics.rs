//! Metrics and health acceptance: the real registry, a tracker and two agents
//! as `dray` processes; a blob pulled through each agent's mirror at once; then
//! each agent's and the tracker's `/metrics` must account for exactly what
//! happened (bytes by source, one copy from the registry, announces), and every
//! line of every exposition must be well formed.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Samples of an OpenMetrics text exposition, by series (`name{labels}`).
/// Panics on any line that is neither a comment nor `name{labels} value`,
/// and on a label that would carry a digest or a peer id.
fn parse_exposition(text: &str) -> BTreeMap<String, f64> {
    let is_name = |n: &str, first_ok: fn(char) -> bool| {
        n.chars().next().is_some_and(first_ok)
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let name_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let label_start = |c: char| c.is_ascii_alphabetic() || c == '_';
    assert_eq!(text.lines().last(), Some("# EOF"), "{text}");
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(comment) = line.strip_prefix("# ") {
            let mut words = comment.splitn(3, ' ');
            let (kind, name) = (words.next().unwrap(), words.next());
            match kind {
                "EOF" => assert_eq!(name, None, "{line}"),
                "HELP" | "TYPE" | "UNIT" => {
                    assert!(name.is_some_and(|n| is_name(n, name_start)), "{line}")
                }
                _ => panic!("unknown comment {line:?}"),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
        assert!(value.parse::<f64>().is_ok(), "bad value in {line:?}");
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (
                n,
                rest.strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}")),
            ),
            None => (series, ""),
        };
        assert!(is_name(name, name_start), "bad metric name in {line:?}");
        assert!(name.starts_with("dray_"), "{line:?}");
        let mut rest = labels;
        while !rest.is_empty() {
            let (key, after) = rest.split_once("=\"").unwrap_or_else(|| panic!("{line:?}"));
            assert!(is_name(key, label_start) && !key.contains(':'), "{line:?}");
            assert!(
                !["digest", "peer", "peer_id", "repo"].contains(&key),
                "unbounded label {key} in {line:?}"
            );
            let mut end = None;
            let mut escaped = false;
            for (i, c) in after.char_indices() {
                match (escaped, c) {
                    (false, '\\') => escaped = true,
                    (false, '"') => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let end = end.unwrap_or_else(|| panic!("unterminated label value in {line:?}"));
            rest = &after[end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
        assert!(
            samples
                .insert(series.to_string(), value.parse().unwrap())
                .is_none(),
            "series twice: {line:?}"
        );
    }
    samples
}

fn scrape(addr: &str) -> BTreeMap<String, f64> {
    let (status, body) = http_get(addr, "/metrics");
    assert_eq!(status, 200, "{body}");
    parse_exposition(&body)
}

fn sample(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

/// Scrapes until `done` holds (metrics are counted as chunks land, a moment
/// after the bytes reach the client), for at most 10 s.
fn scrape_until(
    addr: &str,
    done: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> BTreeMap<String, f64> {
    let started = Instant::now();
    loop {
        let m = scrape(addr);
        if done(&m) || started.elapsed() > Duration::from_secs(10) {
            return m;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_metrics_account_for_every_byte_and_the_tracker_counts_announces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 48u64 << 20; // 12 chunks
    let src = dir.path().join("blob");
    random_file(&src, size);
    let digest = registry.push("test/metrics", &src);
    issue_certificates(dir.path(), &["node-a", "node-b"]);

    let tracker_toml = dir.path().join("tracker.toml");
    std::fs::write(
        &tracker_toml,
        tracker_tls_toml(dir.path())
            + "listen = \"127.0.0.1:0\"\nannounce_interval_ms = 500\nmin_fetch_timeout_ms = 2000\n",
    )
    .unwrap();
    let tracker = DrayProc::start(
        &["tracker", "-c", tracker_toml.to_str().unwrap()],
        &dir.path().join("tracker.log"),
    );
    let tracker_addr = tracker.banner_field("listening on https://");
    let agents: Vec<DrayProc> = ["node-a", "node-b"]
        .iter()
        .map(|id| {
            let cfg = dir.path().join(format!("{id}.toml"));
            let text = agent_toml(
                dir.path(),
                id,
                &format!("https://{tracker_addr}"),
                &registry,
                "",
            );
            std::fs::write(&cfg, text).unwrap();
            DrayProc::start(
                &["agent", "-c", cfg.to_str().unwrap()],
                &dir.path().join(format!("{id}.log")),
            )
        })
        .collect();
    let admin: Vec<String> = agents
        .iter()
        .map(|a| {
            a.banner_field("metrics on http://")
                .trim_end_matches("/metrics")
                .to_string()
        })
        .collect();

    let bases = admin.iter().map(|a| format!("http://{a}"));
    for base in bases.chain([format!("https://{tracker_addr}")]) {
        assert_eq!(curl_get(dir.path(), &format!("{base}/healthz")).0, 200);
        let (status, body) = curl_get(dir.path(), &format!("{base}/readyz"));
        assert_eq!(status, 200, "{base}: {body}");
    }

    // Both nodes pull the blob through their mirrors at once, as two
    // containerd instances would.
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let url = format!(
                "{}/v2/test/metrics/blobs/{digest}?ns={}",
                a.banner_field("registry mirror on "),
                registry.host()
            );
            let out = dir.path().join(format!("pulled-{i}"));
            std::thread::spawn(move || {
                let status = std::process::Command::new("curl")
                    .args(["-sSf", "--max-time", "60", "-o"])
                    .arg(&out)
                    .arg(&url)
                    .status()
                    .unwrap();
                assert!(status.success(), "curl {url}");
                out
            })
        })
        .collect();
    for p in pulls {
        let out = p.join().unwrap();
        assert_eq!(file_digest(&out), digest);
    }

    let received = |m: &BTreeMap<String, f64>, source: &str| {
        sample(
            m,
            &format!("dray_agent_received_bytes_total{{source=\"{source}\"}}"),
        )
    };
    let metrics: Vec<BTreeMap<String, f64>> = admin
        .iter()
        .map(|a| {
            scrape_until(a, |m| {
                sample(m, "dray_agent_pulls_total{outcome=\"completed\"}") == 1.0
                    && received(m, "peer") + received(m, "registry") == size as f64
            })
        })
        .collect();
    let mut from_registry = 0.0;
    for (m, addr) in metrics.iter().zip(&admin) {
        let (peer, reg) = (received(m, "peer"), received(m, "registry"));
        eprintln!(
            "agent {addr}: {reg} bytes from the registry, {peer} from its peer, uploaded {}",
            sample(m, "dray_agent_uploaded_bytes_total")
        );
        assert_eq!(peer + reg, size as f64, "{addr}: {m:?}");
        from_registry += reg;
        assert_eq!(
            sample(m, "dray_agent_pulls_total{outcome=\"completed\"}"),
            1.0
        );
        assert_eq!(sample(m, "dray_agent_pulls_total{outcome=\"failed\"}"), 0.0);
        assert_eq!(sample(m, "dray_agent_pulls_in_flight"), 0.0);
        assert_eq!(sample(m, "dray_agent_pull_duration_seconds_count"), 1.0);
        assert_eq!(
            sample(
                m,
                "dray_agent_mirror_requests_total{kind=\"blob\",status=\"2xx\"}"
            ),
            1.0
        );
        // Every reason's series is there from the start, at 0.
        for (family, n) in [
            ("dray_agent_chunk_verify_failures_total", 2),
            ("dray_agent_registry_fallbacks_total", 4),
        ] {
            let series: Vec<f64> = m
                .iter()
                .filter(|(k, _)| k.starts_with(&format!("{family}{{")))
                .map(|(_, v)| *v)
                .collect();
            assert_eq!(series, vec![0.0; n], "{family}: {m:?}");
        }
        assert!(m.contains_key("dray_agent_connected_peers"), "{m:?}");
    }
    // Every byte a node took from its peer, the peer uploaded.
    for (me, other) in [(0, 1), (1, 0)] {
        assert!(
            sample(&metrics[other], "dray_agent_uploaded_bytes_total")
                >= received(&metrics[me], "peer"),
            "{metrics:?}"
        );
    }
    let ratio = from_registry / size as f64;
    let egress = registry.egress() as f64 / size as f64;
    eprintln!("registry bytes over both agents: {ratio:.3} copies; relay counted {egress:.3}");
    assert!(
        (1.0..=1.1).contains(&ratio),
        "{ratio:.3} copies from the registry"
    );
    assert!(egress <= 1.1, "the registry sent {egress:.3} copies");

    let (status, body) = curl_get(dir.path(), &format!("https://{tracker_addr}/metrics"));
    assert_eq!(status, 200, "{body}");
    let t = parse_exposition(&body);
    eprintln!("tracker: {t:?}");
    assert!(
        sample(&t, "dray_tracker_announces_total{kind=\"full\"}") >= 2.0,
        "{t:?}"
    );
    assert!(
        sample(&t, "dray_tracker_announces_total{kind=\"delta\"}") >= 2.0,
        "{t:?}"
    );
    let announces = sample(&t, "dray_tracker_announces_total{kind=\"full\"}")
        + sample(&t, "dray_tracker_announces_total{kind=\"delta\"}");
    assert_eq!(
        sample(&t, "dray_tracker_announce_duration_seconds_count"),
        announces
    );
    assert_eq!(sample(&t, "dray_tracker_nodes"), 2.0);
    assert_eq!(sample(&t, "dray_tracker_blobs"), 1.0);
    assert_eq!(sample(&t, "dray_tracker_chunk_maps"), 1.0);
    assert!(
        sample(&t, "dray_tracker_registry_runs_assigned_total") >= 3.0,
        "{t:?}"
    );
    assert_eq!(sample(&t, "dray_tracker_bans_total"), 0.0);
    // Honest agents left no request unanswered.
    assert_eq!(sample(&t, "dray_tracker_silent_peer_reports_total"), 0.0);
    assert_eq!(sample(&t, "dray_tracker_silent_owed_chunks_total"), 0.0);
    assert_eq!(sample(&t, "dray_tracker_rejected_requests_total"), 0.0);
}
