//! When a pull stops waiting on the swarm and fetches from the registry on
//! its own: the fallback rules, as a state machine fed events with the time
//! passed in. [`super::PullMachine`] runs it for each pull.
//!
//! Three rules, checked in this order:
//! - **Stall**: nothing arrived and nothing was in flight for `stall`: every
//!   unclaimed chunk comes from the registry, to the end of the pull. A
//!   tracker reporting a registry fetch of the blob under way keeps the rule
//!   from firing (a slow registry would otherwise send every waiting node to
//!   it too), but only while a chunk arrived within `patience` stall periods:
//!   a run nobody fetches (its holder gone with the chunk) must not hold
//!   pulls for good.
//! - **Tracker silence**: no answer for `tracker_grace`: chunks no known peer
//!   can give come from the registry, until the tracker answers again; then
//!   its runs take over and the fallback's fetches are dropped.
//! - **Starved**: the tracker answers, reports no registry fetch of the blob
//!   under way, and yet nothing arrived and nothing was in flight for
//!   `tracker_grace`, while the pull lacks chunks whose hashes are published
//!   (so somebody holds them, and the tracker will not assign them to a
//!   registry run) that none of its peers can give it, and it dropped a
//!   peer for good (one that lied, froze or trickled: its holders may be
//!   gone from this transfer). Those chunks, and only those, come from the
//!   registry; once each is held or offered by a peer the rule lapses and
//!   the pull is back on the swarm, to fire again only after another quiet
//!   `tracker_grace`. A pull that dropped nobody waits for the tracker's
//!   next peers instead, the stall rule its backstop: in a storm of 50,000
//!   nodes and more the newest chunks take longer than the grace to reach
//!   every node's peers, and pulls starved for them by the dozen
//!   (`storm-100k`, docs/results.md). A chunk nobody published is one the
//!   tracker has yet to hand out (it may be fetching another layer of the
//!   image first, as its registry budget allows): waiting on it is not
//!   starving, and taking it sent every node of a two-layer storm to the
//!   registry for the second layer (the simulator found it once it ran
//!   this rule per blob, as the agent does: 104 copies in `outage-1k`).
//!   Without this rule such a pull waited the whole `stall` (30 s) and then fetched
//!   everything it lacked: the "30 s hole" of issue 36, where a node that
//!   dropped its peers early sat idle while a direct pull takes a second.
//!   It costs at most the chunks the pull cannot get from a live peer.

use crate::planted::{self, Bug};
use std::time::{Duration, Instant};

/// What a pull fetches from the registry on its own, mildest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fallback {
    /// Only the tracker's runs.
    Off,
    /// The tracker answers but nothing comes: the chunks no live peer could
    /// give when the rule fired, until each is held or offered.
    Starved,
    /// The tracker is silent: chunks no known peer can give, until it answers.
    Unavailable,
    /// No tracker, or the swarm stalled: every unclaimed chunk, to the end.
    All,
}

/// The fallback state of one pull.
#[derive(Clone, Debug)]
pub struct FallbackRule {
    mode: Fallback,
    tracker_grace: Duration,
    stall: Duration,
    patience: u32,
    /// The tracker's last answer.
    last_tracker: Instant,
    /// The last chunk that arrived, or a request in flight, or a registry
    /// fetch the tracker reported within patience: what holds the stall rule.
    progress: Instant,
    /// The last chunk that arrived.
    arrived: Instant,
    /// The tracker's last answer reported a registry fetch of the blob under way.
    fetching: bool,
}

impl FallbackRule {
    /// A pull starting at `now`; `alone` pulls with no swarm at all (no
    /// tracker, or a swarm that cannot be trusted with the blob).
    pub fn new(
        now: Instant,
        alone: bool,
        tracker_grace: Duration,
        stall: Duration,
        patience: u32,
    ) -> Self {
        Self {
            mode: if alone { Fallback::All } else { Fallback::Off },
            tracker_grace,
            stall,
            patience,
            last_tracker: now,
            progress: now,
            arrived: now,
            fetching: false,
        }
    }

