//! Issue 37, node identity without the CA key on nodes: real `dray tracker`
//! and `dray agent` processes, the tracker's signer issuing the agents their
//! certificates, and real peer-plane connections.
//!
//! No Kubernetes API server runs here: the signer's TokenReview calls go to a
//! faithful local stand-in (an HTTPS server in this test, with a CA of its
//! own as a cluster's API server has) that answers as the API server does:
//! it requires the caller's own bearer token, and for a known token answers
//! `status.authenticated`, `user.username`, `user.extra` with the node name a
//! bound token carries, and `status.audiences` (the token's audiences that
//! the request asked for; none in common: not authenticated, with the API
//! server's error).

mod common;

use axum::Json;
use axum::http::{HeaderMap, StatusCode};
use common::*;
use dray_agent::identity::ClusterCa;
use dray_protocol::identity::Role;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const AGENT_SA: &str = "system:serviceaccount:dray:dray-agent";
const TRACKER_TOKEN: &str = "tracker-sa-token";

/// token -> (service account, node, audiences)
type Tokens = HashMap<String, (String, Option<String>, Vec<String>)>;

/// The TokenReview stand-in on loopback; returns its URL and its CA (PEM).
async fn token_review_api(tokens: Tokens) -> (String, String, tokio::task::JoinHandle<()>) {
    let ca = ClusterCa::generate().unwrap();
    let tls = ca
        .issue_tracker(&["localhost".into(), "127.0.0.1".into()], 1)
        .unwrap()
        .tracker_server_tls()
        .unwrap();
    let tokens = Arc::new(tokens);
    let app = axum::Router::new().route(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        axum::routing::post(move |headers: HeaderMap, Json(review): Json<Value>| {
            let tokens = tokens.clone();
            async move {
                let caller = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                if caller != format!("Bearer {TRACKER_TOKEN}") {
                    return (StatusCode::UNAUTHORIZED, Json(json!({"kind": "Status", "code": 401})));
                }
                let token = review["spec"]["token"].as_str().unwrap_or_default();
                let wanted: Vec<String> = review["spec"]["audiences"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect())
                    .unwrap_or_default();
                let status = match tokens.get(token) {
                    None => json!({"authenticated": false, "error": "invalid bearer token"}),
                    Some((_, _, auds)) if !wanted.iter().any(|w| auds.contains(w)) => json!({
                        "authenticated": false,
                        "error": format!("token audiences {auds:?} is invalid for the target audiences {wanted:?}"),
                    }),
                    Some((user, node, _)) => {
                        let mut extra = serde_json::Map::new();
                        if let Some(n) = node {
                            extra.insert("authentication.kubernetes.io/node-name".into(), json!([n]));
                            extra.insert("authentication.kubernetes.io/pod-name".into(), json!([format!("dray-agent-{n}")]));
                        }
                        json!({
                            "authenticated": true,
                            "user": {"username": user, "uid": "0d5e", "groups": ["system:serviceaccounts"], "extra": extra},
                            "audiences": wanted,
                        })
                    }
                };
                (
                    StatusCode::CREATED,
                    Json(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status})),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = dray_tracker::tls::TlsListener::new(listener, Arc::new(tls), 64).unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (format!("https://{addr}"), ca.cert_pem, task)
}

/// A certificate signing request (PEM) for a new key, naming `names`.
fn csr(names: &[&str]) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.serialize_request(&key).unwrap().pem().unwrap()
}

/// `POST /v1/certificate` at the tracker: (status, body).
async fn ask_signer(dir: &Path, tracker: &str, token: &str, csr: &str) -> (u16, String) {
    let ca = std::fs::read_to_string(dir.join("ca").join("ca.crt")).unwrap();
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(dray_agent::identity::enrollment_tls(&ca).unwrap())
        .build()
        .unwrap();
    let resp = client
        .post(format!("{tracker}/v1/certificate"))
        .bearer_auth(token)
        .body(csr.to_string())
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// Connects to the peer plane at `addr` (the node `name`) presenting
/// `cert_pem`/`key_pem`, the server checked against the cluster CA as any
/// TLS client would; `Ok` if the connection is still up after 2 s, else the
/// error that closed it.
async fn peer_plane(
    dir: &Path,
    addr: &str,
    name: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read_to_string(dir.join("ca").join("ca.crt")).unwrap();
    for c in rustls_pemfile_certs(&ca) {
        roots.add(c).unwrap();
    }
    let cert = rustls_pemfile_certs(cert_pem).remove(0);
    let key = {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap()
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![cert], key)
        .unwrap();
    tls.alpn_protocols = vec![dray_agent::identity::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint
        .connect(addr.parse().unwrap(), name)
        .unwrap()
        .await
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout(Duration::from_secs(2), conn.closed()).await {
        Err(_) => Ok(()),
        Ok(e) => Err(e.to_string()),
    }
}

fn rustls_pemfile_certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

/// When a PEM certificate starts and ends (Unix seconds).
fn validity_of(cert_pem: &str) -> (i64, i64) {
    dray_protocol::identity::validity(&rustls_pemfile_certs(cert_pem).remove(0)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_enroll_with_the_signer_join_the_swarm_renew_in_place_and_roles_are_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let size = 24u64 << 20;
    let src = dir.path().join("blob");
    random_file(&src, size);
    let digest = registry.push("test/identity", &src);
    // The cluster CA and the tracker's certificate; no node certificate.
    issue_certificates(dir.path(), &[]);
    let aud = |a: &str| vec![a.to_string()];
    let mut tokens = Tokens::new();
    for n in ["node-a", "node-b"] {
        tokens.insert(
            format!("tok-{n}"),
            (AGENT_SA.into(), Some(n.into()), aud("dray")),
        );
    }
    tokens.insert(
        "tok-other-audience".into(),
        (AGENT_SA.into(), Some("node-c".into()), aud("vault")),
    );
    tokens.insert(
        "tok-default-sa".into(),
        (
            "system:serviceaccount:dray:default".into(),
            Some("node-c".into()),
            aud("dray"),
        ),
    );
    let (api, api_ca, _api) = token_review_api(tokens).await;
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let api_ca = write("api-ca.crt", &api_ca);
    let api_token = write("tracker-sa-token", TRACKER_TOKEN);
    let (_tracker, tracker_url) = start_tracker(
        dir.path(),
        &format!(
            "announce_interval = \"1s\"\nmin_fetch_timeout = \"2s\"\n[signer]\nca_key = {:?}\napi_server = {api:?}\napi_ca = {api_ca:?}\napi_token = {api_token:?}\naudience = \"dray\"\nnodes = [{AGENT_SA:?}]\nlifetime = \"30s\"\n",
            dir.path().join("ca").join("ca.key"),
        ),
    );

    // Two agents in signer mode: no certificate on disk, a token each.
    let agents: Vec<DrayProc> = ["node-a", "node-b"]
        .iter()
        .map(|id| {
            let home = dir.path().join(id);
            std::fs::create_dir_all(&home).unwrap();
            std::fs::copy(dir.path().join("ca").join("ca.crt"), home.join("ca.crt")).unwrap();
            std::fs::write(home.join("token"), format!("tok-{id}")).unwrap();
            let cfg = dir.path().join(format!("{id}.toml"));
            let text = agent_toml(dir.path(), id, &tracker_url, &registry, "")
                + &format!(
                    "[enroll]\nsigner = {tracker_url:?}\ntoken = {:?}\n",
                    home.join("token")
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
            format!(
                "http://{}",
                a.banner_field("metrics on http://")
                    .trim_end_matches("/metrics")
            )
        })
        .collect();
    let cert_of =
        |id: &str| std::fs::read_to_string(dir.path().join(id).join("agent.crt")).unwrap();
    // Each got a node's certificate naming its own node.
    for id in ["node-a", "node-b"] {
        let cert = cert_of(id);
        let der = rustls_pemfile_certs(&cert).remove(0);
        assert_eq!(dray_protocol::identity::peer_id_of(&der).unwrap(), id);
        assert_eq!(dray_protocol::identity::role_of(&der).unwrap(), Role::Node);
    }
    // ...and joined the swarm: both announce, and node-b pulls from node-a.
    until_metric(
        dir.path(),
        &tracker_url,
        "dray_tracker_nodes",
        2.0,
        Duration::from_secs(20),
        "the tracker does not know both agents",
    );
    for (i, a) in agents.iter().enumerate() {
        let url = format!(
            "{}/v2/test/identity/blobs/{digest}?ns={}",
            a.banner_field("registry mirror on "),
            registry.host()
        );
        let out = dir.path().join(format!("pulled-{i}"));
        let status = std::process::Command::new("curl")
            .args(["-sSf", "--max-time", "60", "-o"])
            .arg(&out)
            .arg(&url)
            .status()
            .unwrap();
        assert!(status.success(), "curl {url}");
        assert_eq!(file_digest(&out), digest);
    }
    let from_peers = metric(
        dir.path(),
        &admin[1],
        "dray_agent_received_bytes_total{source=\"peer\"}",
    );
    assert!(from_peers > 0.0, "node-b took nothing from node-a");

    // A request naming another node is refused; so are a token for another
    // audience and one of a service account not on the allow-list.
    let (status, body) =
        ask_signer(dir.path(), &tracker_url, "tok-node-a", &csr(&["node-b"])).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains("it asks for \"node-b\", and its caller may be issued only \"node-a\""),
        "{body}"
    );
    let (status, body) =
        ask_signer(dir.path(), &tracker_url, "tok-other-audience", &csr(&[])).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body.contains("token audiences [\"vault\"] is invalid"),
        "{body}"
    );
    let (status, body) = ask_signer(dir.path(), &tracker_url, "tok-default-sa", &csr(&[])).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains("\"system:serviceaccount:dray:default\" may not get a dray certificate"),
        "{body}"
    );

    // The peer plane: a node's certificate is accepted; a preheater's and
    // one without a role, both signed by the cluster CA, are refused.
    let peer_addr = agents[0].banner_field("serving peers on ");
    let ca = ClusterCa::load(
        &dir.path().join("ca").join("ca.crt"),
        &dir.path().join("ca").join("ca.key"),
    )
    .unwrap();
    let node = ca.issue("node-x").unwrap();
    peer_plane(
        dir.path(),
        &peer_addr,
        "node-a",
        &node.cert_pem(),
        &node.key_pem(),
    )
    .await
    .expect("a node's certificate is accepted");
    let ci = ca
        .issue_role("ci", Role::Preheater, Duration::from_secs(3_600))
        .unwrap();
    let err = peer_plane(
        dir.path(),
        &peer_addr,
        "node-a",
        &ci.cert_pem(),
        &ci.key_pem(),
    )
    .await
    .expect_err("a preheater's certificate is refused");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let key = rcgen::KeyPair::generate().unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(
        &ca.cert_pem,
        rcgen::KeyPair::from_pem(&ca.key_pem).unwrap(),
    )
    .unwrap();
    let mut plain = rcgen::CertificateParams::new(vec!["node-y".to_string()]).unwrap();
    plain.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let plain = plain.signed_by(&key, &issuer).unwrap();
    let err = peer_plane(
        dir.path(),
        &peer_addr,
        "node-a",
        &plain.pem(),
        &key.serialize_pem(),
    )
    .await
    .expect_err("a certificate without a role is refused");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // node-a says why, in its log (written a moment after the refusal).
    for why in [
        "the certificate's role is preheater, and the peer plane accepts only node",
        "the certificate carries no role",
    ] {
        let started = Instant::now();
        while !std::fs::read_to_string(dir.path().join("node-a.log"))
            .unwrap()
            .contains(why)
        {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "node-a's log does not say {why:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // Renewal: the 30 s certificate is replaced after about 20 s, in place.
    let first = cert_of("node-a");
    let expiry = |i: usize| {
        metric(
            dir.path(),
            &admin[i],
            "dray_agent_certificate_expiry_timestamp_seconds",
        )
    };
    let first_expiry = expiry(0);
    let started = Instant::now();
    while validity_of(&cert_of("node-a")) == validity_of(&first) {
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "node-a's certificate was not renewed"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let started = Instant::now();
    while expiry(0) <= first_expiry {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the expiry gauge did not move"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The renewed certificate is the one node-a presents now: a peer that
    // dials it after the first one expired is still accepted, and the
    // tracker still hears from both.
    let renewed = cert_of("node-a");
    assert_eq!(rustls_pemfile_certs(&renewed).len(), 1);
    std::thread::sleep(Duration::from_secs(12));
    peer_plane(
        dir.path(),
        &peer_addr,
        "node-a",
        &node.cert_pem(),
        &node.key_pem(),
    )
    .await
    .expect("node-a presents a valid (renewed) certificate after the first one ended");
    assert_eq!(metric(dir.path(), &tracker_url, "dray_tracker_nodes"), 2.0);
}
