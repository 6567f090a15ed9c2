//! The node's recent pull events, for `dray status`: registry fallbacks and
//! the peers a pull banned or dropped, each with its reason, in a ring of the
//! last [`KEPT`]. Metrics count these by reason only; an operator asking a
//! node what went wrong also wants the blob and the peer, which a metric
//! label must never carry.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Events kept; the oldest goes first.
pub const KEPT: usize = 64;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A pull turned to the registry for chunks the swarm did not deliver.
    Fallback,
    /// A peer sent a chunk failing its hash: banned for the transfer (and
    /// reported to the tracker).
    Ban,
    /// A peer missed a chunk's deadline: dropped from the transfer.
    Dropped,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fallback => "fallback",
            Self::Ban => "ban",
            Self::Dropped => "dropped",
        }
    }
}

/// One event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When, Unix seconds.
    pub at: u64,
    pub kind: EventKind,
    /// The blob being pulled.
    pub digest: String,
    /// The peer concerned (bans, drops).
    pub peer: Option<String>,
    /// Why, as a sentence or a metric reason (`stall`, `tracker_silent`, ...).
    pub reason: String,
}

/// The ring of recent events.
#[derive(Debug, Default)]
pub struct Events(Mutex<VecDeque<Event>>);

impl Events {
    /// Records an event now.
    pub fn record(&self, kind: EventKind, digest: String, peer: Option<String>, reason: String) {
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut ring = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == KEPT {
            ring.pop_front();
        }
        ring.push_back(Event {
            at,
            kind,
            digest,
            peer,
            reason,
        });
    }

    /// The events kept, newest first.
    pub fn recent(&self) -> Vec<Event> {
        let ring = self.0.lock().unwrap_or_else(|p| p.into_inner());
        ring.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_events_newest_first() {
        let events = Events::default();
        for i in 0..KEPT + 10 {
            events.record(EventKind::Fallback, format!("d{i}"), None, "stall".into());
        }
        let recent = events.recent();
        assert_eq!(recent.len(), KEPT);
        assert_eq!(recent[0].digest, format!("d{}", KEPT + 9));
        assert_eq!(recent[KEPT - 1].digest, "d10");
    }
}
