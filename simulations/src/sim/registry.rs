//! The registry's faults as a registry run meets them: server errors, cut
//! bodies, an expired token, and `Range` ignored (each request answered with
//! the whole blob from its first byte). The agent's registry client
//! (`agent/src/pull/registry.rs`) meets them so: a server error or a cut
//! body is sent again after `dray_protocol::defaults::registry_retry_after`
//! (the last attempt's failure fails the pull), a refused token is renewed
//! and the request sent again, and a whole-blob answer is read up to the
//! range and kept open where the read stopped, for the blob's next range.

use super::*;
use crate::scenario::Outage;

/// Whole-blob answers a node keeps open (the agent's `OpenBodies::MAX`).
const KEPT_ANSWERS: usize = 8;

fn within(o: Option<&Outage>, now: f64) -> bool {
    o.is_some_and(|o| now >= o.at_s && now < o.at_s + o.for_s)
}

impl World<'_> {
    /// Whether the registry answers a request sent now with a server error.
    pub(super) fn registry_failing(&self) -> bool {
        within(self.sc.registry_errors.as_ref(), self.net.now())
    }

    /// Whether the registry cuts the body of a request sent now half-way.
    pub(super) fn registry_cutting(&self) -> bool {
        within(self.sc.registry_cuts.as_ref(), self.net.now())
    }

    /// Whether `n`'s registry token expired since it was taken: the request
    /// `n` sends now is refused, and `n` takes a fresh token.
    pub(super) fn token_refused(&mut self, n: u32) -> bool {
        let now = self.net.now();
        let node = &mut self.nodes[n as usize];
        match self.sc.token_expiry {
            Some(at) if now >= at && node.token_at < at => {
                node.token_at = now;
                true
            }
            _ => false,
        }
    }

    /// The bytes the registry sends for `n`'s request of chunk `c` of blob
    /// `b`: the chunk, or where `Range` is ignored, the blob from the answer
    /// `n` kept open nearest before it (taken), else from its first byte.
    pub(super) fn registry_read_bytes(&mut self, n: u32, b: u16, c: u32) -> f64 {
        let chunk = self.chunk_bytes(b, c);
        if !self.sc.ranges_ignored {
            return chunk;
        }
        // The agent announces as soon as its registry client first sees a
        // whole answer (its headers, a round trip on).
        let first = !std::mem::replace(
            &mut self.nodes[n as usize].blobs[b as usize].whole_answer,
            true,
        );
        if first && self.strategy == Strategy::Dray {
            self.schedule_announce(n, self.sc.rtt_s);
        }
        let kept = &mut self.nodes[n as usize].kept;
        let from = kept
            .iter()
            .enumerate()
            .filter(|&(_, &(blob, at))| blob == b && at <= c)
            .max_by_key(|&(_, &(_, at))| at)
            .map(|(k, _)| k);
        let first = match from {
            Some(k) => kept.remove(k).1,
            None => 0,
        };
        (first..c).map(|i| self.chunk_bytes(b, i)).sum::<f64>() + chunk
    }

    /// `n`'s read of chunk `c` of blob `b` ended where it asked: where
    /// `Range` is ignored, the answer is kept open there for the next.
    pub(super) fn keep_answer(&mut self, n: u32, b: u16, c: u32) {
        if !self.sc.ranges_ignored {
            return;
        }
        let kept = &mut self.nodes[n as usize].kept;
        if kept.len() >= KEPT_ANSWERS {
            kept.remove(0);
        }
        kept.push((b, c + 1));
    }
}
