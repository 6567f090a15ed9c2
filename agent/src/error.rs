//! The agent's error type: each variant names what failed and what it concerns
//! (digest, peer, path) so that it reads as a sentence to an operator.

use dray_protocol::{BlobDigest, VerifyError, framing::FrameError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("chunk store database: {0}")]
    Db(String),
    /// A task of the agent's (a blocking store call, a registry run) panicked
    /// or was cancelled: a bug or a shutdown, not the database.
    #[error("agent task ended without finishing: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The mirror or the local API stopped serving before the agent stopped
    /// it (its task panicked, or its server returned).
    #[error("{what} stopped serving: {detail}")]
    Stopped { what: String, detail: String },
    #[error("configuration: {0}")]
    Config(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error("peer {peer}: {source}")]
    Frame {
        peer: String,
        #[source]
        source: FrameError,
    },
    #[error("peer {peer} refused: {reason}")]
    Rejected { peer: String, reason: String },
    /// A refusal for capacity (uploads or watchers at the peer's cap).
    #[error("peer {peer} is busy: {reason}")]
    Busy { peer: String, reason: String },
    #[error("peer {peer}: {detail}")]
    Peer { peer: String, detail: String },
    /// A peer answered a request with nothing, or stopped sending, for the
    /// request timeout: a withholder, or a frozen or crashed node.
    #[error("peer {peer} went silent: {detail}")]
    PeerSilent { peer: String, detail: String },
    #[error("could not connect to peer {peer} at {addr}: {detail}")]
    Connect {
        peer: String,
        addr: String,
        detail: String,
    },
    #[error("blob {0} is not in the chunk store")]
    UnknownBlob(BlobDigest),
    #[error(transparent)]
    Registry(#[from] crate::pull::registry::RegistryError),
    #[error(
        "chunk {index} of {digest} hashes to what its map said before a recheck replaced that hash: its sender has not heard of the replacement yet"
    )]
    Superseded { digest: BlobDigest, index: u32 },
    #[error(
        "chunk {index} of {digest} fails a hash taken on another peer's word alone: the registry decides which was true"
    )]
    Disputed {
        digest: BlobDigest,
        index: u32,
        hash: dray_protocol::chunkmap::ChunkHash,
    },
    #[error(
        "{chunks} chunks of {digest} held here were on the word of {liars}, whom the registry's bytes contradicted: fetching them again"
    )]
    Ruled {
        digest: BlobDigest,
        chunks: u32,
        liars: String,
    },
    #[error("the tracker replaced the hashes of {chunks} chunks of {digest} held here")]
    Replaced { digest: BlobDigest, chunks: u32 },
    #[error("blob {0} failed its digest and the swarm's recheck found no wrong chunk in time")]
    RecheckStalled(BlobDigest),
    #[error("blob {digest} could not be completed: {detail}")]
    Incomplete { digest: BlobDigest, detail: String },
    #[error("blob {digest} refused before reserving disk: {detail}")]
    BlobSize { digest: BlobDigest, detail: String },
    #[error("blob {digest} ({size} bytes) refused: no room in the chunk store: {detail}")]
    NoRoom {
        digest: BlobDigest,
        size: u64,
        detail: String,
    },
    #[error("image refused: {detail}")]
    ImageTooLarge { detail: String },
    #[error(
        "the swarm of blob {digest} cuts it in {chunk_size}-byte chunks: pulling it again in those"
    )]
    Recut { digest: BlobDigest, chunk_size: u32 },
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<sled::Error> for Error {
    fn from(e: sled::Error) -> Self {
        Self::Db(e.to_string())
    }
}
