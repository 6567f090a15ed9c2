//! Issue 16: what a node with a valid cluster certificate can make the swarm
//! do by lying about what it holds, publishing forged hashes and serving
//! forged bytes. Real agents pull from the real distribution registry (its
//! egress counted by the harness's relay, never from the agents' claims)
//! through a real tracker, beside a liar that speaks the real protocol.

mod common;

use common::*;
use dray_agent::peer::PeerConfig;
use dray_protocol::chunkmap::ChunkHash;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{BlobDigest, ChunkMap, DEFAULT_CHUNK_SIZE};
use std::time::{Duration, Instant};

/// A liar holding every chunk of a blob but the last (its store would check
/// the blob's digest on the last), each with one bit flipped, stored under the
/// map of its forgery so that its agent announces and serves them. Returns
/// the forged map.
fn forge_every_chunk(liar: &Agent, original: &[u8], digest: BlobDigest) -> ChunkMap {
    let mut forged = original.to_vec();
    for at in (0..forged.len()).step_by(DEFAULT_CHUNK_SIZE as usize) {
        forged[at + 17] ^= 0x40;
    }
    let hashes = ChunkMap::of_bytes(&forged, DEFAULT_CHUNK_SIZE).unwrap();
    let lie = ChunkMap::new(
        digest,
        forged.len() as u64,
        DEFAULT_CHUNK_SIZE,
        hashes.hashes().iter().map(|h| h.unwrap()).collect(),
    )
    .unwrap();
    let blob = liar.swarm.node().store().blob(&lie).unwrap();
    for i in 0..lie.chunk_count() - 1 {
        let at = lie.offset(i) as usize;
        blob.put_chunk(i, &forged[at..at + lie.chunk_len(i)])
            .unwrap();
    }
    lie
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liar_claiming_every_chunk_with_forged_bytes_and_hashes_neither_corrupts_nor_multiplies_registry_egress()
 {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 64u64 << 20;
    let src = dir.path().join("blob");
    random_file(&src, size);
    let digest = registry.push("test/hostile", &src);
    let d: BlobDigest = digest.parse().unwrap();
    let tracker = TrackerProc::start(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();

    // The liar announces every chunk but one (so that a tracker counting any
    // holder would hand out a single registry run), serves forged bytes, and
    // publishes a forged hash for every chunk before anyone else can: each
    // honest fallback fetcher's hash then meets a forged one.
    let original = std::fs::read(&src).unwrap();
    let liar = Agent::start(
        &ca,
        "liar",
        dir.path(),
        quick_swarm(vec![tracker.url()]),
        PeerConfig::default(),
    );
    let lie = forge_every_chunk(&liar, &original, d);
    let last = lie.chunk_count() - 2;
    let started = Instant::now();
    while tracker.tracker.holders(&d, last) < 1 && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(tracker.tracker.holders(&d, last), 1, "the liar announced");
    let publish = pb::TrackerRequest {
        body: Some(Body::Publish(pb::PublishChunkMap {
            peer_id: "liar".into(),
            map: Some(lie.to_pb()),
        })),
    };
    tracker
        .tracker
        .handle(publish, Some("liar"), Instant::now())
        .expect("a publication the tracker may hold as unconfirmed");

    let honest: Vec<Agent> = (0..6)
        .map(|i| {
            Agent::start(
                &ca,
                &format!("honest-{i}"),
                dir.path(),
                quick_swarm(vec![tracker.url()]),
                PeerConfig::default(),
            )
        })
        .collect();
    let client = registry_client(&registry.url(), None);
    let pulls: Vec<_> = honest
        .iter()
        .map(|a| {
            let (swarm, client) = (a.swarm.clone(), client.clone());
            tokio::spawn(async move { swarm.pull(&client, "test/hostile", d).await })
        })
        .collect();
    let mut reports = Vec::new();
    for p in pulls {
        reports.push(p.await.unwrap().expect("every honest pull completes"));
    }

    for a in &honest {
        assert_eq!(
            file_digest(&a.blob_path(&digest)),
            digest,
            "{} holds a corrupt blob",
            a.dir.display()
        );
    }
    let real = ChunkMap::of_bytes(&original, DEFAULT_CHUNK_SIZE).unwrap();
    let handed_out: Vec<Option<ChunkHash>> = tracker
        .tracker
        .map(&d)
        .map(|m| m.hashes().to_vec())
        .unwrap_or_default();
    for (i, h) in handed_out.iter().enumerate() {
        if h.is_some() {
            assert_eq!(
                *h,
                real.hashes()[i],
                "chunk {i}: a forged hash is handed out"
            );
        }
    }
    let ratio = registry.egress() as f64 / size as f64;
    let slowest = reports.iter().map(|r| r.seconds).fold(0.0, f64::max);
    let fell_back = reports.iter().filter(|r| r.fell_back).count();
    eprintln!(
        "registry egress {ratio:.2}x the blob for 6 honest nodes; slowest {slowest:.1} s; {fell_back} fell back; liar banned: {}",
        tracker.tracker.standing("liar").banned
    );
    // Each chunk leaves the registry about once: the liar's claims stop no
    // registry run and its forged hashes block no honest one.
    assert!(
        ratio <= 1.25,
        "registry served {ratio:.2}x the blob: the liar's claims or hashes kept chunks from being scheduled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_corrupted_on_its_way_from_the_registry_costs_the_storm_one_more_copy_not_one_a_node()
 {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 64u64 << 20;
    let src = dir.path().join("blob");
    random_file(&src, size);
    let digest = registry.push("test/corrupt", &src);
    let d: BlobDigest = digest.parse().unwrap();
    let tracker = TrackerProc::start(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    // One bit of the first chunk body to pass 1 MiB: its fetcher hashes the
    // wrong bytes, publishes that hash as the chunk's registry fetcher, and
    // every node assembles a blob that fails its digest.
    registry.corrupt_once(1 << 20);

    let nodes: Vec<Agent> = (0..8)
        .map(|i| {
            Agent::start(
                &ca,
                &format!("node-{i}"),
                dir.path(),
                quick_swarm(vec![tracker.url()]),
                PeerConfig::default(),
            )
        })
        .collect();
    let client = registry_client(&registry.url(), None);
    let pulls: Vec<_> = nodes
        .iter()
        .map(|a| {
            let (swarm, client) = (a.swarm.clone(), client.clone());
            tokio::spawn(async move { swarm.pull(&client, "test/corrupt", d).await })
        })
        .collect();
    let mut reports = Vec::new();
    for p in pulls {
        reports.push(p.await.unwrap().expect("every pull completes"));
    }

    for a in &nodes {
        assert_eq!(
            file_digest(&a.blob_path(&digest)),
            digest,
            "{} holds a corrupt blob",
            a.dir.display()
        );
    }
    let ratio = registry.egress() as f64 / size as f64;
    let failures: u32 = reports.iter().map(|r| r.map_failures).sum();
    let alone = reports.iter().filter(|r| r.map_failures >= 2).count();
    eprintln!(
        "registry egress {ratio:.2}x the blob for 8 nodes; {failures} wrong maps met; {alone} pulled alone"
    );
    assert!(failures > 0, "the corrupted chunk reached the swarm");
    // The storm starts over once, together: about one more copy, not one
    // per node pulling alone.
    assert!(
        ratio < 2.3,
        "registry served {ratio:.2}x the blob after one digest failure"
    );
}
