//! Issue 2 acceptance: agents exchanging verified blobs over mutual-TLS QUIC on
//! loopback, with real files, real sled logs and real processes.

mod common;

use common::{file_digest, random_file};
use dray_agent::identity::{ClusterCa, Identity};
use dray_agent::peer::{PeerConfig, PeerNode};
use dray_agent::pull::fetch::{PeerAddr, Transfer, fetch_from_peers};
use dray_agent::store::ChunkStore;
use dray_protocol::chunkmap::MIN_CHUNK_SIZE;
use dray_protocol::{ChunkMap, DEFAULT_CHUNK_SIZE};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

fn node(ca: &ClusterCa, id: &str, dir: &Path) -> Arc<PeerNode> {
    node_with(ca, id, dir, PeerConfig::default())
}

fn node_with(ca: &ClusterCa, id: &str, dir: &Path, config: PeerConfig) -> Arc<PeerNode> {
    let store = Arc::new(ChunkStore::open(&dir.join(id)).unwrap());
    PeerNode::bind(
        ca.issue(id).unwrap(),
        store,
        "127.0.0.1:0".parse().unwrap(),
        config,
    )
    .unwrap()
}

/// Chunk bytes a node has sent to peers, from its metrics.
fn uploaded(node: &PeerNode) -> u64 {
    let text = node.metrics().encode();
    text.lines()
        .find_map(|l| l.strip_prefix("dray_agent_uploaded_bytes_total "))
        .unwrap_or_else(|| panic!("no upload counter in {text}"))
        .parse()
        .unwrap()
}

