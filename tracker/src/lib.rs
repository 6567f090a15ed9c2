//! The dray tracker: the announce service that keeps soft who-has-what state and
//! schedules registry fetches so that each chunk leaves the registry about once.
//!
//! Not built yet: issue "Tracker-scheduled swarm with striped registry fallback"
//! fills this crate. It exports nothing until then, so nothing can mistake it for
//! a working tracker.
