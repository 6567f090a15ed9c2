//! The dray node agent.
//!
//! It keeps a [`store::ChunkStore`] of verified chunks on disk, serves them to
//! other agents and fetches from them over an authenticated QUIC
//! [`peer::PeerNode`], and drives transfers with [`fetch`]. Later layers (the
//! tracker client, the registry mirror, the unpacker) build on these.

pub mod config;
pub mod error;
pub mod fetch;
pub mod identity;
pub mod peer;
pub mod rate;
pub mod store;

pub use error::{Error, Result};