    pub fn mode(&self) -> Fallback {
        self.mode
    }

    /// The tracker answered at `now`; `fetching`: it reports a registry fetch
    /// of the blob under way. True if that ends a tracker-silence fallback
    /// (the caller drops its fetches, whose chunks become pickable again).
    pub fn tracker_answered(&mut self, now: Instant, fetching: bool) -> bool {
        self.last_tracker = now;
        self.fetching = fetching;
        if fetching && now.saturating_duration_since(self.arrived) < self.stall * self.patience {
            self.progress = now;
        }
        let ended = self.mode == Fallback::Unavailable;
        if ended {
            self.mode = Fallback::Off;
        }
        ended
    }

    /// The chunks a starved pull wanted are held or offered by a peer: the
    /// pull is back on the swarm, and the rule fires again only after
    /// another quiet `tracker_grace`.
    pub fn starvation_over(&mut self) {
        if self.mode == Fallback::Starved {
            self.mode = Fallback::Off;
        }
    }

    /// An update from the tracker client that is not an answer (it is
    /// failing): whatever it reported being fetched is not news any more.
    pub fn tracker_failed(&mut self) {
        self.fetching = false;
    }

    /// A chunk arrived at `now`.
    pub fn arrived(&mut self, now: Instant) {
        self.arrived = now;
        self.progress = now;
    }

    /// A request (to a peer or the registry) is in flight at `now`: the
    /// swarm is not stalled.
    pub fn busy(&mut self, now: Instant) {
        self.progress = now;
    }

    /// Whether the tracker reported a registry fetch under way at its last answer.
    pub fn tracker_fetching(&self) -> bool {
        self.fetching
    }

