//! dray's protocol crate: the wire messages, their framing, chunk maps and the
//! verification of chunks and blobs.
//!
//! This crate does no I/O and reads no clock: it is the pure core that the agent,
//! the tracker and the simulator share, as `quinn-proto` is to `quinn`. Decoders
//! take untrusted bytes and either return a value within hard limits or a typed
//! error; they never panic. [`settings`] turns the agent's and the tracker's
//! TOML settings into typed structs with one-line errors; [`local_api`] holds
//! the local API messages that the agent and the snapshotter shim share;
//! [`defaults`] the swarm's timings and limits, which the agent, the tracker
//! and the simulator all read; [`pull`] the fallback rules of a pull,
//! [`peers`] its peer rotation and the watcher cap, and [`dht`] its registry
//! coordination without a tracker, which the agent and the simulator both
//! run; [`preheat`] the tracker's preheat API; [`planted`] the broken rules
//! that show the simulator's chaos sweep catches bugs (test builds only).

pub mod bitfield;
pub mod chunkmap;
pub mod defaults;
pub mod dht;
pub mod digest;
pub mod framing;
pub mod identity;
pub mod local_api;
pub mod peers;
pub mod picker;
pub mod planted;
pub mod preheat;
pub mod pull;
pub mod scheduler;
pub mod settings;

/// Messages generated from `proto/dray.proto`.
pub mod pb {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/dray.v1.rs"));
}

pub use bitfield::Bitfield;
pub use chunkmap::{ChunkMap, VerifyError};
pub use digest::{BlobDigest, DigestError};

/// The peer protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// Default chunk size: 4 MiB, a multiple of the 64-byte SHA-256 block.
pub const DEFAULT_CHUNK_SIZE: u32 = 4 << 20;
