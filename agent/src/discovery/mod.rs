//! How a node finds the members of a blob's swarm: announces to the tracker
//! ([`tracker_client`], which also hands out the chunk hashes it vouches
//! for and the preheat jobs of [`preheat`]), or without a tracker the
//! Kademlia DHT ([`dht`]); [`advertise`] picks the addresses a node gives
//! out and the one a peer dials.

pub mod advertise;
pub mod dht;
pub mod preheat;
pub mod tracker_client;
