//! The messages of the agent's local API that the snapshotter shim speaks
//! (HTTP/1.1 with JSON bodies on the agent's unix socket): one definition
//! for the agent that answers them and the shim that asks.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the shim asks a layer's size and media type.
pub const DESCRIBE_PATH: &str = "/v1/layers/describe";
/// Where the shim asks for a layer to be pulled and unpacked.
pub const UNPACK_PATH: &str = "/v1/layers/unpack";

/// `POST /v1/layers/unpack` request: one layer of one image, unpacked into
/// `target`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpackRequest {
    /// `registry/repo[:tag]`, as in the CRI `cri.image-ref` label.
    pub image_ref: String,
    /// The platform manifest holding the layer.
    pub manifest_digest: String,
    /// The compressed blob's digest.
    pub layer_digest: String,
    /// An absolute directory that does not exist yet.
    pub target: PathBuf,
}

/// `POST /v1/layers/describe` request: one layer of one image manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescribeRequest {
    pub image_ref: String,
    pub manifest_digest: String,
    pub layer_digest: String,
}

impl From<&UnpackRequest> for DescribeRequest {
    fn from(r: &UnpackRequest) -> Self {
        Self {
            image_ref: r.image_ref.clone(),
            manifest_digest: r.manifest_digest.clone(),
            layer_digest: r.layer_digest.clone(),
        }
    }
}

/// `POST /v1/layers/describe` answer, as the manifest states it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerDescription {
    pub layer_digest: String,
    /// Compressed bytes.
    pub size: u64,
    pub media_type: String,
}

/// `POST /v1/layers/unpack` answer, once the layer is unpacked and its blob
/// digest and diffID verified.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnpackResponse {
    pub layer_digest: String,
    pub diff_id: String,
    pub compressed_bytes: u64,
    pub uncompressed_bytes: u64,
    /// Seconds from the request to the verified tree.
    pub seconds: f64,
}
