//! Issue 19, discovery without a tracker: 8 `dray agent` processes with no
//! tracker at all, joined in a Kademlia DHT, the real registry. All 8 pull
//! a 128 MiB blob through their mirrors at once; the peers are found
//! through the DHT, the registry-fetch rule among them sends each chunk
//! from the registry about once, and every copy is byte-identical. Then a
//! node whose certificate another CA signed tries to join: the members
//! refuse its connections, and its pull finds no peer (it comes from the
//! registry alone).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const NODES: usize = 8;
const SIZE: u64 = 128 << 20;

/// The blob bytes an agent received from `source` so far.
fn received(dir: &Path, admin: &str, source: &str) -> f64 {
    metric(
        dir,
        admin,
        &format!("dray_agent_received_bytes_total{{source=\"{source}\"}}"),
    )
}

fn admin_of(agent: &DrayProc) -> String {
    let a = format!("http://{}", agent.banner_field("metrics on http://"));
    a.trim_end_matches("/metrics").to_string()
}

/// GETs `digest` through `agent`'s mirror into `out` on a thread.
fn pull_through(
    agent: &DrayProc,
    registry: &Registry,
    repo: &str,
    digest: &str,
    out: std::path::PathBuf,
) -> std::thread::JoinHandle<std::path::PathBuf> {
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
        out
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_agents_without_a_tracker_find_each_other_in_the_dht_and_leave_the_registry_about_once()
 {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let blob = dir.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/dht", &blob);
    let ids: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    issue_certificates(
        dir.path(),
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let ports: Vec<u16> = (0..NODES).map(|_| free_port()).collect();
    let bootstrap: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let dht = |port: u16| {
        format!("[swarm.dht]\nlisten = \"127.0.0.1:{port}\"\nbootstrap = {bootstrap:?}\n")
    };
    let agents: Vec<DrayProc> = ids
        .iter()
        .zip(&ports)
        .map(|(id, port)| {
            let cfg = dir.path().join(format!("{id}.toml"));
            std::fs::write(&cfg, agent_toml(dir.path(), id, "", &registry, &dht(*port))).unwrap();
            DrayProc::start(
                &["agent", "-c", cfg.to_str().unwrap()],
                &dir.path().join(format!("{id}.log")),
            )
        })
        .collect();
    let admins: Vec<String> = agents.iter().map(admin_of).collect();
    for (a, port) in agents.iter().zip(&ports) {
        assert_eq!(a.banner_field("DHT on "), format!("127.0.0.1:{port}"));
    }
    // Their first dial rounds (every 2 s) connect them.
    std::thread::sleep(Duration::from_secs(3));

    let egress_before = registry.egress();
    let took = Instant::now();
    let pulls: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| {
            pull_through(
                a,
                &registry,
                "test/dht",
                &digest,
                dir.path().join(format!("out-{i}")),
            )
        })
        .collect();
    for p in pulls {
        let out = p.join().unwrap();
        assert_eq!(file_digest(&out), digest, "{}", out.display());
    }
    let storm_s = took.elapsed().as_secs_f64();
    let egress = registry.egress() - egress_before;
    let copies = egress as f64 / SIZE as f64;
    let from_peers: Vec<f64> = admins
        .iter()
        .map(|a| received(dir.path(), a, "peer"))
        .collect();
    let peer_copies = from_peers.iter().sum::<f64>() / SIZE as f64;
    eprintln!(
        "no tracker, {NODES} nodes, {} MiB: all done in {storm_s:.1} s; registry egress {copies:.3} copies; {peer_copies:.2} copies moved between peers",
        SIZE >> 20
    );
    assert!(copies <= 1.5, "the registry sent {copies:.3} copies");
    assert!(
        peer_copies >= (NODES - 2) as f64,
        "only {peer_copies:.2} copies came from peers found through the DHT"
    );

    // A node whose certificate another CA signed: the members refuse it.
    let other = tempfile::tempdir().unwrap();
    issue_certificates(other.path(), &["outsider"]);
    let cfg = other.path().join("outsider.toml");
    std::fs::write(
        &cfg,
        agent_toml(other.path(), "outsider", "", &registry, &dht(free_port())),
    )
    .unwrap();
    let outsider = DrayProc::start(
        &["agent", "-c", cfg.to_str().unwrap()],
        &other.path().join("outsider.log"),
    );
    let out = pull_through(
        &outsider,
        &registry,
        "test/dht",
        &digest,
        other.path().join("out"),
    )
    .join()
    .unwrap();
    assert_eq!(file_digest(&out), digest);
    let admin = admin_of(&outsider);
    assert_eq!(
        received(other.path(), &admin, "peer"),
        0.0,
        "a member served the outsider"
    );
    assert_eq!(received(other.path(), &admin, "registry"), SIZE as f64);
    let log = |id: &str| std::fs::read_to_string(dir.path().join(format!("{id}.log"))).unwrap();
    let refused = ids
        .iter()
        .filter(|id| log(id).contains("refused a DHT connection"))
        .count();
    assert!(refused > 0, "no member logged refusing the outsider");
    eprintln!(
        "the outsider was refused by {refused} of {NODES} members and pulled from the registry alone"
    );
}
