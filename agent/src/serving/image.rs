//! Images as the agent resolves them for the local API: a reference, its
//! manifest (OCI or Docker; an index or manifest list resolved to this node's
//! platform) checked against its digest, and the config's diffIDs matched to
//! the layers, so every layer can be pulled through the swarm and unpacked
//! with its uncompressed digest known.
//!
//! An OCI artifact (a manifest whose config is not an image config, such as
//! a CNCF ModelPack model: `application/vnd.cncf.model.config.v1+json` and
//! weight blobs of `application/vnd.cncf.model.weight.v1.raw`) resolves to
//! its blobs with no diffIDs: it is pulled, pinned and preheated as an image
//! is, chunked and verified by digest alone, and never unpacked (nothing here
//! assumes its blobs are tars).

use crate::pull::registry::{RegistryClient, RegistryError};
use dray_protocol::BlobDigest;
use oci_spec::distribution::Reference;
use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap, HeaderValue};

/// Largest manifest or config read (the distribution spec's manifest limit).
pub const MAX_MANIFEST: usize = 4 << 20;

const ACCEPTED: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.oci.image.index.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.docker.distribution.manifest.list.v2+json";

/// Why an image could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image reference {reference:?}: {detail}")]
    Reference { reference: String, detail: String },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("{what} of {repo}: {detail}")]
    Invalid {
        what: String,
        repo: String,
        detail: String,
    },
}

/// A parsed image reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRef {
    /// The registry name as containerd knows it (`docker.io`, `host:port`).
    pub registry: String,
    pub repo: String,
    /// Tag or digest to resolve.
    pub reference: String,
}

impl std::str::FromStr for ImageRef {
    type Err = ImageError;

    fn from_str(s: &str) -> Result<Self, ImageError> {
        let r: Reference = s.parse().map_err(|e| ImageError::Reference {
            reference: s.into(),
            detail: format!("{e}"),
        })?;
        let reference = r.digest().or(r.tag()).unwrap_or("latest").to_string();
        Ok(ImageRef {
            registry: r.registry().to_string(),
            repo: r.repository().to_string(),
            reference,
        })
    }
}

impl std::fmt::Display for ImageRef {
    /// `registry/repo:tag` or `registry/repo@digest`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sep = if self.reference.contains(':') {
            '@'
        } else {
            ':'
        };
        write!(f, "{}/{}{sep}{}", self.registry, self.repo, self.reference)
    }
}

/// One layer of a resolved image.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Layer {
    #[serde(serialize_with = "display")]
    pub digest: BlobDigest,
    pub size: u64,
    pub media_type: String,
    /// `sha256:<hex>` of the uncompressed tar, from the image config; none
    /// for an artifact's blob, which is not unpacked.
    pub diff_id: Option<String>,
}

/// A manifest resolved to its layers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Image {
    #[serde(serialize_with = "display")]
    pub manifest_digest: BlobDigest,
    #[serde(serialize_with = "display")]
    pub config: BlobDigest,
    /// The config's bytes (its body was read and checked).
    pub config_size: u64,
    /// An artifact's type (the manifest's `artifactType`, else its config's
    /// media type); none for an image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    pub layers: Vec<Layer>,
}

impl Image {
    /// The layer with `digest`, if the image has it ([`resolve`] refuses an
    /// image that lists one digest with two diffIDs, so it is one layer).
    pub fn layer(&self, digest: &BlobDigest) -> Option<&Layer> {
        self.layers.iter().find(|l| &l.digest == digest)
    }
}

