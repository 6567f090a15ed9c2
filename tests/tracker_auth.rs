//! The tracker and the peer plane speak only to holders of a cluster
//! certificate, and a node speaks only for itself: an anonymous client is
//! refused by both, and an announce, publication or report naming another
//! node's peer id is refused with a message saying so.

mod common;

use common::*;
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::identity::{ClusterCa, Identity};
use dray_protocol::pb::{self, tracker_request::Body};
use dray_protocol::{BlobDigest, ChunkMap};
use prost::Message;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::sync::Arc;
use std::time::Duration;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn ca_roots(ca: &ClusterCa) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap())
        .unwrap();
    roots
}

/// An HTTPS client that trusts the cluster CA but has no certificate of its own.
fn anonymous_client(ca: &ClusterCa) -> reqwest::Client {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(ca_roots(ca))
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn announce_as(peer: &str, digest: BlobDigest) -> Body {
    Body::Announce(pb::Announce {
        peer_id: peer.into(),
        address: "127.0.0.1:7881".into(),
        full: true,
        blobs: vec![pb::BlobHolding {
            digest: digest.to_string(),
            size: 8 << 20,
            chunk_size: 4 << 20,
            bits: vec![0u8].into(),
            wanted: true,
            ..Default::default()
        }],
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_client_is_refused_by_the_tracker_api_but_reaches_its_probes() {
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let http = anonymous_client(&cluster_ca());
    let d = BlobDigest::of(b"blob");
    // The forged map of the issue: the real digest, 4 MiB too large, no hashes.
    let forged = ChunkMap::unhashed(d, 36 << 20, 4 << 20).unwrap();
    for body in [
        announce_as("node-a", d),
        Body::Publish(pb::PublishChunkMap {
            peer_id: "node-a".into(),
            map: Some(forged.to_pb()),
        }),
    ] {
        let resp = http
            .post(format!("{}/v1/tracker", tracker.url()))
            .body(pb::TrackerRequest { body: Some(body) }.encode_to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), reqwest::StatusCode::UNAUTHORIZED);
        let text = resp.text().await.unwrap();
        assert!(
            text.contains(
                "the tracker API needs a client certificate signed by the cluster CA, and this connection presented none"
            ),
            "{text}"
        );
    }
    assert_eq!(tracker.tracker.peer_count(), 0);
    assert!(tracker.tracker.map(&d).is_none());

    for (path, says) in [
        ("/healthz", "ok"),
        ("/readyz", "ready"),
        ("/metrics", "dray_tracker_rejected_requests_total 2"),
    ] {
        let resp = http
            .get(format!("{}{path}", tracker.url()))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{path}: {}", resp.status());
        let text = resp.text().await.unwrap();
        assert!(text.contains(says), "{path}: {text}");
    }

    // Plain HTTP gets no answer at all from a TLS listener.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/healthz", tracker.addr))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "{plain:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_at_the_handshake() {
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    // It trusts the cluster's CA, so only the tracker's check can refuse it.
    let foreign = ClusterCa::generate().unwrap().issue("node-a").unwrap();
    let foreign = Identity::from_pem(
        &foreign.cert_pem(),
        &foreign.key_pem(),
        &cluster_ca().cert_pem,
    )
    .unwrap();
    let client = TrackerClient::new(vec![tracker.url()], &foreign);
    let err = client
        .send(&tracker.url(), announce_as("node-a", BlobDigest::of(b"x")))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&tracker.url()), "{err}");
    assert_eq!(tracker.tracker.peer_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_announce_publish_or_report_under_another_nodes_id() {
    let tracker = serve_tracker(&quick_tracker(), "127.0.0.1:0").await;
    let ca = cluster_ca();
    let d = BlobDigest::of(b"blob");
    let b = TrackerClient::new(vec![tracker.url()], &ca.issue("node-b").unwrap());
    b.send(&tracker.url(), announce_as("node-b", d))
        .await
        .unwrap()
        .unwrap();
    let a = TrackerClient::new(vec![tracker.url()], &ca.issue("node-a").unwrap());
    let map = ChunkMap::unhashed(d, 8 << 20, 4 << 20).unwrap();
    for (what, body) in [
        ("an announce", announce_as("node-b", d)),
        (
            "a chunk map publication",
            Body::Publish(pb::PublishChunkMap {
                peer_id: "node-b".into(),
                map: Some(map.to_pb()),
            }),
        ),
        (
            "a bad-chunk report",
            Body::BadChunk(pb::BadChunkReport {
                reporter: "node-b".into(),
                offender: "node-c".into(),
                digest: d.to_string(),
                index: 0,
            }),
        ),
        (
            "a silent-peer report",
            Body::SilentPeer(pb::SilentPeerReport {
                reporter: "node-b".into(),
                offender: "node-c".into(),
                digest: d.to_string(),
                index: 0,
            }),
        ),
        (
            "a digest-failure report",
            Body::DigestFailed(pb::BlobDigestFailed {
                reporter: "node-b".into(),
                digest: d.to_string(),
            }),
        ),
    ] {
        let err = a.send(&tracker.url(), body).await.unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "answered 403 Forbidden: {what} names peer \"node-b\", but the client certificate is peer \"node-a\": a node speaks only for itself"
            )),
            "{err}"
        );
    }
    // node-b's address and holdings are untouched, and node-a is unknown.
    assert_eq!(tracker.tracker.peer_count(), 1);
    // The certificate's own id is taken when the field is left empty.
    a.send(&tracker.url(), announce_as("", d))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(tracker.tracker.peer_count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refuses_a_tracker_that_presents_a_nodes_certificate() {
    let ca = cluster_ca();
    // A node whose peer id is the tracker's host name.
    let impostor = ca.issue("localhost").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "https://localhost:{}",
        listener.local_addr().unwrap().port()
    );
    let served = tokio::spawn(dray_tracker::serve(
        listener,
        dray_tracker::Tracker::new(&quick_tracker()),
        dray_tracker::Transport::Tls {
            config: Arc::new(impostor.tracker_server_tls().unwrap()),
            max_connections: 16,
        },
    ));
    let client = TrackerClient::new(vec![url.clone()], &ca.issue("node-a").unwrap());
    let err = client
        .send(&url, announce_as("node-a", BlobDigest::of(b"x")))
        .await
        .unwrap_err();
    let chain = err.to_string();
    assert!(
        chain.contains(
            "presented as the tracker is not the tracker's (the certificate's role is node"
        ),
        "{chain}"
    );
    served.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_client_is_refused_by_the_peer_plane() {
    let dir = tempfile::tempdir().unwrap();
    let ca = cluster_ca();
    let agent = Agent::start(
        &ca,
        "node-a",
        dir.path(),
        quick_swarm(Vec::new()),
        Default::default(),
    );
    let addr = agent.swarm.node().local_addr().unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(ca_roots(&ca))
        .with_no_client_auth();
    tls.alpn_protocols = vec![dray_agent::identity::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let outcome = tokio::time::timeout(Duration::from_secs(5), async {
        let conn = endpoint.connect(addr, "node-a").unwrap().await?;
        // The client's side of the handshake may finish before the server
        // checks for a certificate; the server then closes the connection.
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(b"hello").await?;
        send.finish()?;
        recv.read_to_end(1024).await?;
        anyhow::Ok(())
    })
    .await
    .expect("the agent answers within 5 s");
    let err = format!("{:?}", outcome.expect_err("an anonymous client is refused"));
    assert!(err.to_lowercase().contains("certificate"), "{err}");
}
