//! The image the demo serves: an OCI image layout on disk (`index.json`, the
//! manifest, config and layers under `blobs/sha256/`), either given with
//! `--image` or generated here as tar+gzip layers of random files.

use anyhow::{Context, Result, bail};
use dray_protocol::BlobDigest;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// An OCI content descriptor (the fields the demo needs).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    fn blob_digest(&self) -> Result<BlobDigest> {
        self.digest
            .parse()
            .with_context(|| format!("descriptor digest {:?}", self.digest))
    }
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

/// An image manifest, as the layout stores it and the registry serves it.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub media_type: String,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

impl Manifest {
    /// The blobs a node pulls: the config, then every layer.
    pub fn blobs(&self) -> Result<Vec<(BlobDigest, u64)>> {
        std::iter::once(&self.config)
            .chain(&self.layers)
            .map(|d| Ok((d.blob_digest()?, d.size)))
            .collect()
    }
}

/// An image in an OCI layout, its blobs checked against their digests.
pub struct Image {
    layout: PathBuf,
    /// The manifest exactly as stored (its bytes are what its digest names).
    pub manifest_bytes: Vec<u8>,
    pub manifest_media_type: String,
    pub manifest_digest: BlobDigest,
    /// Config and layers with their sizes.
    pub blobs: Vec<(BlobDigest, u64)>,
    pub layers: usize,
}

impl Image {
    /// Reads the layout at `dir`: the manifest tagged `tag` in `index.json`
    /// (or its only manifest), then checks that the config and every layer
    /// are in `blobs/sha256/` with the size and digest the manifest says.
    pub fn load(dir: &Path, tag: Option<&str>) -> Result<Image> {
        let index_path = dir.join("index.json");
        let raw = std::fs::read(&index_path).with_context(|| {
            format!(
                "{} is not an OCI image layout: reading {}",
                dir.display(),
                index_path.display()
            )
        })?;
        let index: Index = serde_json::from_slice(&raw)
            .with_context(|| format!("{} is not an OCI image index", index_path.display()))?;
        let tags = || {
            index
                .manifests
                .iter()
                .map(|m| m.annotations.get(REF_NAME).map_or("(untagged)", |t| t))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let chosen = match tag {
            Some(t) => index
                .manifests
                .iter()
                .find(|m| m.annotations.get(REF_NAME).is_some_and(|r| r == t))
                .with_context(|| {
                    format!(
                        "{} has no manifest tagged {t:?} (tags: {})",
                        index_path.display(),
                        tags()
                    )
                })?,
            None => match index.manifests.as_slice() {
                [one] => one,
                [] => bail!("{} lists no manifest", index_path.display()),
                _ => bail!(
                    "{} lists {} manifests (tags: {}); choose one with --tag",
                    index_path.display(),
                    index.manifests.len(),
                    tags()
                ),
            },
        };
        if ![OCI_MANIFEST, DOCKER_MANIFEST].contains(&chosen.media_type.as_str()) {
            bail!(
                "{}: manifest {} has media type {:?}; the demo serves single-platform image manifests ({OCI_MANIFEST})",
                index_path.display(),
                chosen.digest,
                chosen.media_type
            );
        }
        let manifest_digest = chosen.blob_digest()?;
        let manifest_bytes = read_blob(dir, &manifest_digest, chosen.size)?;
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
            .with_context(|| format!("manifest {manifest_digest} in {}", dir.display()))?;
        let blobs = manifest
            .blobs()
            .with_context(|| format!("manifest {manifest_digest} in {}", dir.display()))?;
        for (digest, size) in &blobs {
            check_blob(dir, digest, *size)?;
        }
        Ok(Image {
            layout: dir.to_path_buf(),
            manifest_bytes,
            manifest_media_type: chosen.media_type.clone(),
            manifest_digest,
            layers: manifest.layers.len(),
            blobs,
        })
    }

    /// Writes an OCI layout to `dir` with `layers` tar+gzip layers (each one
    /// random file) of about `total` bytes in all, tagged `tag`, and loads it.
    /// Layers are written in parallel; deflate stores rather than compresses
    /// (random bytes do not compress), which keeps generation fast.
    pub fn generate(dir: &Path, layers: usize, total: u64, tag: &str) -> Result<Image> {
        let blob_dir = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blob_dir)
            .with_context(|| format!("creating {}", blob_dir.display()))?;
        let written: Vec<Result<(Descriptor, String)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..layers)
                .map(|i| {
                    let blob_dir = &blob_dir;
                    s.spawn(move || write_layer(blob_dir, i, total / layers as u64))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("layer writer panicked"))
                .collect()
        });
        let (layer_descs, diff_ids): (Vec<_>, Vec<_>) = written
            .into_iter()
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))?;
        let config = write_json_blob(&blob_dir, OCI_CONFIG, &config)?;
        let manifest = serde_json::to_vec(&Manifest {
            schema_version: 2,
            media_type: OCI_MANIFEST.into(),
            config,
            layers: layer_descs,
        })?;
        let mut manifest = write_json_blob(&blob_dir, OCI_MANIFEST, &manifest)?;
        manifest.annotations.insert(REF_NAME.into(), tag.into());
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [manifest]});
        std::fs::write(dir.join("index.json"), serde_json::to_vec(&index)?)
            .with_context(|| format!("writing {}/index.json", dir.display()))?;
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
            .with_context(|| format!("writing {}/oci-layout", dir.display()))?;
        Image::load(dir, Some(tag))
    }

    /// The file holding a blob of this image.
    pub fn blob_path(&self, digest: &BlobDigest) -> PathBuf {
        blob_path(&self.layout, digest)
    }

    /// The size of the config or a layer; `None` for other digests.
    pub fn blob_size(&self, digest: &BlobDigest) -> Option<u64> {
        self.blobs
            .iter()
            .find(|(d, _)| d == digest)
            .map(|(_, s)| *s)
    }

    /// Bytes a node pulls: config and layers.
    pub fn bytes(&self) -> u64 {
        self.blobs.iter().map(|(_, s)| s).sum()
    }
}

