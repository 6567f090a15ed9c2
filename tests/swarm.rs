//! Issue 3 acceptance: a tracker-scheduled swarm pulling from the real
//! distribution registry, with registry egress counted by a relay in front of
//! the registry (never from the agents' own claims).

mod common;

use common::*;
use dray_agent::identity::ClusterCa;
use dray_agent::peer::PeerConfig;
use dray_agent::pull::swarm::PullReport;
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{BlobDigest, ChunkMap, DEFAULT_CHUNK_SIZE};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every agent pulls the blob at once; each completes (in the order they
/// finished).
async fn pull_all(
    agents: &[Agent],
    registry: &Arc<dray_agent::pull::registry::RegistryClient>,
    repo: &str,
    digest: &str,
) -> Vec<PullReport> {
    let swarms: Vec<_> = agents.iter().map(|a| a.swarm.clone()).collect();
    dray_testkit::cluster::pull_each(&swarms, registry, repo, digest.parse().unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|(_, outcome)| outcome.expect("pull completes"))
        .collect()
}

fn start_agents(
    ca: &ClusterCa,
    root: &std::path::Path,
    prefix: &str,
    n: usize,
    cfg: dray_agent::pull::swarm::SwarmConfig,
) -> Vec<Agent> {
    (0..n)
        .map(|i| {
            Agent::start(
                ca,
                &format!("{prefix}-{i}"),
                root,
                cfg.clone(),
                PeerConfig::default(),
            )
        })
        .collect()
}

/// Pushes `size` random bytes as a blob of `repo`; returns its digest.
fn push_random(registry: &Registry, dir: &std::path::Path, repo: &str, size: u64) -> String {
    let src = dir.join(format!("blob-{}", repo.replace('/', "-")));
    random_file(&src, size);
    registry.push(repo, &src)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_agents_pull_a_256mib_blob_at_once_and_it_leaves_the_registry_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 256u64 << 20;
    let digest = push_random(&registry, dir.path(), "test/big", size);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let agents: Vec<Agent> =
        start_agents(&ca, dir.path(), "node", 8, quick_swarm(vec![tracker.url()]));

    let reports = pull_all(
        &agents,
        &registry_client(&registry.url(), None),
        "test/big",
        &digest,
    )
    .await;

    assert_identical(&agents, &digest);
    let ratio = registry.egress() as f64 / size as f64;
    let from_registry: u64 = reports.iter().map(|r| r.bytes_from_registry).sum();
    let slowest = reports.iter().map(|r| r.seconds).fold(0.0, f64::max);
    eprintln!(
        "registry egress {ratio:.3}x the blob; agents claim {from_registry} bytes from it; slowest {slowest:.1} s"
    );
    assert!(ratio <= 1.10, "registry served {ratio:.3}x the blob");
    assert!(reports.iter().all(|r| !r.fell_back), "{reports:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_completes_when_the_tracker_dies_mid_pull_and_a_restart_recovers_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let digest = push_random(&registry, dir.path(), "test/t", 64 << 20);
    registry.throttle(24 << 20);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let addr = tracker.addr.to_string();
    let ca = cluster_ca();
    let agents: Vec<Agent> =
        start_agents(&ca, dir.path(), "node", 4, quick_swarm(vec![tracker.url()]));
    let client = registry_client(&registry.url(), None);
    let pulls = {
        let agents_pull = pull_all(&agents, &client, "test/t", &digest);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            tracker.kill();
            tracker
        });
        agents_pull.await
    };
    assert_identical(&agents, &digest);
    assert!(
        pulls.iter().any(|r| r.fell_back),
        "the tracker died before anyone finished: {pulls:?}"
    );

    // A new tracker on the same address learns everything from re-announces
    // at once (the agents' idle interval is 300 ms; the
    // first delta is answered with resend_full, then comes the full announce).
    let d: BlobDigest = digest.parse().unwrap();
    let restarted = serve_tracker(&quick_tracker(), &addr).await;
    let started = Instant::now();
    while restarted.tracker.holders(&d, 0) < 4 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered = started.elapsed();
    assert_eq!(restarted.tracker.peer_count(), 4);
    assert_eq!(restarted.tracker.holders(&d, 15), 4);
    eprintln!("tracker state recovered in {recovered:?}");
    // Without resend_full the deltas would never teach it (the loop above
    // gives up at 5 s); a few idle intervals of slack keep a busy machine
    // from failing it.
    assert!(
        recovered <= Duration::from_secs(3),
        "recovered in {recovered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tracker_restarted_mid_pull_relearns_partial_holders_hashes_and_ends_the_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 64u64 << 20;
    let chunks = (size / u64::from(DEFAULT_CHUNK_SIZE)) as u32;
    let digest = push_random(&registry, dir.path(), "test/restart", size);
    // One copy takes the registry 8 s: nobody is complete when the tracker returns.
    registry.throttle(8 << 20);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let addr = tracker.addr.to_string();
    let ca = cluster_ca();
    let agents = start_agents(&ca, dir.path(), "node", 4, quick_swarm(vec![tracker.url()]));
    let client = registry_client(&registry.url(), None);
    let d: BlobDigest = digest.parse().unwrap();
    let outage = async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        tracker.kill();
        // Past the agents' 1.5 s grace: they fetch what no peer holds themselves.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let restarted = serve_tracker(&quick_tracker(), &addr).await;
        // The full announces bring back the holders and, from partial
        // holders too, the hashes without which nobody else could verify
        // what they hold: a hash no registry run of this tracker vouches
        // for is taken once two holders publish it.
        let started = Instant::now();
        loop {
            let map = restarted.tracker.map(&d);
            let held: Vec<u32> = (0..chunks)
                .filter(|&i| restarted.tracker.holders(&d, i) > 0)
                .collect();
            let unvouched: Vec<u32> = held
                .iter()
                .copied()
                .filter(|&i| {
                    restarted.tracker.holders(&d, i) >= 2
                        && map
                            .as_ref()
                            .is_none_or(|m| m.hashes()[i as usize].is_none())
                })
                .collect();
            if restarted.tracker.peer_count() == 4 && !held.is_empty() && unvouched.is_empty() {
                assert!(held.len() < chunks as usize, "someone completed already");
                eprintln!(
                    "restarted tracker vouches for all {} held chunks after {:?}",
                    held.len(),
                    started.elapsed()
                );
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "the restarted tracker has no hash for held chunks {unvouched:?} (held: {held:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        restarted
    };
    let (reports, _restarted) =
        tokio::join!(pull_all(&agents, &client, "test/restart", &digest), outage);
    assert_identical(&agents, &digest);
    assert!(reports.iter().any(|r| r.fell_back), "{reports:?}");
    // The fallback took only what no peer had, and stopped when the tracker
    // answered: not every node fetching every unclaimed chunk to the end.
    // A chunk only one node held when the tracker restarted has no hash
    // until a second node publishes the same (issue 16: one node cannot
    // vouch alone), so some are fetched again: 1.92x measured, was < 1.8x.
    let ratio = registry.egress() as f64 / size as f64;
    eprintln!("registry egress {ratio:.2}x the blob");
    assert!(
        ratio < 2.2,
        "registry served {ratio:.2}x the blob: {reports:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_holding_registry_assignments_loses_them_and_the_others_complete() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 64u64 << 20;
    let digest = push_random(&registry, dir.path(), "test/k", size);
    // 16 MiB/s from the registry: the victim cannot finish its runs before it dies.
    registry.throttle(16 << 20);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let mut cfg = quick_swarm(vec![tracker.url()]);
    cfg.stall = Duration::from_secs(30); // prove reassignment, not the stall fallback
    let victim = Agent::start(
        &ca,
        "victim",
        dir.path(),
        cfg.clone(),
        PeerConfig::default(),
    );
    let client = registry_client(&registry.url(), None);
    let d: BlobDigest = digest.parse().unwrap();
    let victim_pull = {
        let (swarm, client) = (victim.swarm.clone(), client.clone());
        tokio::spawn(async move { swarm.pull(&client, "test/k", d).await })
    };
    // Let the victim take its assignments, then kill it.
    let started = Instant::now();
    while tracker.tracker.peer_count() < 1 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim_pull.abort();
    victim.kill();
    let others: Vec<Agent> = start_agents(&ca, dir.path(), "node", 3, cfg.clone());
    registry.throttle(0);

    let reports = pull_all(&others, &client, "test/k", &digest).await;

    assert_identical(&others, &digest);
    assert!(reports.iter().all(|r| !r.fell_back), "{reports:?}");
    let ratio = registry.egress() as f64 / size as f64;
    eprintln!("registry egress {ratio:.3}x including what the victim fetched before it died");
    assert!(ratio <= 1.25, "registry served {ratio:.3}x the blob");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_repository_needs_credentials_and_refuses_anonymous_agents_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(Some(("alice", "s3cret"))).await;
    let digest = push_random(&registry, dir.path(), "private/p", 16 << 20);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let agents: Vec<Agent> =
        start_agents(&ca, dir.path(), "node", 2, quick_swarm(vec![tracker.url()]));

    pull_all(
        &agents,
        &registry_client(&registry.url(), Some(("alice", "s3cret"))),
        "private/p",
        &digest,
    )
    .await;
    assert_identical(&agents, &digest);

    let anonymous = Agent::start(
        &ca,
        "anon",
        dir.path(),
        quick_swarm(vec![tracker.url()]),
        PeerConfig::default(),
    );
    let err = anonymous
        .swarm
        .pull(
            &registry_client(&registry.url(), None),
            "private/p",
            digest.parse().unwrap(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("refused access to private/p") && err.contains("requires credentials"),
        "{err}"
    );
    let wrong = anonymous
        .swarm
        .pull(
            &registry_client(&registry.url(), Some(("alice", "nope"))),
            "private/p",
            digest.parse().unwrap(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        wrong.contains("credentials of \"alice\" were not accepted"),
        "{wrong}"
    );
    assert!(
        !anonymous.blob_path(&digest).exists(),
        "nothing of the private blob reached the anonymous agent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tracker_replicas_split_the_blobs_and_a_dead_one_hands_its_blobs_to_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let a = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let b = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let replicas = vec![a.url(), b.url()];
    // Ownership hashes digests with the replicas' (random) addresses: push
    // blobs until each replica owns at least two.
    let owners = dray_agent::discovery::tracker_client::TrackerClient::new(
        replicas.clone(),
        &cluster_ca().issue("owners").unwrap(),
    );
    let mut digests = Vec::new();
    for i in 0..40 {
        let owned_by = |r: &str| {
            digests
                .iter()
                .filter(|d: &&String| owners.order(&d.parse().unwrap())[0] == r)
                .count()
        };
        if owned_by(&replicas[0]) >= 2 && owned_by(&replicas[1]) >= 2 {
            break;
        }
        let src = dir.path().join(format!("blob{i}"));
        random_file(&src, 8 << 20);
        digests.push(registry.push("test/r", &src));
    }
    let ca = cluster_ca();
    let client = registry_client(&registry.url(), None);
    let first: Vec<Agent> =
        start_agents(&ca, dir.path(), "first", 2, quick_swarm(replicas.clone()));
    for d in &digests {
        pull_all(&first, &client, "test/r", d).await;
    }
    let parsed: Vec<BlobDigest> = digests.iter().map(|d| d.parse().unwrap()).collect();
    let on_a: Vec<&BlobDigest> = parsed
        .iter()
        .filter(|d| a.tracker.map(d).is_some())
        .collect();
    let on_b: Vec<&BlobDigest> = parsed
        .iter()
        .filter(|d| b.tracker.map(d).is_some())
        .collect();
    assert!(
        !on_a.is_empty() && !on_b.is_empty(),
        "both replicas own blobs: a {on_a:?}, b {on_b:?}"
    );
    assert_eq!(
        on_a.len() + on_b.len(),
        parsed.len(),
        "each blob has exactly one owner"
    );

    a.kill();
    let second: Vec<Agent> =
        start_agents(&ca, dir.path(), "second", 2, quick_swarm(replicas.clone()));
    for d in &on_a {
        let reports = pull_all(&second, &client, "test/r", &d.to_string()).await;
        assert!(reports.iter().all(|r| !r.fell_back), "{reports:?}");
        assert!(
            b.tracker.map(d).is_some(),
            "{d} moved to the surviving replica"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_map_forged_by_a_node_that_fetched_none_of_it_never_reaches_honest_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 32u64 << 20;
    let digest = push_random(&registry, dir.path(), "test/w", size);
    let d: BlobDigest = digest.parse().unwrap();
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();

    // A liar holds every chunk but the last, with chunk 2 forged, and publishes
    // a map whose hash for chunk 2 matches the forgery.
    let original = std::fs::read(dir.path().join("blob-test-w")).unwrap();
    let mut forged = original.clone();
    forged[2 * DEFAULT_CHUNK_SIZE as usize + 99] ^= 0xff;
    let real = ChunkMap::of_bytes(&original, DEFAULT_CHUNK_SIZE).unwrap();
    let lie = ChunkMap::of_bytes(&forged, DEFAULT_CHUNK_SIZE).unwrap();
    let lie = ChunkMap::new(
        d,
        size,
        DEFAULT_CHUNK_SIZE,
        lie.hashes().iter().map(|h| h.unwrap()).collect(),
    )
    .unwrap();
    assert_ne!(lie, real);
    let liar = Agent::start(
        &ca,
        "liar",
        dir.path(),
        quick_swarm(vec![tracker.url()]),
        PeerConfig::default(),
    );
    let blob = liar.swarm.node().store().blob(&lie).unwrap();
    for i in 0..lie.chunk_count() - 1 {
        let at = lie.offset(i) as usize;
        blob.put_chunk(i, &forged[at..at + lie.chunk_len(i)])
            .unwrap();
    }
    // A map is taken only for a blob some node announced.
    while tracker.tracker.holders(&d, 2) < 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let publish = pb::TrackerRequest {
        body: Some(Body::Publish(pb::PublishChunkMap {
            peer_id: "liar".into(),
            map: Some(lie.to_pb()),
        })),
    };
    assert!(
        tracker
            .tracker
            .handle(publish, Some("liar"), Instant::now())
            .unwrap()
            .is_none()
    );

    let honest: Vec<Agent> =
        start_agents(&ca, dir.path(), "node", 2, quick_swarm(vec![tracker.url()]));
    let reports = pull_all(
        &honest,
        &registry_client(&registry.url(), None),
        "test/w",
        &digest,
    )
    .await;

    assert_identical(&honest, &digest);
    // The liar was no chunk's registry fetcher: its hashes waited for a
    // second node to agree, the forged one never did, and no honest pull met
    // a wrong map.
    assert!(reports.iter().all(|r| r.map_failures == 0), "{reports:?}");
    assert_no_forged_hash(&tracker.tracker, &real);
}

/// Issue 19, IPv6-only: the tracker and every agent's peer endpoint on
/// `[::1]` (the testbed's registry listens on IPv4 loopback). A storm of 6
/// nodes completes byte-identical, the blob leaving the registry about once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_on_ipv6_addresses_alone_leaves_the_registry_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 96u64 << 20;
    let digest = push_random(&registry, dir.path(), "test/v6", size);
    let tracker = serve_tracker(&quick_tracker(), "[::1]:0").await;
    assert!(
        tracker.url().starts_with("https://[::1]:"),
        "{}",
        tracker.url()
    );
    let ca = cluster_ca();
    let agents: Vec<Agent> = (0..6)
        .map(|i| {
            Agent::start_on(
                &ca,
                &format!("v6-{i}"),
                dir.path(),
                "[::1]:0".parse().unwrap(),
                quick_swarm(vec![tracker.url()]),
                PeerConfig::default(),
            )
        })
        .collect();
    let reports = pull_all(
        &agents,
        &registry_client(&registry.url(), None),
        "test/v6",
        &digest,
    )
    .await;
    assert_identical(&agents, &digest);
    let ratio = registry.egress() as f64 / size as f64;
    let from_peers: u64 = reports.iter().map(|r| r.bytes_from_peers).sum();
    eprintln!("IPv6 storm: registry egress {ratio:.3}x the blob, {from_peers} bytes between peers");
    assert!(ratio <= 1.10, "registry served {ratio:.3}x the blob");
    assert!(from_peers >= 4 * size, "{reports:?}");
    assert_eq!(tracker.tracker.peer_count(), 6);
}

/// Issue 19, dual-stack: a node listening on both stacks (`[::]`) advertises
/// an address of each family, comma-separated in its announce; a node whose
/// endpoint is IPv4 dials the IPv4 one, a node on IPv6 the IPv6 one, and both
/// take the blob from it rather than from the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_node_is_reached_over_each_family_by_the_nodes_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 32u64 << 20;
    let digest = push_random(&registry, dir.path(), "test/dual", size);
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let client = registry_client(&registry.url(), None);
    let mut cfg = quick_swarm(vec![tracker.url()]);
    cfg.advertise = dray_agent::discovery::advertise::parse_list("::1,127.0.0.1").unwrap();
    let seed = Agent::start_on(
        &ca,
        "dual",
        dir.path(),
        "[::]:0".parse().unwrap(),
        cfg,
        PeerConfig::default(),
    );
    let first = pull_all(std::slice::from_ref(&seed), &client, "test/dual", &digest).await;
    assert_eq!(first[0].bytes_from_registry, size);
    for (id, listen) in [("v4", "127.0.0.1:0"), ("v6", "[::1]:0")] {
        let node = Agent::start_on(
            &ca,
            id,
            dir.path(),
            listen.parse().unwrap(),
            quick_swarm(vec![tracker.url()]),
            PeerConfig::default(),
        );
        let report = pull_all(std::slice::from_ref(&node), &client, "test/dual", &digest).await;
        assert_eq!(
            (report[0].bytes_from_peers, report[0].bytes_from_registry),
            (size, 0),
            "the {id} node pulled from the registry, not the dual-stack node: {:?}",
            report[0]
        );
        assert_identical(&[node], &digest);
    }
}