fn addr(node: &PeerNode) -> PeerAddr {
    PeerAddr {
        peer_id: node.peer_id().into(),
        addr: node.local_addr().unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_exchange_a_1gib_blob_byte_identical_and_digest_verified() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    random_file(&src, 1 << 30);
    let want = file_digest(&src);
    let ca = ClusterCa::generate().unwrap();
    let a = node(&ca, "node-a", dir.path());
    let map = a.store().import(&src, DEFAULT_CHUNK_SIZE).unwrap();
    assert_eq!(map.digest().to_string(), want);
    let b = node(&ca, "node-b", dir.path());

    let report = fetch_from_peers(&b, &map, &[addr(&a)]).await.unwrap();

    assert_eq!(
        report.chunks_by_peer.get("node-a"),
        Some(&map.chunk_count())
    );
    assert_eq!(report.bytes_received, 1 << 30);
    let blob = b.store().get(&map.digest()).unwrap().unwrap();
    assert!(blob.is_complete());
    assert_eq!(file_digest(blob.path()), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_is_caught_refetched_from_an_honest_peer_and_never_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    random_file(&src, 64 << 20);
    let want = file_digest(&src);
    let ca = ClusterCa::generate().unwrap();
    let honest = node(&ca, "honest", dir.path());
    let map = honest.store().import(&src, DEFAULT_CHUNK_SIZE).unwrap();
    let liar = node(&ca, "liar", dir.path());
    liar.store().import(&src, DEFAULT_CHUNK_SIZE).unwrap();
    // Rot one byte in every chunk of the liar's copy on disk: it still believes
    // it holds verified chunks and serves them. The byte is flipped, not
    // overwritten, so no chunk can stay intact by chance.
    let liar_blob = liar.store().get(&map.digest()).unwrap().unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(liar_blob.path())
        .unwrap();
    for i in 0..map.chunk_count() {
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, map.offset(i) + 100).unwrap();
        file.write_all_at(&[!byte[0]], map.offset(i) + 100).unwrap();
    }
    let b_dir = dir.path().join("b");
    let b = node(&ca, "b", &b_dir);

    let report = fetch_from_peers(&b, &map, &[addr(&liar), addr(&honest)])
        .await
        .unwrap();

    assert!(report.bad_peers.contains_key("liar"), "{report:?}");
    assert_eq!(
        report.chunks_by_peer.get("liar"),
        None,
        "no chunk from the liar was accepted"
    );
    assert_eq!(
        report.chunks_by_peer.get("honest"),
        Some(&map.chunk_count())
    );
    let blob = b.store().get(&map.digest()).unwrap().unwrap();
    assert_eq!(file_digest(blob.path()), want);
    // What the log recorded re-verifies from disk after a restart. The closed
    // endpoint's tasks release the store (and sled's file lock) asynchronously.
    b.close();
    drop((blob, b));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let reopened = loop {
        match ChunkStore::open(&b_dir.join("b")) {
            Ok(s) => break s,
            Err(e) if std::time::Instant::now() < deadline && e.to_string().contains("lock") => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(reopened.get(&map.digest()).unwrap().unwrap().is_complete());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swarm_transfer_hears_of_a_peers_new_chunks_and_of_hashes_learned_later() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    random_file(&src, 4 * u64::from(MIN_CHUNK_SIZE));
    let bytes = std::fs::read(&src).unwrap();
    let chunk = |i: usize| &bytes[i * MIN_CHUNK_SIZE as usize..(i + 1) * MIN_CHUNK_SIZE as usize];
    let full = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
    let ca = ClusterCa::generate().unwrap();
    let a = node(&ca, "seed", dir.path());
    let a_blob = a.store().blob(&full).unwrap();
    a_blob.put_chunk(0, chunk(0)).unwrap();
    // The downloader knows every hash but the last one's.
    let mut hashes = full.hashes().to_vec();
    hashes[3] = None;
    let partial = ChunkMap::partial(full.digest(), full.size(), full.chunk_size(), hashes).unwrap();
    let b = node(&ca, "leech", dir.path());
    let t = Transfer::start(&b, &partial, true).await.unwrap();
    let mut progress = t.blob().subscribe();
    let within = |secs| Duration::from_secs(secs);
    t.add_peer(addr(&a));
    tokio::time::timeout(within(10), progress.wait_for(|p| p.held == 1))
        .await
        .expect("chunk 0 arrives")
        .unwrap();

    // The seed gains the other chunks long after the leech first asked.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let landed = tokio::time::Instant::now();
    for i in 1..4 {
        a_blob.put_chunk(i, chunk(i as usize)).unwrap();
    }
    tokio::time::timeout(within(10), progress.wait_for(|p| p.held == 3))
        .await
        .expect("chunks 1 and 2 arrive")
        .unwrap();
    let heard = landed.elapsed();
    // The long poll answered when they landed; with no news the lanes would
    // only look again after their 1 s safety net.
    assert!(heard < Duration::from_millis(900), "took {heard:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !t.blob().has(3),
        "chunk 3 cannot be checked yet, so is not fetched"
    );

    // Its hash is learned: the seed's last bitfield now offers it, with no new ask.
    t.blob().learn(&full).unwrap();
    t.nudge();
    tokio::time::timeout(within(10), progress.wait_for(|p| p.complete))
        .await
        .expect("the hash learned late makes chunk 3 fetchable")
        .unwrap();
    let report = t.finish().await.unwrap();
    assert_eq!(report.chunks_by_peer.get("seed"), Some(&4));
    assert_eq!(file_digest(t.blob().path()), full.digest().to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_swarm_transfer_retires_its_oldest_peer_after_the_chunks_it_is_sending() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let (chunks, chunk_size) = (32, 4 * MIN_CHUNK_SIZE);
    random_file(&src, chunks * u64::from(chunk_size));
    let ca = ClusterCa::generate().unwrap();
    // Every seed sends 4 chunks a second, with a burst below one chunk: the
    // first one's first requests are still streaming when the others arrive,
    // and the others need seconds for the rest, so an unretired first seed
    // would be asked again.
    let paced = PeerConfig {
        upload_bytes_per_s: Some(4 * u64::from(chunk_size)),
        ..PeerConfig::default()
    };
    let seeds: Vec<_> = ["first", "second", "third"]
        .iter()
        .map(|id| node_with(&ca, id, dir.path(), paced.clone()))
        .collect();
    let mut map = None;
    for s in &seeds {
        map = Some(s.store().import(&src, chunk_size).unwrap());
    }
    let map = map.unwrap();
    let capped = PeerConfig {
        max_peers_per_blob: 2,
        ..PeerConfig::default()
    };
    let b = node_with(&ca, "leech", dir.path(), capped);
    let t = Transfer::start(&b, &map, true).await.unwrap();
    let mut progress = t.blob().subscribe();
    let first = &seeds[0];

    t.add_peer(addr(first));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !(t.in_flight() == 4 && first.active_uploads() == 4) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first seed never got 4 requests"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Normally none yet; a lane that started late may have let one finish.
    let sent = t.report().chunks_by_peer.get("first").copied().unwrap_or(0);
    t.add_peer(addr(&seeds[1]));
    t.add_peer(addr(&seeds[2]));
    // Named again while it finishes its chunks: ignored, not a new peer.
    t.add_peer(addr(first));

    tokio::time::timeout(Duration::from_secs(60), progress.wait_for(|p| p.complete))
        .await
        .expect("the blob completes from the other two")
        .unwrap();
    // The lane that stored the last chunk settles it a moment later.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while t.in_flight() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} chunks left in flight",
            t.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = t.finish().await.unwrap();
    // The 4 chunks it was sending when retired were stored, and it was asked
    // for nothing more: every byte it sent is in a stored chunk.
    let from = |id: &str| report.chunks_by_peer.get(id).copied().unwrap_or(0);
    assert_eq!(from("first"), sent + 4, "{report:?}");
    assert_eq!(
        uploaded(first),
        u64::from(from("first")) * u64::from(chunk_size)
    );
    assert_eq!(first.active_uploads(), 0);
    assert_eq!(
        from("second") + from("third"),
        chunks as u32 - from("first")
    );
    assert!(from("second") > 0 && from("third") > 0, "{report:?}");
    assert_eq!(file_digest(t.blob().path()), map.digest().to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_certificate_the_cluster_does_not_trust_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ClusterCa::generate().unwrap();
    let other = ClusterCa::generate().unwrap();
    let a = node(&cluster, "node-a", dir.path());
    let store = |n: &str| Arc::new(ChunkStore::open(&dir.path().join(n)).unwrap());
    let any = "127.0.0.1:0".parse().unwrap();

    // An outsider with a certificate from another CA, which trusts the cluster CA:
    // node-a refuses its client certificate.
    let outsider_id = other.issue("outsider").unwrap();
    let outsider_id = Identity::from_pem(
        &outsider_id.cert_pem(),
        &outsider_id.key_pem(),
        &cluster.cert_pem,
    )
    .unwrap();
    let outsider =
        PeerNode::bind(outsider_id, store("outsider"), any, PeerConfig::default()).unwrap();
    let err = outsider
        .connect("node-a", a.local_addr().unwrap())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("node-a") && err.to_lowercase().contains("cert"),
        "{err}"
    );

    // A node of another cluster dialling ours refuses node-a's server certificate.
    let stranger = PeerNode::bind(
        other.issue("stranger").unwrap(),
        store("stranger"),
        any,
        PeerConfig::default(),
    )
    .unwrap();
    let err = stranger
        .connect("node-a", a.local_addr().unwrap())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );

    // A trusted certificate for another name does not pass for node-a.
    let b = node(&cluster, "node-b", dir.path());
    let err = b
        .connect("node-c", a.local_addr().unwrap())
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("certificate not valid for name"), "{err}");

    // And a member of the cluster gets in.
    b.connect("node-a", a.local_addr().unwrap()).await.unwrap();
}

/// The `dray` binary with logs of stored chunks on stderr.
fn dray(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dray"));
    c.args(args)
        .env("DRAY_LOG", "dray_agent::pull::fetch=debug");
    c
}

fn run_ok(c: &mut Command) -> String {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        c,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A cluster CA in `dir/ca` and `node-a`, `node-b` with their certificates
/// and configs (`dir/node-X.toml`) on 127.0.0.1; `node-a` holds a random
/// blob of `size` bytes (`dir/src`), whose chunk map is `dir/map`. Returns
/// the blob's digest.
fn two_nodes_a_holding(dir: &Path, size: u64) -> String {
    let d = |p: &str| dir.join(p).to_str().unwrap().to_string();
    run_ok(&mut dray(&["ca", "init", "--dir", &d("ca")]));
    for id in ["node-a", "node-b"] {
        run_ok(&mut dray(&[
            "ca",
            "issue",
            "--ca-dir",
            &d("ca"),
            "--peer-id",
            id,
            "--out",
            &d(id),
        ]));
        let cfg = format!(
            "state_dir = {:?}\npeer_listen = \"127.0.0.1:0\"\ncert = {:?}\nkey = {:?}\nca = {:?}\nadmin_listen = \"127.0.0.1:0\"\n[local_api]\nsocket = {:?}\n[mirror]\nlisten = \"127.0.0.1:0\"\n",
            d(&format!("{id}/state")),
            d(&format!("{id}/agent.crt")),
            d(&format!("{id}/agent.key")),
            d(&format!("{id}/ca.crt")),
            d(&format!("{id}/agent.sock")),
        );
        std::fs::write(dir.join(format!("{id}.toml")), cfg).unwrap();
    }
    let src = dir.join("src");
    random_file(&src, size);
    let import = ["blob", "import", "-c", &d("node-a.toml"), &d("src")];
    run_ok(dray(&import).args(["--map-out", &d("map")]));
    file_digest(&src)
}

/// Starts `dray ARGS` (an agent) and returns it with the peer address its
/// first line names.
fn serving(args: &[&str]) -> (std::process::Child, String) {
    let mut a = dray(args).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(a.stderr.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let addr = line
        .split("serving peers on ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("the agent names its peer address: {line}"))
        .to_string();
    (a, addr)
}

/// The blob `want` in `node`'s store, by its digest.
fn held_digest(dir: &Path, node: &str, want: &str) -> String {
    file_digest(
        &dir.join(node)
            .join("state/blobs")
            .join(want.trim_start_matches("sha256:")),
    )
}

#[test]
fn a_receiver_killed_halfway_resumes_fetching_only_the_missing_chunks_plus_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).to_str().unwrap().to_string();
    let want = two_nodes_a_holding(dir.path(), 256 << 20);
    let chunks = 64;

    let (mut a, a_addr) = serving(&["agent", "-c", &d("node-a.toml")]);
    let peer = format!("node-a@{a_addr}");

    // 256 MiB at 64 MiB/s: about four seconds; kill -9 after two.
    let log = std::fs::File::create(dir.path().join("b1.log")).unwrap();
    let mut b = dray(&[
        "blob",
        "fetch",
        "-c",
        &d("node-b.toml"),
        "--map",
        &d("map"),
        "--peer",
        &peer,
    ])
    .args(["--download-bytes-per-s", &(64u64 << 20).to_string()])
    .stderr(log)
    .spawn()
    .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        b.try_wait().unwrap().is_none(),
        "the fetch finished before it could be killed"
    );
    b.kill().unwrap(); // SIGKILL
    b.wait().unwrap();
    let stored_before = std::fs::read_to_string(dir.path().join("b1.log"))
        .unwrap()
        .matches("chunk stored")
        .count();
    assert!(
        stored_before > 0 && stored_before < chunks,
        "stored {stored_before} of {chunks} before the kill"
    );

    let out = run_ok(&mut dray(&[
        "blob",
        "fetch",
        "-c",
        &d("node-b.toml"),
        "--map",
        &d("map"),
        "--peer",
        &peer,
    ]));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let resumed = report["resumed_chunks"].as_u64().unwrap() as usize;
    let fetched = report["chunks_by_peer"]["node-a"].as_u64().unwrap_or(0) as usize;
    assert_eq!(resumed + fetched, chunks, "{report}");
    assert!(
        fetched <= chunks - stored_before + 1,
        "fetched {fetched} after {stored_before} stored of {chunks}"
    );
    assert_eq!(held_digest(dir.path(), "node-b", &want), want);
    a.kill().unwrap();
    a.wait().unwrap();
}

/// `--peer-listen=$(NODE_IP):7881` in the chart expands on an IPv6 node to
/// an address without brackets: the agent takes it, and a peer fetches a
/// blob from it over IPv6 (loopback `::1`).
#[test]
fn an_agent_given_an_ipv6_address_without_brackets_serves_peers_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).to_str().unwrap().to_string();
    let want = two_nodes_a_holding(dir.path(), 16 << 20);

    let (mut a, addr) = serving(&["agent", "-c", &d("node-a.toml"), "--peer-listen", "::1:0"]);
    assert!(addr.starts_with("[::1]:"), "serving on {addr}");
    let fetch = ["blob", "fetch", "-c", &d("node-b.toml"), "--map", &d("map")];
    let peer = format!("node-a@{addr}");
    run_ok(dray(&fetch).args(["--peer", &peer, "--peer-listen", "::1:0"]));
    assert_eq!(held_digest(dir.path(), "node-b", &want), want);
    a.kill().unwrap();
    a.wait().unwrap();
}
