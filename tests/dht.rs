//! Issue 19, discovery without a tracker, with `dray agent` processes
//! joined in a Kademlia DHT and the real registry:
//! - 8 agents with no tracker at all pull a 128 MiB blob through their
//!   mirrors at once; the peers are found through the DHT, the
//!   registry-fetch rule among them sends each chunk from the registry
//!   about once, and every copy is byte-identical. A member that joins
//!   afterwards takes the blob from them alone. Then a node whose
//!   certificate another CA signed tries to join: the members refuse its
//!   connections, and its pull finds no peer (it comes from the registry
//!   alone).
//! - 16 agents whose only tracker is killed as their storm starts, side by
//!   side with and without the DHT: with it, most bytes come from peers
//!   found through it and the registry sends at most 2 copies.

mod common;

use common::cluster::*;
use common::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_agents_without_a_tracker_find_each_other_in_the_dht_and_leave_the_registry_about_once()
 {
    const NODES: usize = 8;
    const SIZE: u64 = 128 << 20;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let blob = dir.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/dht", &blob);
    let ids: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    let mut certified: Vec<&str> = ids.iter().map(String::as_str).collect();
    certified.push("node-late");
    issue_certificates(dir.path(), &certified);
    let agents = start_agents(dir.path(), &ids, "", &registry, Some(&[]));
    let s = storm(dir.path(), &agents, &registry, "test/dht", &digest, SIZE);
    eprintln!(
        "no tracker, {NODES} nodes, {} MiB: all done in {:.1} s; registry egress {:.3} copies; {:.2} copies moved between peers; DHT traffic {:.0} KiB",
        SIZE >> 20,
        s.seconds,
        s.registry_copies,
        s.peer_copies,
        s.dht_bytes / 1024.0
    );
    assert!(
        s.registry_copies <= 1.5,
        "the registry sent {:.3} copies",
        s.registry_copies
    );
    assert!(
        s.peer_copies >= (NODES - 2) as f64,
        "only {:.2} copies came from peers found through the DHT",
        s.peer_copies
    );

    // A member that joins after the storm takes the blob from the nodes
    // that hold all of it, with their word for every chunk's hash. (Its
    // first registry runs may go out before its peers' first bitfields
    // come: a block of 4 chunks it wins, seen here; not asserted.)
    let members = vec![agents[0].banner_field("DHT on ")];
    let what = "the late node did not join";
    let late = join_dht(dir.path(), "node-late", &registry, &members, what);
    let late_admin = admin_of(&late);
    pull_whole(
        &late,
        &registry,
        "test/dht",
        &digest,
        dir.path().join("late"),
    );
    let (late_registry, late_peers) = (
        received(dir.path(), &late_admin, "registry"),
        received(dir.path(), &late_admin, "peer"),
    );
    eprintln!(
        "the late member took {late_peers} bytes from peers and {late_registry} from the registry"
    );
    // Most from peers. Not all: the coordinator's first runs may come before
    // the members' bitfields, and then count chunks the members hold as
    // nobody's (72% from peers in one full-suite run on a loaded host,
    // 75% and more alone; an open finding of issue 36, for the simulator).
    assert!(
        late_peers >= SIZE as f64 * 0.5,
        "{late_peers} bytes from peers"
    );

    // A node whose certificate another CA signed: the members refuse it.
    let other = tempfile::tempdir().unwrap();
    issue_certificates(other.path(), &["outsider"]);
    let outsider = start_agents(
        other.path(),
        &["outsider".to_string()],
        "",
        &registry,
        Some(&members),
    );
    let outsider = &outsider[0];
    pull_whole(
        outsider,
        &registry,
        "test/dht",
        &digest,
        other.path().join("out"),
    );
    let admin = admin_of(outsider);
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
    let counted: f64 = agents
        .iter()
        .map(|a| {
            metric(
                dir.path(),
                &admin_of(a),
                "dray_agent_dht_refused_connections_total",
            )
        })
        .sum();
    assert!(counted >= refused as f64, "{counted} refusals counted");
    assert_eq!(metric(other.path(), &admin, "dray_agent_dht_peers"), 0.0);
    eprintln!(
        "the outsider was refused by {refused} of {NODES} members and pulled from the registry alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_whose_tracker_dies_as_it_starts_finds_its_peers_in_the_dht() {
    const NODES: usize = 16;
    const SIZE: u64 = 64 << 20;
    let registry = Registry::start(None).await;
    let work = tempfile::tempdir().unwrap();
    let blob = work.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/dht", &blob);
    let ids: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    let mut runs = Vec::new();
    // Today's behaviour first (known peers, then the registry), then the DHT.
    for dht in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        issue_certificates(
            dir.path(),
            &ids.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let (tracker, tracker_url) = start_tracker(dir.path(), "announce_interval = \"2s\"\n");
        let agents = start_agents(
            dir.path(),
            &ids,
            &tracker_url,
            &registry,
            dht.then_some(&[][..]),
        );
        let started = Instant::now();
        while metric(dir.path(), &tracker_url, "dray_tracker_nodes") < NODES as f64 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the agents did not announce"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Every replica gone (SIGKILL) as the storm starts.
        drop(tracker);
        let s = storm(dir.path(), &agents, &registry, "test/dht", &digest, SIZE);
        eprintln!(
            "tracker killed, {NODES} nodes, {} MiB, {}: last node after {:.1} s; registry egress {:.2} copies; {:.2} copies from peers; DHT traffic {:.0} KiB",
            SIZE >> 20,
            if dht {
                "with the DHT"
            } else {
                "without a DHT (today)"
            },
            s.seconds,
            s.registry_copies,
            s.peer_copies,
            s.dht_bytes / 1024.0
        );
        runs.push(s);
    }
    let (today, dht) = (&runs[0], &runs[1]);
    assert!(
        dht.registry_copies <= 2.0,
        "with the DHT the registry sent {:.2} copies",
        dht.registry_copies
    );
    assert!(
        dht.peer_copies >= NODES as f64 / 2.0,
        "with the DHT only {:.2} of {NODES} copies came from peers",
        dht.peer_copies
    );
    assert!(dht.registry_copies < today.registry_copies);
}

/// Issue 37, finding 9: a bootstrap name whose DNS server never answers
/// holds up no DHT query. The second node runs in a mount namespace of its
/// own whose resolv.conf names a DNS server on loopback that reads queries
/// and answers none (30 s a lookup, the resolver's longest); its bootstrap
/// list names a host there first, then the seed. It joins and pulls from
/// the seed through the DHT while that lookup still hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_name_whose_dns_never_answers_holds_up_no_dht_query() {
    const SIZE: u64 = 32 << 20;
    const SILENT_DNS: &str = "127.53.53.53";
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let blob = dir.path().join("blob");
    random_file(&blob, SIZE);
    let digest = registry.push("test/dns", &blob);
    issue_certificates(dir.path(), &["node-0", "node-1"]);
    let seed = start_agents(dir.path(), &["node-0".into()], "", &registry, Some(&[]));
    pull_whole(
        &seed[0],
        &registry,
        "test/dns",
        &digest,
        dir.path().join("0"),
    );

    let silent = std::net::UdpSocket::bind((SILENT_DNS, 53)).unwrap();
    silent.set_nonblocking(true).unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(
        &resolv,
        format!("nameserver {SILENT_DNS}\noptions timeout:30 attempts:1\n"),
    )
    .unwrap();
    let extra = format!(
        "[swarm.dht]\nlisten = \"127.0.0.1:0\"\nbootstrap = [\"bootstrap.dray-test.invalid:7882\", {:?}]\n",
        seed[0].banner_field("DHT on ")
    );
    let cfg = dir.path().join("node-1.toml");
    std::fs::write(
        &cfg,
        agent_toml(dir.path(), "node-1", "", &registry, &extra),
    )
    .unwrap();
    let script = format!(
        "mount --bind {} /etc/resolv.conf && exec \"$@\"",
        resolv.display()
    );
    let started = Instant::now();
    let node = DrayProc::start_wrapped(
        &["unshare", "--mount", "sh", "-c", &script, "sh"],
        &["agent", "-c", cfg.to_str().unwrap()],
        &dir.path().join("node-1.log"),
    );
    let admin = admin_of(&node);
    // The lookup takes 30 s; a loop that waited for it would not be here
    // before then.
    until_metric(
        dir.path(),
        &admin,
        "dray_agent_dht_peers",
        1.0,
        Duration::from_secs(10).saturating_sub(started.elapsed()),
        "the node did not join the DHT while its bootstrap name's lookup hung",
    );
    let joined = started.elapsed();
    pull_whole(&node, &registry, "test/dns", &digest, dir.path().join("1"));
    assert!(
        silent.recv(&mut [0u8; 512]).is_ok(),
        "the node's lookup never reached the silent DNS server"
    );
    let done = started.elapsed();
    eprintln!(
        "joined the DHT {:.1} s and pulled {} MiB from the seed {:.1} s after start, the bootstrap name's lookup hanging",
        joined.as_secs_f64(),
        SIZE >> 20,
        done.as_secs_f64()
    );
    assert_eq!(received(dir.path(), &admin, "registry"), 0.0);
    assert_eq!(received(dir.path(), &admin, "peer"), SIZE as f64);
    assert!(
        done < Duration::from_secs(30),
        "the pull ended only once the lookup gave up ({:.1} s)",
        done.as_secs_f64()
    );
}

