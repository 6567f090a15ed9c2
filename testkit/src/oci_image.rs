//! Layer blobs as an image containerd can import, and a private containerd
//! 1.6 to import it into: the reference unpacker that `dray bench unpack` and
//! `tests/unpack.rs` compare dray's
//! unpacker against. Import goes through `ctr images import` of an OCI
//! archive, so neither needs a registry. The tests' other containerd
//! daemons (`tests/common`) are started by the same code.

use serde_json::json;
use sha2::Digest;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

/// One layer blob on disk.
pub struct LayerBlob {
    pub path: PathBuf,
    pub media_type: &'static str,
    /// `sha256:<hex>` of the blob's uncompressed tar.
    pub diff_id: String,
}

fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// The chain IDs of a layer stack, bottom first: the snapshot names
/// containerd commits each unpacked layer under.
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for d in diff_ids {
        out.push(match out.last() {
            None => d.clone(),
            Some(parent) => digest_of(format!("{parent} {d}").as_bytes()),
        });
    }
    out
}

/// Writes an OCI image archive (the layout as one tar) of `layers`, named
/// `name` (`repo:tag`), for `ctr images import`.
pub fn write_oci_archive(layers: &[LayerBlob], name: &str, out: &Path) -> io::Result<()> {
    let mut descs = Vec::new();
    let mut b = tar::Builder::new(io::BufWriter::new(std::fs::File::create(out)?));
    let add = |b: &mut tar::Builder<_>, path: &str, data: &[u8]| -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, path, data)
    };
    add(&mut b, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    for l in layers {
        let digest = sha256_file(&l.path)?;
        let size = std::fs::metadata(&l.path)?.len();
        b.append_path_with_name(&l.path, blob_path(&digest))?;
        descs.push(json!({"mediaType": l.media_type, "digest": digest, "size": size}));
    }
    let config = serde_json::to_vec(&json!({
        "architecture": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| &l.diff_id).collect::<Vec<_>>()},
    }))?;
    let config_digest = digest_of(&config);
    add(&mut b, &blob_path(&config_digest), &config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
        "layers": descs,
    }))?;
    let manifest_digest = digest_of(&manifest);
    add(&mut b, &blob_path(&manifest_digest), &manifest)?;
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": name},
        }],
    }))?;
    add(&mut b, "index.json", &index)?;
    b.into_inner()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()
}

fn blob_path(digest: &str) -> String {
    format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
}

/// `sha256:<hex>` of a file.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    use io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf)? {
            0 => break,
            n => h.update(&buf[..n]),
        }
    }
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// A containerd 1.6 daemon with its own root, state and sockets, and the
/// default (overlayfs) snapshotter.
pub struct Containerd {
    child: Child,
    pub address: String,
}

impl Containerd {
    /// Starts containerd under `dir` (which must exist), CRI plugin off, and
    /// waits until it answers.
    pub fn start(dir: &Path) -> io::Result<Containerd> {
        Containerd::start_with(dir, false, "")
    }

    /// Starts containerd under `dir` with its CRI plugin on or off and `extra`
    /// appended to its config (`@DIR@` in it stands for `dir`).
    pub fn start_with(dir: &Path, cri: bool, extra: &str) -> io::Result<Containerd> {
        let d = dir.display();
        let address = format!("{d}/containerd.sock");
        let disabled = if cri {
            ""
        } else {
            "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]"
        };
        let config = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n{disabled}\n\
             [grpc]\n  address = \"{address}\"\n[ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n[debug]\n  address = \"{d}/debug.sock\"\n\
             [metrics]\n  address = \"\"\n[plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{d}/opt\"\n{}\n",
            extra.replace("@DIR@", &d.to_string())
        );
        std::fs::write(dir.join("config.toml"), config)?;
        let log = std::fs::File::create(dir.join("containerd.log"))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let c = Containerd { child, address };
        for _ in 0..100 {
            if c.ctr(&["version"])?.status.success() {
                return Ok(c);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(io::Error::other("containerd did not answer within 10 s"))
    }

    /// Runs `ctr` against this daemon.
    pub fn ctr(&self, args: &[&str]) -> io::Result<Output> {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.address)
            .args(args)
            .output()
    }

    /// Runs `ctr`, failing with its stderr unless it succeeds.
    pub fn ctr_ok(&self, args: &[&str]) -> io::Result<String> {
        let out = self.ctr(args)?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "ctr {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The directory the overlayfs snapshotter keeps the committed snapshot
    /// `chain_id` (one unpacked layer) in, read from the mounts of a view of it.
    pub fn snapshot_dir(&self, chain_id: &str) -> io::Result<PathBuf> {
        let key = format!("dray-view-{}", &chain_id[7..19]);
        let _ = self.ctr(&["snapshots", "rm", &key]);
        let mounts = self.ctr_ok(&["snapshots", "view", "--mounts", &key, chain_id])?;
        let _ = self.ctr(&["snapshots", "rm", &key]);
        // A single layer is a bind mount of its dir; a stack is an overlay
        // whose first lowerdir is the top layer.
        let dir = mounts
            .split(|c: char| c.is_whitespace() || ",:=\"[]".contains(c))
            .find(|w| w.starts_with('/') && w.ends_with("/fs"))
            .ok_or_else(|| io::Error::other(format!("no snapshot dir in {mounts:?}")))?;
        Ok(PathBuf::from(dir))
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