fn display<S: serde::Serializer>(d: &BlobDigest, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

/// The OCI platform architecture of this build.
fn this_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// Fetches and checks a manifest or config body; `reference` a tag or digest.
async fn fetch(
    client: &RegistryClient,
    repo: &str,
    path: &str,
    expect: Option<&BlobDigest>,
) -> Result<(Vec<u8>, String, BlobDigest), ImageError> {
    let invalid = |detail: String| ImageError::Invalid {
        what: path.to_string(),
        repo: repo.to_string(),
        detail,
    };
    let mut headers = HeaderMap::new();
    headers.insert(ACCEPT, HeaderValue::from_static(ACCEPTED));
    let resp = client
        .request(repo, path, reqwest::Method::GET, headers)
        .await?;
    let status = resp.status();
    if !status.is_success() {
        return Err(invalid(format!("the registry answered {status}")));
    }
    let content_type = resp
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = crate::pull::registry::read_limited(resp, MAX_MANIFEST, client.base(), path)
        .await
        .map_err(|e| match e {
            RegistryError::TooLarge { .. } => invalid(format!("larger than {MAX_MANIFEST} bytes")),
            other => invalid(format!("reading the body: {other}")),
        })?;
    let digest = BlobDigest::of(&body);
    if let Some(want) = expect
        && &digest != want
    {
        return Err(invalid(format!("content hashes to {digest}, not {want}")));
    }
    Ok((body.to_vec(), content_type, digest))
}

fn is_index(media_type: &str) -> bool {
    media_type.contains("image.index") || media_type.contains("manifest.list")
}

/// Resolves `reference` (a tag or a digest) in `repo` to its layers: an index
/// is resolved to this node's platform (linux and this architecture).
pub async fn resolve(
    client: &RegistryClient,
    repo: &str,
    reference: &str,
) -> Result<Image, ImageError> {
    let pinned: Option<BlobDigest> = reference.parse().ok();
    let (mut body, mut media_type, mut digest) = fetch(
        client,
        repo,
        &format!("manifests/{reference}"),
        pinned.as_ref(),
    )
    .await?;
    let invalid = |what: &str, detail: String| ImageError::Invalid {
        what: what.to_string(),
        repo: repo.to_string(),
        detail,
    };
    if is_index(&media_type) || body_is_index(&body) {
        let index = ImageIndex::from_reader(body.as_slice())
            .map_err(|e| invalid(&format!("index {digest}"), e.to_string()))?;
        let entry = index
            .manifests()
            .iter()
            .find(|m| {
                m.platform().as_ref().is_some_and(|p| {
                    p.os().to_string() == "linux" && p.architecture().to_string() == this_arch()
                })
            })
            .ok_or_else(|| {
                invalid(
                    &format!("index {digest}"),
                    format!("no manifest for linux/{}", this_arch()),
                )
            })?;
        let want: BlobDigest = entry
            .digest()
            .to_string()
            .parse()
            .map_err(|e| invalid(&format!("index {digest}"), format!("{e}")))?;
        (body, media_type, digest) =
            fetch(client, repo, &format!("manifests/{want}"), Some(&want)).await?;
        if is_index(&media_type) {
            return Err(invalid(
                &format!("manifest {digest}"),
                "an index inside an index".into(),
            ));
        }
    }
    let manifest = ImageManifest::from_reader(body.as_slice())
        .map_err(|e| invalid(&format!("manifest {digest}"), e.to_string()))?;
    let config: BlobDigest = manifest
        .config()
        .digest()
        .to_string()
        .parse()
        .map_err(|e| invalid(&format!("manifest {digest}"), format!("config digest: {e}")))?;
    let (config_body, _, _) =
        fetch(client, repo, &format!("blobs/{config}"), Some(&config)).await?;
    let config_type = manifest.config().media_type().to_string();
    let artifact_type = (!IMAGE_CONFIGS.contains(&config_type.as_str())).then(|| {
        manifest
            .artifact_type()
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or(config_type)
    });
    let diff_ids: Vec<Option<String>> = match artifact_type {
        Some(_) => vec![None; manifest.layers().len()],
        None => {
            let image_config = ImageConfiguration::from_reader(config_body.as_slice())
                .map_err(|e| invalid(&format!("config {config}"), e.to_string()))?;
            let diff_ids = image_config.rootfs().diff_ids();
            if diff_ids.len() != manifest.layers().len() {
                return Err(invalid(
                    &format!("config {config}"),
                    format!(
                        "{} diffIDs for the manifest's {} layers",
                        diff_ids.len(),
                        manifest.layers().len()
                    ),
                ));
            }
            diff_ids.iter().cloned().map(Some).collect()
        }
    };
    let layers = manifest
        .layers()
        .iter()
        .zip(diff_ids)
        .map(|(l, diff_id)| {
            let digest = l.digest().to_string().parse().map_err(|e| {
                invalid(&format!("manifest {digest}"), format!("layer digest: {e}"))
            })?;
            Ok(Layer {
                digest,
                size: l.size(),
                media_type: l.media_type().to_string(),
                diff_id,
            })
        })
        .collect::<Result<Vec<_>, ImageError>>()?;
    one_diff_id_per_digest(&layers)
        .map_err(|detail| invalid(&format!("manifest {digest} with config {config}"), detail))?;
    Ok(Image {
        manifest_digest: digest,
        config,
        config_size: config_body.len() as u64,
        artifact_type,
        layers,
    })
}

/// The config media types of a runnable image (OCI and Docker); any other
/// config makes the manifest an artifact.
const IMAGE_CONFIGS: [&str; 2] = [
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

/// Refuses a manifest that lists one blob twice with two different diffIDs:
/// one blob unpacks to one tar, so one of them is a lie, and which layer a
/// digest stands for (what the unpack checks the tar against) would depend
/// on the order of the list. The same digest twice with one diffID is fine.
fn one_diff_id_per_digest(layers: &[Layer]) -> Result<(), String> {
    for (i, layer) in layers.iter().enumerate() {
        if let Some((j, first)) = layers[..i]
            .iter()
            .enumerate()
            .find(|(_, l)| l.digest == layer.digest && l.diff_id != layer.diff_id)
        {
            return Err(format!(
                "layer {} is listed twice with two diffIDs: {} (layer {j}) and {} (layer {i}); one blob cannot unpack to two different tars, so the image is refused",
                layer.digest,
                first.diff_id.as_deref().unwrap_or_default(),
                layer.diff_id.as_deref().unwrap_or_default()
            ));
        }
    }
    Ok(())
}

/// Whether a manifest body without a telling content type is an index.
fn body_is_index(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        manifests: Option<serde_json::Value>,
        layers: Option<serde_json::Value>,
    }
    serde_json::from_slice::<Probe>(body).is_ok_and(|p| p.manifests.is_some() && p.layers.is_none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references_as_containerd_names_them() {
        let r: ImageRef = "127.0.0.1:5000/team/app:1.0".parse().unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("127.0.0.1:5000", "team/app", "1.0")
        );
        let r: ImageRef = "busybox".parse().unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("docker.io", "library/busybox", "latest")
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let r: ImageRef = format!("example.com/x@{d}").parse().unwrap();
        assert_eq!(r.reference, d);
        let e = "UPPER/Case::".parse::<ImageRef>().unwrap_err().to_string();
        assert!(e.starts_with("image reference \"UPPER/Case::\""), "{e}");
        assert!(body_is_index(br#"{"manifests":[]}"#) && !body_is_index(br#"{"layers":[]}"#));
    }

    #[test]
    fn one_digest_listed_with_two_diff_ids_is_refused() {
        let digest = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let layer = |d: char, diff: char| Layer {
            digest: digest(d).parse().unwrap(),
            size: 1,
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
            diff_id: Some(digest(diff)),
        };
        // The same blob twice with one diffID (an empty layer repeated) is fine.
        one_diff_id_per_digest(&[layer('a', '1'), layer('b', '2'), layer('a', '1')]).unwrap();
        let e = one_diff_id_per_digest(&[layer('a', '1'), layer('b', '2'), layer('a', '3')])
            .unwrap_err();
        assert_eq!(
            e,
            format!(
                "layer {} is listed twice with two diffIDs: {} (layer 0) and {} (layer 2); one blob cannot unpack to two different tars, so the image is refused",
                digest('a'),
                digest('1'),
                digest('3')
            )
        );
    }
}