/// Issue 37, finding 9: connections to the DHT port that never finish their
/// TLS handshake cost the node a bounded number of descriptors. From one
/// address, they fill only that address's room, and a member joins while
/// they stand; from many, the room of all addresses together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_to_the_dht_port_are_capped() {
    const FLOOD: usize = 600;
    /// The DHT's caps on handshakes at once, from one address
    /// (`MAX_PENDING_PER_ADDRESS`) and in all (`MAX_PENDING_INCOMING`), and
    /// room for the descriptors a node opens meanwhile.
    const PER_ADDRESS: usize = 16;
    const IN_ALL: usize = 128;
    const SLACK: usize = 32;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    issue_certificates(dir.path(), &["node-0", "node-1"]);
    let seed = start_agents(dir.path(), &["node-0".into()], "", &registry, Some(&[]));
    let port: std::net::SocketAddr = seed[0].banner_field("DHT on ").parse().unwrap();
    let admin = admin_of(&seed[0]);
    let over_limit = || {
        metric(
            dir.path(),
            &admin,
            "dray_agent_dht_connections_over_limit_total",
        )
    };
    let pid = seed[0].pid();
    let before = open_fds(pid).unwrap();
    // `FLOOD` connections from `addresses` loopback addresses, held open
    // until the node has closed all those past `cap`, which is then all it
    // holds more than before; returns them.
    let flood = |addresses: usize, cap: usize| async move {
        let closed_before = over_limit();
        let mut held = Vec::new();
        for i in 0..FLOOD {
            let from = std::net::Ipv4Addr::new(127, 0, 1, (1 + i % addresses) as u8);
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind((from, 0).into()).unwrap();
            held.push(socket.connect(port).await.unwrap());
        }
        let started = Instant::now();
        while over_limit() - closed_before < (FLOOD - cap) as f64 {
            assert!(
                started.elapsed() < Duration::from_secs(8),
                "{} of {FLOOD} connections closed over the limits",
                over_limit() - closed_before
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let during = open_fds(pid).unwrap();
        eprintln!(
            "{FLOOD} half-open connections from {addresses} address(es): {} descriptors more than before",
            during.saturating_sub(before)
        );
        assert!(
            during <= before + cap + SLACK,
            "{during} descriptors open during the flood, {before} before"
        );
        held
    };

    let held = flood(1, PER_ADDRESS).await;
    let members = vec![port.to_string()];
    let what = "a member did not join while one address flooded the port";
    let _late = join_dht(dir.path(), "node-1", &registry, &members, what);
    drop(held);

    drop(flood(40, IN_ALL).await);
}
