//! The dray node agent.
//!
//! It keeps a [`store::ChunkStore`] of verified chunks on disk, serves them to
//! other agents and fetches from them over an authenticated QUIC
//! [`peer::PeerNode`], drives transfers with [`fetch`], and joins the swarm
//! through [`swarm`]: announces to the tracker ([`tracker_client`]), or
//! without one finds peers through the Kademlia DHT ([`dht`]), the
//! addresses peers dial ([`advertise`]), registry
//! range fetches ([`registry`]) and the fallbacks that make a pull never worse
//! than a direct one; [`preheat`] keeps the preheat jobs the tracker hands
//! the node. [`mirror`] puts the OCI pull API on localhost for
//! containerd. [`metrics`] counts what the agent does for Prometheus and
//! serves it with the health checks on the admin listener; [`status`]
//! answers `dray status` on the [`local_api`] socket, with the recent
//! fallbacks and bans of [`events`]. [`Agent`] puts
//! these parts together, the one way every binary and test starts an agent.

pub mod advertise;
pub mod agent;
pub mod bounded;
pub mod config;
pub mod containerd;
pub mod dht;
pub mod enroll;
pub mod error;
pub mod events;
pub mod fetch;
pub mod gc;
pub mod identity;
pub mod image;
pub mod local_api;
pub mod metrics;
pub mod mirror;
pub mod peer;
pub mod preheat;
pub mod pulls;
pub mod rate;
pub mod registry;
pub mod status;
pub mod store;
pub mod swarm;
pub mod tracker_client;
pub mod udp;
pub mod unpack;

pub use agent::Agent;
pub use error::{Error, Result};
