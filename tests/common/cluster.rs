//! A cluster of `dray agent` processes on loopback, pulling through their
//! mirrors as containerd would: started with a tracker, a DHT or both, and
//! the storm that has each GET one blob at once, timed per node, with
//! registry egress counted by the registry's relay.

use super::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The blob bytes an agent received from `source` so far.
pub fn received(dir: &Path, admin: &str, source: &str) -> f64 {
    metric(
        dir,
        admin,
        &format!("dray_agent_received_bytes_total{{source=\"{source}\"}}"),
    )
}

pub fn admin_of(agent: &DrayProc) -> String {
    let a = format!("http://{}", agent.banner_field("metrics on http://"));
    a.trim_end_matches("/metrics").to_string()
}

/// GETs `digest` through `agent`'s mirror into `out` on a thread, which
/// answers the file and when its copy was whole.
pub fn pull_through(
    agent: &DrayProc,
    registry: &Registry,
    repo: &str,
    digest: &str,
    out: PathBuf,
) -> std::thread::JoinHandle<(PathBuf, Instant)> {
    let mirror = agent.banner_field("registry mirror on ");
    let url = format!("{mirror}/v2/{repo}/blobs/{digest}?ns={}", registry.host());
    std::thread::spawn(move || {
        let got = Command::new("curl")
            .args(["-sSf", "--max-time", "180", "-o"])
            .arg(&out)
            .arg(&url)
            .output()
            .unwrap();
        ok(&got, &format!("GET {url}"));
        (out, Instant::now())
    })
}

/// [`pull_through`], waited for, and the copy checked against `digest`.
pub fn pull_whole(agent: &DrayProc, registry: &Registry, repo: &str, digest: &str, out: PathBuf) {
    let out = pull_through(agent, registry, repo, digest, out)
        .join()
        .unwrap()
        .0;
    assert_eq!(
        file_digest(&out),
        digest,
        "{} through {}",
        out.display(),
        agent.banner
    );
}

/// A cluster of `dray agent` processes under `dir` (their certificates
/// from [`issue_certificates`] there), each mirroring `registry`, announcing to `tracker`
/// (none if empty) and, with `dht`, joined in one DHT on loopback: the
/// first bootstraps from the addresses `dht` names, the rest from those and
/// the first (a seed: Kademlia's bootstrap finds them the others).
pub fn start_agents(
    dir: &Path,
    ids: &[String],
    tracker: &str,
    registry: &Registry,
    dht: Option<&[String]>,
) -> Vec<DrayProc> {
    start_agents_tuned(dir, ids, tracker, registry, dht, |toml| toml)
}

/// The swarm's timings as a cluster runs them (`swarm.stall` 30 s,
/// `tracker_grace` 3 s, announces every 500 ms), not the quick ones of
/// [`agent_toml`].
pub fn default_timings(toml: String) -> String {
    let quick = "pull_announce_ms = 150\nidle_announce_ms = 300\n\
                 tracker_grace_ms = 5000\nstall_ms = 10000\n";
    assert!(toml.contains(quick), "agent_toml's timings changed");
    toml.replace(quick, "")
}

/// [`start_agents`], each config passed through `tune` first.
pub fn start_agents_tuned(
    dir: &Path,
    ids: &[String],
    tracker: &str,
    registry: &Registry,
    dht: Option<&[String]>,
    tune: fn(String) -> String,
) -> Vec<DrayProc> {
    // The first agent is the others' seed (with the addresses `dht` names).
    let mut bootstrap: Vec<String> = dht.unwrap_or_default().to_vec();
    let mut agents: Vec<DrayProc> = Vec::new();
    for id in ids {
        let cfg = dir.join(format!("{id}.toml"));
        let extra = if dht.is_some() {
            format!("[swarm.dht]\nlisten = \"127.0.0.1:0\"\nbootstrap = {bootstrap:?}\n")
        } else {
            String::new()
        };
        std::fs::write(&cfg, tune(agent_toml(dir, id, tracker, registry, &extra))).unwrap();
        let agent = DrayProc::start(
            &["agent", "-c", cfg.to_str().unwrap()],
            &dir.join(format!("{id}.log")),
        );
        if dht.is_some() && agents.is_empty() {
            bootstrap.push(agent.banner_field("DHT on "));
        }
        agents.push(agent);
    }
    if dht.is_some() {
        // Until each has the others in its routing table.
        let admins: Vec<String> = agents.iter().map(admin_of).collect();
        let want = (ids.len() - 1) as f64;
        let started = Instant::now();
        while admins
            .iter()
            .any(|a| metric(dir, a, "dray_agent_dht_peers") < want)
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the agents did not all join the DHT"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        if ids.len() > 1 {
            eprintln!(
                "{} agents joined the DHT {:.1} s after the last one started; DHT traffic so far {:.0} KiB",
                ids.len(),
                started.elapsed().as_secs_f64(),
                dht_bytes(dir, &agents) / 1024.0
            );
        }
    }
    agents
}

