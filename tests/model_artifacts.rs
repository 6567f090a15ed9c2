//! Issue 39 item 5: model weights as OCI artifacts, through the mirror as an
//! image is. A CNCF ModelPack artifact (artifactType
//! `application/vnd.cncf.model.manifest.v1+json`, config
//! `application/vnd.cncf.model.config.v1+json`, one raw weight blob of 1 GiB
//! and a raw doc blob) is pushed to the real registry; a tracker and four
//! `dray agent` processes (the DHT on, as the chart runs them, with the
//! swarm's default timings) serve it through their mirrors, and skopeo, a
//! real OCI client, copies it from each mirror into an OCI layout at once.
//!
//! In one run, on the same agents:
//! 1. four direct copies from the registry at once (the baseline: what the
//!    nodes would do without dray, and "the registry time" below);
//! 2. the artifact through the four mirrors: byte-identical to what was
//!    pushed, registry egress at most 1.05 copies;
//! 3. the same number of bytes packaged as an image layer (an image config
//!    and a `tar` layer) through the mirrors, for the side-by-side figures;
//! 4. a second artifact with the tracker stopped (SIGSTOP: connections
//!    accepted, nothing answered) a moment into the pull: every copy still
//!    completes, none later than `swarm.stall` after the slower of the
//!    direct copies and the same copies through the mirrors with the
//!    tracker up (step 2: on one 2-core machine the four agents' hashing,
//!    QUIC and store writes can make those the slower), and the DHT keeps
//!    egress at most 1.5 copies.
//!
//! And the local API refuses to unpack an artifact's blob (it has no diffID
//! to check a tar against), before it fetches any of it.

mod common;

use common::cluster::*;
use common::model::*;
use common::*;
use dray_agent::serving::local_api::UnpackRequest;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const NODES: usize = 4;
const WEIGHTS: u64 = 1 << 30;
const REPO: &str = "models/llm";
/// `swarm.stall` as the agents run it here ([`default_timings`]).
const STALL_S: f64 = 30.0;

/// One skopeo copy of `what` from each of `hosts` into its own OCI layout
/// under `dir`, all at once; answers each copy's layout and seconds.
fn copy_all(hosts: &[String], what: &Pushed, dir: &Path) -> Vec<(PathBuf, f64)> {
    let started = Instant::now();
    let copies: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let layout = dir.join(format!("{}-{i}", what.tag));
            let (src, dst) = (
                format!("docker://{host}/{}:{}", what.repo, what.tag),
                format!("oci:{}:{}", layout.display(), what.tag),
            );
            std::thread::spawn(move || {
                let out = Command::new("timeout")
                    .args(["300", "skopeo", "copy", "-q", "--src-tls-verify=false"])
                    // Blobs kept as they are (an uncompressed layer too).
                    .arg("--dest-oci-accept-uncompressed-layers")
                    .args([&src, &dst])
                    .output()
                    .unwrap();
                ok(&out, &format!("skopeo copy {src}"));
                (layout, started.elapsed().as_secs_f64())
            })
        })
        .collect();
    copies.into_iter().map(|c| c.join().unwrap()).collect()
}

/// Every layout holds exactly `what`'s blobs, each hashing to its digest
/// (so byte-identical to what was pushed); the layouts are then removed.
fn check_and_remove(copies: &[(PathBuf, f64)], what: &Pushed) {
    for (layout, _) in copies {
        for digest in &what.blobs {
            let file = layout.join("blobs/sha256").join(&digest[7..]);
            assert_eq!(
                file_digest(&file),
                *digest,
                "{} holds another blob for {digest}",
                layout.display()
            );
        }
        std::fs::remove_dir_all(layout).unwrap();
    }
}

/// Copies `what` through `hosts` at once; answers (registry copies, the
/// last copy's seconds, each copy's seconds).
fn storm(registry: &Registry, hosts: &[String], what: &Pushed, dir: &Path) -> (f64, Vec<f64>) {
    let before = registry.egress();
    let copies = copy_all(hosts, what, dir);
    let copies_egress = (registry.egress() - before) as f64 / what.bytes as f64;
    check_and_remove(&copies, what);
    (copies_egress, copies.iter().map(|c| c.1).collect())
}

/// The swarm's default timings, and the mirror's `default_registry` set to
/// the one upstream: an OCI client other than containerd names no `ns`.
fn for_oci_clients(toml: String) -> String {
    let toml = default_timings(toml);
    let registry = toml
        .lines()
        .find_map(|l| l.strip_prefix("upstreams = { \"")?.split('"').next())
        .expect("the mirror's upstream")
        .to_string();
    assert!(toml.trim_end().ends_with('}'), "[mirror] is the last table");
    format!("{toml}default_registry = {registry:?}\n")
}

