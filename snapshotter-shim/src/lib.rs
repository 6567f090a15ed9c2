//! containerd proxy snapshotter (`containerd.services.snapshots.v1.Snapshots`
//! over gRPC on a unix socket) with the semantics of containerd's overlayfs
//! snapshotter, plus remote layers: a `Prepare` that names a layer (the CRI
//! labels) asks the local dray agent to fetch and unpack it, commits the
//! result under the chain ID and answers `AlreadyExists`, so containerd
//! neither downloads nor applies it. Following layers of the image are
//! unpacked ahead into staging directories.
//!
//! It knows nothing of chunks, peers or registries: the agent's local API
//! ([`agent::LayerSource`]) is its only way out. Any agent failure falls back
//! to a plain `Prepare`, and containerd pulls the layer itself.

pub mod agent;
mod chain;
pub mod config;
mod error;
pub mod filter;
mod layout;
mod meta;
mod parents;
mod prefetch;
pub mod service;
mod snapshotter;

pub use config::SnapshotterConfig;
pub use error::SnapshotError;
pub use meta::{Kind, Record, Usage};
pub use service::serve;
pub use snapshotter::{
    Info, LABEL_IMAGE_LAYERS, LABEL_IMAGE_REF, LABEL_LAYER_DIGEST, LABEL_MANIFEST_DIGEST,
    LABEL_REF, Labels, Snapshotter,
};

/// Code generated from containerd's vendored protos (`proto/`), in modules
/// that mirror the proto packages (the generated code refers to them so).
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    pub use containerd::services::snapshots::v1 as snapshots;
    pub use containerd::types;

    pub mod containerd {
        /// `containerd.types`.
        pub mod types {
            tonic::include_proto!("containerd.types");
        }
        pub mod services {
            pub mod snapshots {
                /// `containerd.services.snapshots.v1`.
                pub mod v1 {
                    tonic::include_proto!("containerd.services.snapshots.v1");
                }
            }
        }
    }
}
