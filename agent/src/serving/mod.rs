//! What the agent serves on the node: the OCI registry mirror containerd
//! pulls through ([`mirror`], made containerd's first host by the
//! `hosts.toml` of [`containerd`]), the local API on a unix socket for the
//! snapshotter shim, `dray pull`, preheat and `dray status` ([`local_api`],
//! resolving images with [`image`], answering status with [`status`]), and
//! the admin listener with the Prometheus metrics and health checks
//! ([`metrics`]). [`surfaces`] binds and serves the mirror and the local
//! API, the one way every agent serves them. The peer plane's server is
//! [`crate::peer`]'s.

pub mod containerd;
pub mod image;
pub mod local_api;
pub mod metrics;
pub mod mirror;
pub mod status;
pub mod surfaces;
