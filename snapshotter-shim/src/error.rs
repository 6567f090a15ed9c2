//! The shim's error type and its mapping onto the gRPC codes containerd's
//! `errdefs` expects (`errdefs.ToGRPC`): containerd's proxy client turns the
//! code back into `ErrNotFound`, `ErrAlreadyExists`, ... and acts on it.

use std::path::{Path, PathBuf};

/// Why a snapshot operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A snapshot (or its parent) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The key or name is taken; also the answer to a remote `Prepare`.
    #[error("{0}")]
    AlreadyExists(String),
    /// The snapshot is in the wrong state for this call (e.g. has children).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request itself is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// A file system operation failed.
    #[error("{context} {}: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The metadata database failed.
    #[error("snapshot metadata database: {0}")]
    Db(#[from] sled::Error),
    /// A metadata record does not decode.
    #[error("snapshot metadata record {key:?} is corrupt: {source}")]
    Corrupt {
        key: String,
        source: serde_json::Error,
    },
}

impl SnapshotError {
    /// An I/O error about `path`, saying what was being done.
    pub(crate) fn io(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| SnapshotError::Io {
            context,
            path,
            source,
        }
    }
}

impl From<SnapshotError> for tonic::Status {
    fn from(e: SnapshotError) -> Self {
        let message = e.to_string();
        match e {
            SnapshotError::NotFound(_) => tonic::Status::not_found(message),
            SnapshotError::AlreadyExists(_) => tonic::Status::already_exists(message),
            SnapshotError::FailedPrecondition(_) => tonic::Status::failed_precondition(message),
            SnapshotError::InvalidArgument(_) => tonic::Status::invalid_argument(message),
            // errdefs.ToGRPC maps every error it does not know to Unknown.
            SnapshotError::Io { .. } | SnapshotError::Db(_) | SnapshotError::Corrupt { .. } => {
                tonic::Status::unknown(message)
            }
        }
    }
}
