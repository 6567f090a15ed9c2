//! Issue 18, "mirror mode without the double copy (measure, then choose)":
//! the disk one node uses for the same images pulled through the mirror
//! (containerd's content store and overlayfs snapshots beside the agent's
//! store) and through the dray snapshotter (CRI pull: the agent's store and
//! the snapshotter's root; containerd's content store gets no layer). Real
//! registry, containerd 1.6, agent and `dray snapshotter`. Prints the bytes
//! (`du`, blocks in use) per mode; the figures are quoted in
//! docs/operator-guide.md ("Disk").

mod common;
#[path = "common/cri.rs"]
mod cri;

use common::*;
use std::path::Path;

/// Random bytes in each image's second layer: four sizes, MiB.
const IMAGES_MIB: [u64; 4] = [2, 4, 6, 8];

/// Disk blocks in use under `dir`, bytes (0 if it does not exist).
fn du(dir: &Path) -> u64 {
    if !dir.exists() {
        return 0;
    }
    let out = std::process::Command::new("du")
        .args(["-s", "--block-size=1"])
        .arg(dir)
        .output()
        .unwrap();
    ok(&out, "du")
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("du of {}: no byte count", dir.display()))
}

/// What one node holds after pulling every image, bytes.
#[derive(Debug)]
struct NodeDisk {
    agent_store: u64,
    containerd_content: u64,
    /// containerd's overlayfs snapshots (mirror) or the dray snapshotter's root.
    snapshots: u64,
}

impl NodeDisk {
    fn measure(agent: &Agent, ctrd: &Containerd, snapshots: &Path) -> NodeDisk {
        let root = ctrd.dir.path().join("root");
        NodeDisk {
            agent_store: du(&agent.dir.join("blobs")),
            containerd_content: du(&root.join("io.containerd.content.v1.content")),
            snapshots: du(snapshots),
        }
    }

    fn total(&self) -> u64 {
        self.agent_store + self.containerd_content + self.snapshots
    }

    fn print(&self, mode: &str) {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprintln!(
            "{mode:<12} agent store {:6.1} MiB  containerd content {:6.1} MiB  snapshots {:6.1} MiB  total {:6.1} MiB",
            mib(self.agent_store),
            mib(self.containerd_content),
            mib(self.snapshots),
            mib(self.total()),
        );
    }
}

fn push_images(registry: &Registry, work: &Path) -> Vec<String> {
    IMAGES_MIB
        .iter()
        .enumerate()
        .map(|(i, mib)| {
            let repo = format!("disk/app{i}");
            build_image(registry, &work.join(&repo), &repo, mib << 20, None);
            format!("{}/{repo}:gzip", registry.host())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirror_mode_stores_each_layer_twice_and_snapshotter_mode_once() {
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(None).await;
    let images = push_images(&registry, &work.path().join("img"));
    let upstreams = [(registry.host(), registry.url())];

    // Mirror mode: containerd pulls and unpacks into overlayfs as usual.
    let mirror_disk = {
        let dir = work.path().join("mirror");
        let agent = Agent::alone("node-m", &dir);
        let mirror = MirrorProc::start(&agent, &upstreams).await;
        let side_door = registry.side_door().await;
        let hosts = hosts_dir(&dir, &registry.host(), &side_door.url(), &mirror.url);
        let ctrd = Containerd::start();
        for image in &images {
            ok(&ctrd.pull(&hosts, image, None), &format!("pull {image}"));
        }
        assert_eq!(side_door.egress(), 0, "containerd went around the mirror");
        let overlay = ctrd
            .dir
            .path()
            .join("root/io.containerd.snapshotter.v1.overlayfs");
        NodeDisk::measure(&agent, &ctrd, &overlay)
    };

    // Snapshotter mode: a CRI pull has the agent fetch and unpack each layer.
    let shim_disk = {
        let dir = work.path().join("shim");
        let agent = Agent::alone("node-s", &dir);
        let mirror = MirrorProc::start(&agent, &upstreams).await;
        let api = LocalApiProc::start(&agent, &dir.join("agent.sock"), &upstreams).await;
        let shim = SnapshotterProc::start(&dir, &api.socket);
        let side_door = registry.side_door().await;
        let hosts = hosts_dir(&dir, &registry.host(), &side_door.url(), &mirror.url);
        let ctrd = Containerd::start_cri(&hosts, "dray", &dray_proxy_plugin(&shim.socket));
        let mut client = cri::client(Path::new(&ctrd.address)).await;
        for image in &images {
            cri::pull_image(&mut client, image)
                .await
                .unwrap_or_else(|e| {
                    panic!("PullImage {image}: {e}\nshim log:\n{}", shim.log_text())
                });
        }
        NodeDisk::measure(&agent, &ctrd, &shim.root)
    };

    eprintln!(
        "{} images ({:?} MiB of random data each):",
        images.len(),
        IMAGES_MIB
    );
    mirror_disk.print("mirror");
    shim_disk.print("snapshotter");

    // Mirror mode: containerd's content store holds the same layers as the
    // agent's store (give or take manifests, configs and block rounding).
    let layers = mirror_disk.agent_store;
    assert!(layers > 0, "{mirror_disk:?}");
    assert!(
        mirror_disk.containerd_content as f64 >= 0.9 * layers as f64,
        "containerd's content store should hold every layer again: {mirror_disk:?}"
    );
    // Snapshotter mode: the layers are stored once, in the agent's store;
    // containerd's content store has manifests and configs only.
    assert!(
        (shim_disk.containerd_content as f64) < 0.1 * shim_disk.agent_store as f64,
        "containerd's content store received layers in snapshotter mode: {shim_disk:?}"
    );
    assert!(
        shim_disk.total() < mirror_disk.total(),
        "snapshotter mode should use less disk: {shim_disk:?} vs {mirror_disk:?}"
    );
}