/// Starts agent `id` with no tracker, bootstrapping from the DHT
/// `members`, and waits until it has a DHT peer; fails with `what` after
/// 60 s (a bound for a busy machine, not a claim: one suite run of eight
/// timed out at 20 s while the dht tests' 8-agent storm ran beside it).
pub fn join_dht(
    dir: &Path,
    id: &str,
    registry: &Registry,
    members: &[String],
    what: &str,
) -> DrayProc {
    let agent = start_agents(dir, &[id.to_string()], "", registry, Some(members)).remove(0);
    let within = Duration::from_secs(60);
    until_metric(
        dir,
        &admin_of(&agent),
        "dray_agent_dht_peers",
        1.0,
        within,
        what,
    );
    agent
}

/// Certificates for `ids` and the tracker under `dir`; the tracker started.
pub fn tracker_for(dir: &Path, ids: &[String]) -> (DrayProc, String) {
    issue_certificates(dir, &ids.iter().map(String::as_str).collect::<Vec<_>>());
    start_tracker(dir, "")
}

/// The bytes all `agents` sent on DHT connections so far.
pub fn dht_bytes(dir: &Path, agents: &[DrayProc]) -> f64 {
    agents
        .iter()
        .map(|a| {
            metric(
                dir,
                &admin_of(a),
                "dray_agent_dht_bytes_total{direction=\"out\"}",
            )
        })
        .sum()
}

/// What a storm did: seconds to the last node, registry egress and blob
/// bytes received from peers, in copies of the blob.
pub struct Storm {
    /// Seconds to the last node's copy.
    pub seconds: f64,
    /// Seconds to the first node's copy.
    pub first_s: f64,
    pub registry_copies: f64,
    pub peer_copies: f64,
    /// Bytes the agents sent on DHT connections during the storm.
    pub dht_bytes: f64,
}

/// Every agent GETs `digest` (of `size` bytes) through its mirror at once;
/// each copy must hash to it.
pub fn storm(
    dir: &Path,
    agents: &[DrayProc],
    registry: &Registry,
    repo: &str,
    digest: &str,
    size: u64,
) -> Storm {
    let admins: Vec<String> = agents.iter().map(admin_of).collect();
    let peers_before: f64 = admins.iter().map(|a| received(dir, a, "peer")).sum();
    let egress_before = registry.egress();
    let dht_before = dht_bytes(dir, agents);
    let took = Instant::now();
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| pull_through(a, registry, repo, digest, dir.join(format!("out-{i}"))))
        .collect();
    let mut first_s = f64::MAX;
    for p in pulls {
        let (out, done) = p.join().unwrap();
        first_s = first_s.min(done.duration_since(took).as_secs_f64());
        assert_eq!(file_digest(&out), digest, "{}", out.display());
    }
    let seconds = took.elapsed().as_secs_f64();
    let egress = registry.egress() - egress_before;
    let peers: f64 = admins.iter().map(|a| received(dir, a, "peer")).sum::<f64>() - peers_before;
    Storm {
        seconds,
        first_s,
        registry_copies: egress as f64 / size as f64,
        peer_copies: peers / size as f64,
        dht_bytes: dht_bytes(dir, agents) - dht_before,
    }
}

/// Waits until the tracker counts `n` nodes.
pub fn until_announced(dir: &Path, tracker_url: &str, n: usize) {
    let started = Instant::now();
    while metric(dir, tracker_url, "dray_tracker_nodes") < n as f64 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the agents did not announce"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