    /// How long since the last chunk arrived.
    pub fn quiet_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.arrived)
    }

    /// How long since the tracker last answered.
    pub fn tracker_silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_tracker)
    }

    /// The mode the rules want at `now`, if it is past the current one: the
    /// pull takes it (the rule's mode is that from now on). `starvable`
    /// says whether the pull lacks a published chunk no peer can give; it
    /// is asked only when the starvation rule's clock has run out.
    pub fn escalate(&mut self, now: Instant, starvable: impl FnOnce() -> bool) -> Option<Fallback> {
        let quiet = now.saturating_duration_since(self.progress);
        let wanted = if quiet > self.stall {
            Fallback::All
        } else if self.tracker_silent_for(now) > self.tracker_grace
            && !planted::is(Bug::SilenceIgnored)
        {
            Fallback::Unavailable
        } else if quiet > self.tracker_grace
            && !self.fetching
            && self.mode < Fallback::Starved
            && starvable()
        {
            Fallback::Starved
        } else {
            return None;
        };
        (wanted > self.mode).then(|| {
            self.mode = wanted;
            wanted
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(3);
    const STALL: Duration = Duration::from_secs(30);

    fn rule(t0: Instant) -> FallbackRule {
        FallbackRule::new(t0, false, GRACE, STALL, 4)
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    /// The pull lacks a published chunk that no peer gives.
    fn yes() -> bool {
        true
    }

    #[test]
    fn a_silent_tracker_brings_the_registry_in_until_it_answers() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        r.arrived(t0 + s(2));
        assert_eq!(r.escalate(t0 + s(3), yes), None);
        assert_eq!(r.escalate(t0 + s(4), yes), Some(Fallback::Unavailable));
        assert_eq!(r.escalate(t0 + s(5), yes), None, "taken once");
        assert!(r.tracker_answered(t0 + s(6), false));
        assert_eq!(r.mode(), Fallback::Off);
        assert!(!r.tracker_answered(t0 + s(7), false), "nothing left to end");
    }

    #[test]
    fn a_stall_takes_every_chunk_from_the_registry_for_good() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        for at in (1..=31).step_by(2) {
            r.tracker_answered(t0 + s(at), false);
        }
        // Starved first (see the next tests), everything only past `stall`.
        assert_eq!(r.escalate(t0 + s(30), yes), Some(Fallback::Starved));
        assert_eq!(r.escalate(t0 + s(31), yes), Some(Fallback::All));
        assert!(!r.tracker_answered(t0 + s(32), false));
        assert_eq!(r.mode(), Fallback::All);
        // From a tracker-silence fallback too.
        let mut r = rule(t0);
        assert_eq!(r.escalate(t0 + s(4), yes), Some(Fallback::Unavailable));
        assert_eq!(r.escalate(t0 + s(31), yes), Some(Fallback::All));
    }

    #[test]
    fn requests_in_flight_and_arrivals_hold_the_stall_rule() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        r.busy(t0 + s(20));
        r.tracker_answered(t0 + s(49), false);
        assert_eq!(
            r.escalate(t0 + s(50), yes),
            Some(Fallback::Starved),
            "not All"
        );
        r.arrived(t0 + s(45));
        r.tracker_answered(t0 + s(76), false);
        assert_eq!(r.escalate(t0 + s(76), yes), Some(Fallback::All));
    }

    #[test]
    fn a_registry_fetch_under_way_holds_the_stall_rule_for_four_stall_periods() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        // Reported every second: no stall while a chunk came within 120 s.
        for at in 1..120 {
            r.tracker_answered(t0 + s(at), true);
            assert_eq!(r.escalate(t0 + s(at), yes), None, "at {at} s");
        }
        assert!(r.tracker_fetching());
        for at in 120..150 {
            r.tracker_answered(t0 + s(at), true);
        }
        assert_eq!(r.escalate(t0 + s(150), yes), Some(Fallback::All));
        r.tracker_failed();
        assert!(!r.tracker_fetching());
    }

    #[test]
    fn a_pull_the_tracker_answers_but_nothing_reaches_takes_what_no_peer_gives_after_the_grace() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        r.arrived(t0 + s(1));
        for at in 2..=4 {
            r.tracker_answered(t0 + s(at), false);
            assert_eq!(r.escalate(t0 + s(at), yes), None, "at {at} s");
        }
        assert_eq!(r.escalate(t0 + s(5), yes), Some(Fallback::Starved));
        // A tracker answer does not end it: the tracker has nothing to give.
        assert!(!r.tracker_answered(t0 + s(6), false));
        assert_eq!(r.mode(), Fallback::Starved);
        // The stall rule still takes over past `stall`.
        assert_eq!(r.escalate(t0 + s(32), yes), Some(Fallback::All));
    }

    #[test]
    fn a_pull_waiting_on_chunks_nobody_published_is_not_starved() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        for at in 1..30 {
            r.tracker_answered(t0 + s(at), false);
            assert_eq!(r.escalate(t0 + s(at), || false), None, "at {at} s");
        }
        assert_eq!(r.escalate(t0 + s(30), yes), Some(Fallback::Starved));
    }

    #[test]
    fn a_registry_fetch_under_way_or_a_request_in_flight_is_not_starvation() {
        let t0 = Instant::now();
        let mut r = rule(t0);
        for at in 1..20 {
            r.tracker_answered(t0 + s(at), true);
            assert_eq!(r.escalate(t0 + s(at), yes), None, "at {at} s");
        }
        let mut r = rule(t0);
        for at in 1..20 {
            r.tracker_answered(t0 + s(at), false);
            r.busy(t0 + s(at));
            assert_eq!(r.escalate(t0 + s(at), yes), None, "at {at} s");
        }
    }

    #[test]
    fn a_pull_alone_fetches_everything_from_the_start() {
        let t0 = Instant::now();
        let mut r = FallbackRule::new(t0, true, GRACE, STALL, 4);
        assert_eq!(r.mode(), Fallback::All);
        assert_eq!(r.escalate(t0 + s(100), yes), None);
    }
}
