//! One pull's decisions, without I/O: when it fetches from the registry on
//! its own and which chunks, which registry runs it starts and stops, and
//! when it gives up. [`PullMachine`] takes events with the time passed in
//! (the tracker's or the DHT coordinator's news, a run that ended, a poll
//! with what the transfer holds) and answers with [`Action`]s that its
//! driver carries out. The agent's pull engine (`agent/src/pull/swarm/drive.rs`) and
//! every simulated node (`simulations/src/sim/dray.rs`) drive the same
//! machine, so a simulated storm decides as the agents would; nothing in
//! either decides on its own when to go to the registry.
//!
//! [`fallback`] holds the rules that choose the fallback's mode;
//! [`machine`] the run book and the choice of the fallback's runs;
//! [`arbiter`] who decides a chunk's hash when no tracker vouches for it;
//! [`deadline`] how long a chunk request to a peer is waited for;
//! [`silence`] when a peer dropped as silent is reported to the tracker.

pub mod arbiter;
pub mod deadline;
pub mod fallback;
pub mod machine;
pub mod silence;

pub use arbiter::{Arbiter, Claim, Ruling};
pub use deadline::ChunkRates;
pub use fallback::{Fallback, FallbackRule};
pub use machine::{Action, News, PullConfig, PullMachine, RunId, RunKind};
pub use silence::SilenceReports;
