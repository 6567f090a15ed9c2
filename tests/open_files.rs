//! Issue 18, "file descriptors and announces bounded": a `dray agent`
//! process holding 600 blobs opens none of them at start, keeps at most
//! `max_open_idle_blobs` idle ones open while a peer reads 300 of them (each
//! closed one reopened from its record and served verified), and its full
//! announce stays within a `dray tracker` that takes at most 512 blobs per
//! node: the 512 most recently used are announced, another node finds it as
//! the holder of one of them, and the agent says what it left out.

mod common;

use common::*;
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::identity::Identity;
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::store::ChunkStore;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{ChunkMap, DEFAULT_CHUNK_SIZE};
use std::time::{Duration, Instant};

const BLOBS: usize = 600;
const TRACKER_MAX_BLOBS: usize = 512;
const MAX_OPEN_IDLE: usize = 16;
const READ_BLOBS: usize = 300;

/// The value of `series` at the agent's admin endpoint (0 if absent).
fn metric(admin: &str, series: &str) -> f64 {
    let (status, body) = http_get(admin, "/metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Blob `i`: 4 KiB of its own, starting with its number.
fn blob_bytes(i: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..4096u32).map(|j| (j * 7 + (j >> 8)) as u8).collect();
    bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
    bytes
}

/// What the tracker answers node-b wanting `map`'s blob: the peers it names.
async fn holders_named(client: &TrackerClient, tracker: &str, map: &ChunkMap) -> Vec<String> {
    let announce = pb::Announce {
        peer_id: "node-b".into(),
        address: "127.0.0.1:9".into(),
        blobs: vec![pb::BlobHolding {
            digest: map.digest().to_string(),
            size: map.size(),
            chunk_size: map.chunk_size(),
            bits: vec![0u8; map.chunk_count().div_ceil(8) as usize].into(),
            wanted: true,
            ..Default::default()
        }],
        full: true,
        ..Default::default()
    };
    let resp = client
        .send(tracker, Body::Announce(announce))
        .await
        .unwrap()
        .expect("an answer");
    resp.peers
        .get(&map.digest().to_string())
        .map(|l| l.peers.iter().map(|p| p.peer_id.clone()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_holding_600_blobs_keeps_its_files_and_its_announce_within_bounds() {
    let dir = tempfile::tempdir().unwrap();
    issue_certificates(dir.path(), &["node-a", "node-b"]);
    let node = |id: &str, f: &str| dir.path().join(id).join(f);

    // 600 complete blobs, seeded oldest first (their files' mtimes are
    // their last use after a restart).
    let started = Instant::now();
    let maps: Vec<ChunkMap> = {
        let store = ChunkStore::open(&node("node-a", "state")).unwrap();
        // This test is about open files, not eviction: under the default
        // watermarks a host disk past 80% full (counted as kubelet counts
        // it, from the space available to users) had every import evict
        // the blob before it, and 600 imports left one file.
        store.gc().configure(
            dray_agent::store::gc::GcConfig {
                high_watermark: 1.0,
                low_watermark: 1.0,
                critical_watermark: 1.0,
                ..Default::default()
            },
            false,
        );
        let src = dir.path().join("src");
        (0..BLOBS)
            .map(|i| {
                std::fs::write(&src, blob_bytes(i)).unwrap();
                store.import(&src, DEFAULT_CHUNK_SIZE).unwrap()
            })
            .collect()
    };
    // A second apart: the kernel's file times are coarser than an import.
    let first_use = std::time::SystemTime::now() - Duration::from_secs(BLOBS as u64);
    for (i, map) in maps.iter().enumerate() {
        let path = node("node-a", "state/blobs").join(map.digest().hex());
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(first_use + Duration::from_secs(i as u64))
            .unwrap();
    }
    eprintln!("seeded {BLOBS} blobs in {:?}", started.elapsed());

    let tracker_toml = dir.path().join("tracker.toml");
    std::fs::write(
        &tracker_toml,
        tracker_tls_toml(dir.path())
            + &format!(
                "listen = \"127.0.0.1:0\"\nannounce_interval_ms = 2000\nmax_blobs_per_node = {TRACKER_MAX_BLOBS}\n"
            ),
    )
    .unwrap();
    let tracker = DrayProc::start_until(
        &["tracker", "-c", tracker_toml.to_str().unwrap()],
        &[("DRAY_LOG", "info")],
        "listening on https://",
        &dir.path().join("tracker.log"),
    );
    let tracker_url = format!("https://{}", tracker.banner_field("listening on https://"));

    let agent_toml = dir.path().join("node-a.toml");
    std::fs::write(
        &agent_toml,
        format!(
            "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             cert = {:?}\nkey = {:?}\nca = {:?}\nmax_open_idle_blobs = {MAX_OPEN_IDLE}\n\
             [swarm]\ntrackers = [{tracker_url:?}]\nidle_announce_ms = 300\n\
             max_announce_blobs = {TRACKER_MAX_BLOBS}\n\
             [local_api]\nsocket = {:?}\n[mirror]\nlisten = \"127.0.0.1:0\"\n\
             [gc]\nhigh_watermark = 1.0\nlow_watermark = 1.0\ncritical_watermark = 1.0\n",
            node("node-a", "state"),
            node("node-a", "agent.crt"),
            node("node-a", "agent.key"),
            node("node-a", "ca.crt"),
            node("node-a", "agent.sock"),
        ),
    )
    .unwrap();
    let agent_log = dir.path().join("node-a.log");
    let agent = DrayProc::start_until(
        &["agent", "-c", agent_toml.to_str().unwrap()],
        &[("DRAY_LOG", "info")],
        "serving peers on ",
        &agent_log,
    );
    let pid = agent.pid();
    let peer_addr = agent.banner_field("serving peers on ").parse().unwrap();
    let admin = agent
        .banner_field("metrics on http://")
        .trim_end_matches("/metrics")
        .to_string();
    let fds_at_start = open_fds(pid).unwrap();
    eprintln!("node-a: {fds_at_start} open files at start, holding {BLOBS} blobs");
    assert_eq!(metric(&admin, "dray_agent_store_blobs"), BLOBS as f64);
    assert_eq!(metric(&admin, "dray_agent_store_open_blobs"), 0.0);

    // node-b finds node-a holding the most recently used blob; the least
    // recently used ones are left out of node-a's announce, and it says so.
    let b_identity = Identity::load(
        &node("node-b", "agent.crt"),
        &node("node-b", "agent.key"),
        &node("node-b", "ca.crt"),
    )
    .unwrap();
    let client = TrackerClient::new(vec![tracker_url.clone()], &b_identity);
    let newest = &maps[BLOBS - 1];
    let deadline = Instant::now() + Duration::from_secs(15);
    while !holders_named(&client, &tracker_url, newest)
        .await
        .contains(&"node-a".to_string())
    {
        assert!(
            Instant::now() < deadline,
            "the tracker never named node-a as a holder of the newest blob; node-a's log:\n{}",
            std::fs::read_to_string(&agent_log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("node-b: the tracker names node-a for blob {BLOBS} of {BLOBS}");
    let last_announced = &maps[BLOBS - TRACKER_MAX_BLOBS];
    assert!(
        holders_named(&client, &tracker_url, last_announced)
            .await
            .contains(&"node-a".to_string()),
        "the {TRACKER_MAX_BLOBS}th most recently used blob is announced"
    );
    let left_out = &maps[BLOBS - TRACKER_MAX_BLOBS - 1];
    assert!(
        !holders_named(&client, &tracker_url, left_out)
            .await
            .contains(&"node-a".to_string()),
        "the blob just past the limit is left out"
    );
    let log = std::fs::read_to_string(&agent_log).unwrap();
    let told = format!(
        "the tracker is not told of {} of them",
        BLOBS - TRACKER_MAX_BLOBS
    );
    assert!(log.contains(&told), "node-a's log says {told:?}:\n{log}");
    assert!(!log.contains("announce failed"), "{log}");

    // A peer reads the first chunk of 300 blobs, each closed until asked for.
    let b_node = PeerNode::bind(
        b_identity,
        std::sync::Arc::new(ChunkStore::open(&node("node-b", "state")).unwrap()),
        "127.0.0.1:0".parse().unwrap(),
        PeerConfig::default(),
    )
    .unwrap();
    let link = b_node.connect("node-a", peer_addr).await.unwrap();
    let mut most_fds = 0;
    let mut most_open = 0.0f64;
    let reading = Instant::now();
    for (i, map) in maps.iter().take(READ_BLOBS).enumerate() {
        let chunk = b_node.fetch_chunk(&link, map, 0).await.unwrap();
        map.verify_chunk(0, &chunk).unwrap();
        assert_eq!(chunk, blob_bytes(i));
        most_fds = most_fds.max(open_fds(pid).unwrap());
        if i % 20 == 19 {
            most_open = most_open.max(metric(&admin, "dray_agent_store_open_blobs"));
        }
    }
    eprintln!(
        "node-b: read {READ_BLOBS} blobs from node-a in {:?}; node-a had at most {most_fds} open files ({fds_at_start} at start) and at most {most_open} blobs open",
        reading.elapsed()
    );
    // The idle ones, and the one whose upload may still be finishing.
    assert!(
        most_open <= (MAX_OPEN_IDLE + 1) as f64,
        "{most_open} blobs open, more than max_open_idle_blobs = {MAX_OPEN_IDLE} and one in use"
    );
    // Besides the idle blobs: the connection's sockets, sled's files, slack.
    assert!(
        most_fds <= fds_at_start + MAX_OPEN_IDLE + 8,
        "node-a had {most_fds} open files reading {READ_BLOBS} blobs ({fds_at_start} at start)"
    );
    assert_eq!(metric(&admin, "dray_agent_store_blobs"), BLOBS as f64);
    drop(agent);
}