fn last(times: &[f64]) -> f64 {
    times.iter().copied().fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_modelpack_artifact_goes_through_four_mirrors_about_once_and_survives_a_hung_tracker() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let model = push_model(&registry, dir.path(), REPO, "v1", WEIGHTS);
    let image = push_image(&registry, dir.path(), REPO, "as-image", WEIGHTS);
    let hung = push_model(&registry, dir.path(), REPO, "v2", WEIGHTS);

    let ids: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    let (tracker, tracker_url) = tracker_for(dir.path(), &ids);
    let agents = start_agents_tuned(
        dir.path(),
        &ids,
        &tracker_url,
        &registry,
        Some(&[]),
        for_oci_clients,
    );
    until_announced(dir.path(), &tracker_url, NODES);
    let mirrors: Vec<String> = agents
        .iter()
        .map(|a| {
            a.banner_field("registry mirror on ")
                .trim_start_matches("http://")
                .to_string()
        })
        .collect();

    // 1. The baseline: four direct copies at once.
    // Through the registry's counting relay.
    let direct = vec![registry.url().trim_start_matches("http://").to_string(); NODES];
    let (direct_copies, direct_s) = storm(&registry, &direct, &model, dir.path());
    let registry_s = last(&direct_s);
    eprintln!(
        "direct: {NODES} copies of the {} MiB artifact from the registry at once: last {registry_s:.1} s, egress {direct_copies:.2} copies",
        model.bytes >> 20
    );

    // 2. The artifact through the mirrors.
    let (model_copies, model_s) = storm(&registry, &mirrors, &model, dir.path());
    // 3. The same bytes as an image layer.
    let (image_copies, image_s) = storm(&registry, &mirrors, &image, dir.path());
    eprintln!(
        "through {NODES} mirrors: ModelPack artifact last {:.1} s, egress {model_copies:.3} copies; the same bytes as an image layer last {:.1} s, egress {image_copies:.3} copies",
        last(&model_s),
        last(&image_s)
    );
    assert!(
        model_copies <= 1.05,
        "the registry sent {model_copies:.3} copies of the artifact"
    );

    // 4. A second artifact, the tracker hung a moment into the pull.
    let pid = tracker.pid() as libc::pid_t;
    let before = registry.egress();
    let stop = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    });
    let copies = copy_all(&mirrors, &hung, dir.path());
    stop.join().unwrap();
    let hung_copies = (registry.egress() - before) as f64 / hung.bytes as f64;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    check_and_remove(&copies, &hung);
    let hung_s: Vec<f64> = copies.iter().map(|c| c.1).collect();
    // What the copies take without the hang: the slower of the registry
    // and the mirrors with the tracker up, in this run.
    let unhung_s = registry_s.max(last(&model_s));
    let bound = STALL_S + unhung_s;
    eprintln!(
        "tracker hung 0.5 s into the pull: copies done at {hung_s:.1?} s (bound {bound:.1} s: swarm.stall + {unhung_s:.1} s without the hang); egress {hung_copies:.3} copies"
    );
    assert!(
        last(&hung_s) <= bound,
        "a copy took {:.1} s with the tracker hung; swarm.stall after the copies without the hang is {bound:.1} s",
        last(&hung_s)
    );
    assert!(
        hung_copies <= 1.5,
        "the registry sent {hung_copies:.3} copies with the tracker hung"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_api_refuses_to_unpack_an_artifacts_blob_and_fetches_none_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    let registry = Registry::start(None).await;
    let model = push_model(&registry, work, "models/small", "v1", 1 << 20);
    let agent = Agent::alone("node-a", work);
    let api = LocalApiProc::start(
        &agent,
        &work.join("agent.sock"),
        &[(registry.host(), registry.url())],
    )
    .await;
    dray_agent::pull::registry::install_crypto_provider();
    let image = format!("{}/models/small:v1", registry.host());
    let target = work.join("unpacked");
    let before = registry.egress();
    let (status, body) = api
        .unpack(&UnpackRequest {
            image_ref: image.clone(),
            manifest_digest: model.manifest_digest.clone(),
            layer_digest: model.blobs[1].clone(),
            target: target.clone(),
        })
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["error"].as_str().unwrap_or_default(),
        format!(
            "blob {} (application/vnd.cncf.model.weight.v1.raw) of {image} belongs to an artifact, not an image: it is pulled, never unpacked",
            model.blobs[1]
        )
    );
    assert!(!target.exists(), "the refused unpack made its target");
    // The manifest and the config were read; none of the weights.
    let egress = registry.egress() - before;
    assert!(egress < 64 << 10, "the registry sent {egress} bytes");
}
