//! When a pull tells the tracker about a peer it dropped as silent or too
//! slow: at once, and again every [`REPORT_AGAIN`] while the pull runs.
//!
//! The tracker doubts a reported peer for its `silent_window` (60 s) and
//! owes a registry run for what only doubted peers hold. A pull drops such
//! a peer for good, so it never asks it again and, reporting once, let the
//! doubt lapse while it still lacked what only that peer claimed: the pull
//! then starved for those chunks and fetched them alone (the simulator's
//! `small` scenario with a quarter of 64 nodes trickling; figures in
//! `docs/results.md`, "Lanes per peer"). A report repeated within the
//! window keeps the doubt alive without counting again against the
//! reporter's cap (see `Scheduler::report_silent`). The agent's transfers
//! and every simulated pull keep one of these.

use std::time::{Duration, Instant};

/// How often a pull repeats its report of a peer it dropped: half the
/// tracker's `silent_window`, so a doubt never lapses while the pull runs.
pub const REPORT_AGAIN: Duration = Duration::from_secs(30);

/// How soon a report that did not reach the tracker is due again: the
/// announce period, as the simulator's pulls, which report only while
/// they reach the tracker, try again at their next announce.
pub const RETRY_UNSENT: Duration =
    Duration::from_millis(crate::defaults::DEFAULTS.pull_announce_ms);

/// The peers one pull dropped as silent or too slow, with the chunk each
/// left unanswered and when its report is due next (`None`: at once). At
/// most the peers named to the pull: each is dropped once, for good.
#[derive(Clone, Debug)]
pub struct SilenceReports<P> {
    dropped: Vec<(P, u32, Option<Instant>)>,
}

impl<P> Default for SilenceReports<P> {
    fn default() -> Self {
        Self {
            dropped: Vec::new(),
        }
    }
}

impl<P: Clone + PartialEq> SilenceReports<P> {
    /// The pull dropped `peer` for leaving chunk `index` unanswered.
    pub fn dropped(&mut self, peer: P, index: u32) {
        if !self.dropped.iter().any(|(p, _, _)| *p == peer) {
            self.dropped.push((peer, index, None));
        }
    }

    /// The reports due at `now`: each dropped peer at once, then every
    /// [`REPORT_AGAIN`].
    pub fn due(&mut self, now: Instant) -> Vec<(P, u32)> {
        let mut due = Vec::new();
        for (peer, index, next) in &mut self.dropped {
            if next.is_none_or(|t| now >= t) {
                *next = now.checked_add(REPORT_AGAIN);
                due.push((peer.clone(), *index));
            }
        }
        due
    }

    /// The report of `peer` taken at `now` did not reach the tracker (it
    /// is down, hung or unreachable): due again after [`RETRY_UNSENT`],
    /// not a whole [`REPORT_AGAIN`] later, as the tracker's doubt is what
    /// sends out the chunks only that peer holds.
    pub fn unsent(&mut self, peer: &P, now: Instant) {
        if let Some((_, _, next)) = self.dropped.iter_mut().find(|(p, _, _)| p == peer) {
            *next = now.checked_add(RETRY_UNSENT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::SchedulerConfig;

    #[test]
    fn a_dropped_peer_is_reported_at_once_and_again_within_the_trackers_window() {
        assert!(REPORT_AGAIN < SchedulerConfig::default().silent_window);
        let t0 = Instant::now();
        let mut r = SilenceReports::default();
        assert!(r.due(t0).is_empty());
        r.dropped("w", 3);
        r.dropped("w", 5);
        assert_eq!(r.due(t0), vec![("w", 3)], "once, with its first chunk");
        assert!(r.due(t0 + Duration::from_secs(29)).is_empty());
        r.dropped("t", 1);
        let later = t0 + REPORT_AGAIN;
        assert_eq!(r.due(later), vec![("w", 3), ("t", 1)]);
        assert!(r.due(later + Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn a_report_that_did_not_reach_the_tracker_is_due_again_at_the_next_announce() {
        let t0 = Instant::now();
        let mut r = SilenceReports::default();
        r.dropped("w", 3);
        assert_eq!(r.due(t0), vec![("w", 3)]);
        let failed = t0 + Duration::from_secs(10);
        r.unsent(&"w", failed);
        r.unsent(&"never dropped", failed);
        assert!(r.due(failed).is_empty(), "not at once: the tracker is down");
        assert_eq!(r.due(failed + RETRY_UNSENT), vec![("w", 3)]);
        assert!(
            r.due(failed + RETRY_UNSENT + Duration::from_secs(29))
                .is_empty()
        );
    }
}
