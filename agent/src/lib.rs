//! The dray node agent.
//!
//! Its parts are folders. [`store`] keeps the verified chunks on disk and
//! collects garbage; [`pull`] runs one pull per blob, joining its swarm,
//! fetching chunks from peers and ranges from the registry, with the
//! fallbacks that make a pull never worse than a direct one; [`peer`] is the
//! authenticated QUIC peer plane that serves chunks and fetches them;
//! [`discovery`] finds a swarm's members through the tracker or, without
//! one, the Kademlia DHT; [`serving`] is what the node offers locally (the
//! registry mirror for containerd, the local API with `dray status`, the
//! metrics); [`unpack`] turns layers into snapshots on all cores;
//! [`identity`] is the node's certificate and key, read or enrolled.
//! [`Agent`] puts these parts together, the one way every binary and test
//! starts an agent, from its [`config`].

pub mod agent;
pub mod bounded;
pub mod config;
pub mod discovery;
pub mod error;
pub mod identity;
pub mod peer;
pub mod pull;
pub mod serving;
pub mod store;
pub mod unpack;

pub use agent::Agent;
pub use error::{Error, Result};
