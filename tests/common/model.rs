//! Model weights as OCI artifacts, pushed straight to the registry: a CNCF
//! ModelPack artifact (artifactType `application/vnd.cncf.model.manifest.v1+json`,
//! config `application/vnd.cncf.model.config.v1+json`, raw weight and doc
//! blobs), and the same number of bytes packaged as an image layer.

use super::*;

/// What was pushed as `repo:tag`: its blobs (config first) and their bytes.
pub struct Pushed {
    pub repo: &'static str,
    pub tag: &'static str,
    pub manifest_digest: String,
    pub blobs: Vec<String>,
    pub bytes: u64,
}

/// Pushes `body` as a blob of `repo`; answers its digest and size.
fn push_bytes(registry: &Registry, repo: &str, dir: &Path, body: &[u8]) -> (String, u64) {
    let path = dir.join("pushed-blob");
    std::fs::write(&path, body).unwrap();
    let digest = registry.push(repo, &path);
    std::fs::remove_file(&path).unwrap();
    (digest, body.len() as u64)
}

/// Pushes `size` random bytes as a blob of `repo`.
fn push_random(registry: &Registry, repo: &str, dir: &Path, size: u64) -> (String, u64) {
    let path = dir.join("random-blob");
    random_file(&path, size);
    let digest = registry.push(repo, &path);
    std::fs::remove_file(&path).unwrap();
    (digest, size)
}

/// `sha256:<hex>` of `text`.
fn digest_of(dir: &Path, text: &str) -> String {
    let path = dir.join("digested");
    std::fs::write(&path, text).unwrap();
    let digest = file_digest(&path);
    std::fs::remove_file(&path).unwrap();
    digest
}

fn descriptor(media_type: &str, (digest, size): &(String, u64), title: Option<&str>) -> String {
    let annotations = title
        .map(|t| format!(r#","annotations":{{"org.cncf.model.filepath":"{t}"}}"#))
        .unwrap_or_default();
    format!(r#"{{"mediaType":"{media_type}","digest":"{digest}","size":{size}{annotations}}}"#)
}

/// A ModelPack artifact as `repo:tag`: `weights` random bytes of raw weights
/// and a small raw README, under a model config that lists both.
pub fn push_model(
    registry: &Registry,
    dir: &Path,
    repo: &'static str,
    tag: &'static str,
    weights: u64,
) -> Pushed {
    let weights = push_random(registry, repo, dir, weights);
    let doc = push_bytes(
        registry,
        repo,
        dir,
        format!("# dray test model {tag}\n").as_bytes(),
    );
    let config = format!(
        r#"{{"descriptor":{{"name":"dray-test-model","version":"{tag}"}},"config":{{"format":"safetensors","paramSize":"0.5B"}},"modelfs":{{"type":"layers","diffIds":["{}","{}"]}}}}"#,
        weights.0, doc.0
    );
    let config = push_bytes(registry, repo, dir, config.as_bytes());
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","artifactType":"application/vnd.cncf.model.manifest.v1+json","config":{},"layers":[{},{}]}}"#,
        descriptor("application/vnd.cncf.model.config.v1+json", &config, None),
        descriptor(
            "application/vnd.cncf.model.weight.v1.raw",
            &weights,
            Some("model.safetensors")
        ),
        descriptor(
            "application/vnd.cncf.model.doc.v1.raw",
            &doc,
            Some("README.md")
        ),
    );
    registry.push_manifest(repo, tag, &manifest);
    Pushed {
        repo,
        tag,
        manifest_digest: digest_of(dir, &manifest),
        bytes: config.1 + weights.1 + doc.1,
        blobs: vec![config.0, weights.0, doc.0],
    }
}

/// `size` random bytes packaged as an image's one uncompressed layer (its
/// diffID is its digest), as `repo:tag`.
pub fn push_image(
    registry: &Registry,
    dir: &Path,
    repo: &'static str,
    tag: &'static str,
    size: u64,
) -> Pushed {
    let layer = push_random(registry, repo, dir, size);
    let config = format!(
        r#"{{"architecture":"amd64","os":"linux","rootfs":{{"type":"layers","diff_ids":["{}"]}},"config":{{}}}}"#,
        layer.0
    );
    let config = push_bytes(registry, repo, dir, config.as_bytes());
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{},"layers":[{}]}}"#,
        descriptor("application/vnd.oci.image.config.v1+json", &config, None),
        descriptor("application/vnd.oci.image.layer.v1.tar", &layer, None),
    );
    registry.push_manifest(repo, tag, &manifest);
    Pushed {
        repo,
        tag,
        manifest_digest: digest_of(dir, &manifest),
        bytes: config.1 + layer.1,
        blobs: vec![config.0, layer.0],
    }
}
