//! A certificate holder flooding a real `dray tracker` process with the
//! costliest requests it may send (the largest blobs allowed, many digests,
//! full maps, another node's id) for 30 s: the tracker's peak RSS stays under
//! 256 MiB, `/healthz` keeps answering within 100 ms, and honest agents pulling
//! through the same tracker meanwhile complete.

mod common;

use common::*;
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::identity::ClusterCa;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{Bitfield, BlobDigest, ChunkMap};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The documented bound on the tracker's peak RSS under this flood.
const RSS_BOUND: u64 = 256 << 20;
const FLOOD: Duration = Duration::from_secs(30);

fn dray(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "dray {args:?}: {out:?}");
}

struct TrackerProcess(Child);

impl Drop for TrackerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The costliest announce within one frame: as many of the largest blobs
/// allowed (262144 chunks each, a full 32 KiB bitfield) as fit in 4 MiB,
/// each a new digest.
fn huge_announce(round: u64) -> Body {
    let chunks = 1u32 << 18;
    let all = {
        let mut b = Bitfield::new(chunks);
        for i in 0..chunks {
            b.set(i);
        }
        b
    };
    Body::Announce(pb::Announce {
        peer_id: String::new(),
        address: "127.0.0.1:1".into(),
        full: true,
        blobs: (0..120u64)
            .map(|i| pb::BlobHolding {
                digest: BlobDigest::of(&(round * 1000 + i).to_be_bytes()).to_string(),
                size: u64::from(chunks) << 22,
                chunk_size: 4 << 20,
                bits: all.as_bytes().to_vec().into(),
                wanted: true,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
}

/// A full map of the largest blob the frame allows, hashes included.
fn huge_map(round: u64) -> Body {
    let d = BlobDigest::of(&round.to_be_bytes());
    let mut map = ChunkMap::unhashed(d, 110_000u64 << 22, 4 << 20).unwrap();
    for i in 0..map.chunk_count() {
        map.set_hash(i, [i as u8; 32]).unwrap();
    }
    Body::Publish(pb::PublishChunkMap {
        peer_id: String::new(),
        map: Some(map.to_pb()),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_the_costliest_requests_leaves_the_tracker_bounded_and_answering() {
    init_logs();
    let dir = tempfile::tempdir().unwrap();
    let ca_dir = dir.path().join("ca");
    let tls = dir.path().join("tracker-tls");
    dray(&["ca", "init", "--dir", ca_dir.to_str().unwrap()]);
    dray(&[
        "ca",
        "issue",
        "--ca-dir",
        ca_dir.to_str().unwrap(),
        "--tracker",
        "--name",
        "localhost",
        "--name",
        "127.0.0.1",
        "--out",
        tls.to_str().unwrap(),
    ]);
    let ca = ClusterCa::load(&ca_dir.join("ca.crt"), &ca_dir.join("ca.key")).unwrap();
    let port = free_port();
    let file = |f: &str| tls.join(f).to_str().unwrap().to_owned();
    let child = Command::new(env!("CARGO_BIN_EXE_dray"))
        .args(["tracker", "--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--cert",
            &file("tracker.crt"),
            "--key",
            &file("tracker.key"),
        ])
        .args(["--ca", &file("ca.crt")])
        .env("DRAY_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let _tracker = TrackerProcess(child);
    let url = format!("https://127.0.0.1:{port}");
    wait_for_port(port);

    // Probes: /healthz every 100 ms, anonymous (as the kubelet's).
    dray_agent::pull::registry::install_crypto_provider();
    let probe = reqwest::Client::builder()
        .danger_accept_invalid_certs(true)
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let slowest_ms = Arc::new(AtomicU64::new(0));
    let probes = {
        let (stop, slowest_ms, url) = (stop.clone(), slowest_ms.clone(), url.clone());
        tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) && n < 1_000 {
                let started = Instant::now();
                let ok = probe
                    .get(format!("{url}/healthz"))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                let ms = if ok {
                    started.elapsed().as_millis() as u64
                } else {
                    u64::MAX
                };
                slowest_ms.fetch_max(ms, Ordering::Relaxed);
                n += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // The flood: two connections of the costliest announces and maps, and
    // announces under another node's id, for 30 s (a bounded count too).
    let flooder = Arc::new(TrackerClient::new(
        vec![url.clone()],
        &ca.issue("flooder").unwrap(),
    ));
    let sent = Arc::new(AtomicU64::new(0));
    let floods: Vec<_> = (0..2u64)
        .map(|lane| {
            let (flooder, url, sent) = (flooder.clone(), url.clone(), sent.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let mut round = lane * 1_000_000;
                while started.elapsed() < FLOOD && round < lane * 1_000_000 + 100_000 {
                    let body = match round % 3 {
                        0 => huge_announce(round),
                        1 => huge_map(round),
                        _ => Body::Announce(pb::Announce {
                            peer_id: format!("victim-{round}"),
                            ..Default::default()
                        }),
                    };
                    let _ = flooder.send(&url, body).await;
                    sent.fetch_add(1, Ordering::Relaxed);
                    round += 1;
                }
            })
        })
        .collect();

    // Honest agents pull a blob through the same tracker meanwhile.
    let registry = Registry::start(None).await;
    let src = dir.path().join("blob");
    random_file(&src, 32 << 20);
    let digest = registry.push("test/flood", &src);
    let agents: Vec<Agent> = (0..3)
        .map(|i| {
            Agent::start(
                &ca,
                &format!("honest-{i}"),
                dir.path(),
                quick_swarm(vec![url.clone()]),
                Default::default(),
            )
        })
        .collect();
    let client = registry_client(&registry.url(), None);
    let d: BlobDigest = digest.parse().unwrap();
    let pulls: Vec<_> = agents
        .iter()
        .map(|a| {
            let (swarm, client) = (a.swarm.clone(), client.clone());
            tokio::spawn(async move { swarm.pull(&client, "test/flood", d).await })
        })
        .collect();
    for p in pulls {
        tokio::time::timeout(Duration::from_secs(120), p)
            .await
            .expect("an honest pull completes during the flood")
            .unwrap()
            .unwrap();
    }
    for a in &agents {
        assert_eq!(file_digest(&a.blob_path(&digest)), digest);
    }
    for f in floods {
        f.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    probes.await.unwrap();

    let rss = peak_rss(&pid.to_string());
    let slowest = slowest_ms.load(Ordering::Relaxed);
    eprintln!(
        "flood: {} requests in 30 s; tracker peak RSS {} MiB; slowest /healthz {slowest} ms",
        sent.load(Ordering::Relaxed),
        rss >> 20
    );
    assert!(rss <= RSS_BOUND, "peak RSS {} MiB", rss >> 20);
    assert!(slowest <= 100, "/healthz took {slowest} ms at worst");
}

fn wait_for_port(port: u16) {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("dray tracker did not listen on {port}");
}