fn blob_path(layout: &Path, digest: &BlobDigest) -> PathBuf {
    layout.join("blobs/sha256").join(digest.hex())
}

fn read_blob(layout: &Path, digest: &BlobDigest, size: u64) -> Result<Vec<u8>> {
    let path = blob_path(layout, digest);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 != size || BlobDigest::of(&bytes) != *digest {
        bail!(
            "{} does not match its descriptor ({size} bytes, {digest})",
            path.display()
        );
    }
    Ok(bytes)
}

/// Checks a blob file's size and sha256 without holding it in memory.
fn check_blob(layout: &Path, digest: &BlobDigest, size: u64) -> Result<()> {
    let path = blob_path(layout, digest);
    let mut f = std::fs::File::open(&path).with_context(|| {
        format!(
            "the manifest names {digest}, but {} cannot be opened",
            path.display()
        )
    })?;
    let mut hashing = Hashing::new(std::io::sink());
    let len = std::io::copy(&mut f, &mut hashing)
        .with_context(|| format!("reading {}", path.display()))?;
    let (_, got) = hashing.finish();
    if len != size || got != *digest {
        bail!(
            "{} holds {len} bytes hashing to {got}; the manifest says {size} bytes, {digest}",
            path.display()
        );
    }
    Ok(())
}

fn write_json_blob(blob_dir: &Path, media_type: &str, bytes: &[u8]) -> Result<Descriptor> {
    let digest = BlobDigest::of(bytes);
    let path = blob_dir.join(digest.hex());
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(Descriptor {
        media_type: media_type.into(),
        digest: digest.to_string(),
        size: bytes.len() as u64,
        annotations: BTreeMap::new(),
    })
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hasher: sha2::Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<W> Hashing<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: sha2::Sha256::new(),
        }
    }

    fn finish(self) -> (W, BlobDigest) {
        (
            self.inner,
            BlobDigest::from_bytes(self.hasher.finalize().into()),
        )
    }
}

/// Writes layer `i`: a tar holding `/data/layer-i.bin` of `bytes` random bytes,
/// gzipped; returns its descriptor and its diff id (the tar's digest).
fn write_layer(blob_dir: &Path, i: usize, bytes: u64) -> Result<(Descriptor, String)> {
    let tmp = blob_dir.join(format!(".layer-{i}.partial"));
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let gz = Hashing::new(std::io::BufWriter::with_capacity(1 << 20, file));
    let tar_stream = Hashing::new(flate2::write::GzEncoder::new(
        gz,
        flate2::Compression::none(),
    ));
    let mut tar = tar::Builder::new(tar_stream);
    let mut header = tar::Header::new_gnu();
    header.set_size(bytes);
    header.set_mode(0o644);
    header.set_mtime(0);
    let data = crate::bench::RandomBytes::new(i as u64).take(bytes);
    let written = (|| {
        tar.append_data(&mut header, format!("data/layer-{i}.bin"), data)?;
        let (gz, diff_id) = tar.into_inner()?.finish();
        let (mut file, digest) = gz.finish()?.finish();
        file.flush()?;
        anyhow::Ok((diff_id, digest))
    })();
    let (diff_id, digest) = written.with_context(|| format!("writing {}", tmp.display()))?;
    let path = blob_dir.join(digest.hex());
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))?;
    let size = std::fs::metadata(&path)?.len();
    Ok((
        Descriptor {
            media_type: OCI_LAYER_GZIP.into(),
            digest: digest.to_string(),
            size,
            annotations: BTreeMap::new(),
        },
        diff_id.to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_layout_loads_back_with_every_blob() {
        let dir = tempfile::tempdir().unwrap();
        let image = Image::generate(dir.path(), 3, 3 << 20, "latest").unwrap();
        assert_eq!(image.layers, 3);
        assert_eq!(image.blobs.len(), 4);
        assert!(image.bytes() > 3 << 20);
        let again = Image::load(dir.path(), None).unwrap();
        assert_eq!(again.manifest_digest, image.manifest_digest);
        // A layer that changed on disk is refused with its path.
        let (layer, _) = image.blobs[1];
        std::fs::write(image.blob_path(&layer), b"not the layer").unwrap();
        let err = format!("{:#}", Image::load(dir.path(), None).err().unwrap());
        assert!(err.contains(&layer.hex()), "{err}");
    }
}
