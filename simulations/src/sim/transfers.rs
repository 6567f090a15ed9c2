//! Peer transfers: filling a node's download slots from the peers it knows,
//! the flows that carry chunks between nodes, and the requests to frozen
//! peers that hang until their deadlines
//! (`dray_protocol::pull::deadline`, the agent's rule).

use super::*;
use dray_protocol::pull::deadline::{
    Deadline, MIN_CHUNK_BYTES_PER_S, REQUEST_TIMEOUT, extension, first_deadline, silent_deadline,
};
use std::time::Duration;

/// What a trickler sends of a chunk it was asked for: a byte now and then,
/// 1 KiB/s.
const TRICKLE_BYTES_PER_S: f64 = 1024.0;

impl World<'_> {
    /// Fills `n`'s free download slots with chunks its picker chooses from
    /// known peers that have a free upload slot.
    pub(super) fn try_fill(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive || !self.nodes[nu].started || self.nodes[nu].done_at.is_some() {
            return;
        }
        let max_down = self.sc.max_downloads;
        let max_up = self.sc.max_uploads;
        let nblobs = self.blobs.len();
        let mut busy = false;
        // Only then is a peer's node read for whether it hangs: most peers
        // of a busy swarm are busy, and a node read is a cache miss each.
        let may_hang = self.sc.peers_may_hang();
        let rotor = self.nodes[nu].rotor;
        self.nodes[nu].rotor = rotor.wrapping_add(1);
        'blobs: for k in 0..nblobs {
            let b = (rotor + k) % nblobs;
            if self.nodes[nu].blobs[b].picker.is_none() {
                continue;
            }
            // A dray lane asks a new peer for its bitfield first thing.
            self.look_all(n, b);
            if !self.nodes[nu].blobs[b]
                .picker
                .as_ref()
                .is_some_and(|p| p.offers_any())
            {
                continue;
            }
            let npeers = self.nodes[nu].blobs[b].peers.live().len();
            let mut gone = Vec::new();
            for step in 0..npeers {
                if self.nodes[nu].downloads >= max_down {
                    break 'blobs;
                }
                let slot = (rotor + step) % npeers;
                let p = self.nodes[nu].blobs[b].peers.live()[slot].key;
                let pu = p as usize;
                // Upload counts sit in one dense array: most peers of a busy
                // swarm are busy, and this is the hot check.
                let hangs = may_hang && self.nodes[pu].hangs();
                if self.uploads[pu] >= max_up && !hangs {
                    // The agent's request would be refused BUSY.
                    busy = true;
                    continue;
                }
                if hangs {
                    // It refuses nothing: the requests go out and hang, as
                    // many as the agent's lanes for it send.
                    self.hang(n, b, slot);
                    continue;
                }
                if !self.nodes[pu].alive {
                    gone.push(p);
                    continue;
                }
                while let Some(c) = self.take_request(n, b, slot) {
                    let bytes = self.chunk_bytes(b as u16, c);
                    let mut payload =
                        Payload::new(n, Source::Peer(p), b as u16, c, Purpose::PeerChunk);
                    // Only a frozen peer or a withholder misses a deadline
                    // here (a flow always ends): it is taken only where
                    // peers may hang.
                    if self.sc.peers_may_hang() {
                        payload.deadline_ns = self.deadline_ns(n, b, c);
                    }
                    self.start_flow(payload, bytes);
                }
            }
            for p in gone {
                self.drop_peer(n, b, p);
                // Asked, a crashed peer answers nothing: reported as the
                // agent's lane reports a request left unanswered.
                self.silenced(n, b, p, 0);
            }
        }
        if self.nodes[nu].downloads < max_down {
            // A lane refused BUSY tries again after the agent's back-off.
            let wait = if busy {
                self.sc.busy_backoff_s
            } else {
                self.sc.poll_s
            };
            self.schedule_poll(n, wait);
        }
    }

    /// A download slot of `n` and an upload slot of `p` taken for the next
    /// chunk of blob `b` that `p` offers and `n` lacks; none when either
    /// side has no slot free or the picker has nothing from `p`.
    fn take_request(&mut self, n: u32, b: usize, slot: usize) -> Option<u32> {
        let depth = self.depth_per_peer();
        let nu = n as usize;
        let p = self.nodes[nu].blobs[b].peers.live()[slot].key;
        let pu = p as usize;
        if self.nodes[nu].downloads >= self.sc.max_downloads
            || (self.uploads[pu] >= self.sc.max_uploads && !self.nodes[pu].hangs())
        {
            return None;
        }
        let nb = &mut self.nodes[nu].blobs[b];
        let view = &mut nb.peers.live_mut()[slot].value;
        if view.asked >= depth {
            return None;
        }
        let c = nb.picker.as_mut()?.pick(&p)?;
        view.asked += 1;
        self.nodes[nu].downloads += 1;
        self.uploads[pu] += 1;
        Some(c)
    }

    /// Requests one pull keeps in flight to one peer: for dray the agent's
    /// lanes per peer; the baselines' nodes only by `max_downloads`.
    fn depth_per_peer(&self) -> u32 {
        match self.strategy {
            Strategy::Dray | Strategy::DrayDht => DEFAULTS.depth_per_peer as u32,
            _ => u32::MAX,
        }
    }

    /// A request of `n` for a chunk of blob `b` to peer `p` ended (answered,
    /// failed or cancelled): a lane for `p` is free again.
    pub(super) fn request_ended(&mut self, n: u32, b: usize, p: u32) {
        if let Some(view) = self.nodes[n as usize].blobs[b].peers.get_mut(&p) {
            view.asked = view.asked.saturating_sub(1);
        }
    }

    /// The deadline of a request `n` sends now for chunk `c` of blob `b`,
    /// by the agent's rule.
    fn deadline(&self, n: u32, b: usize, c: u32) -> Deadline {
        let len = self.chunk_bytes(b as u16, c) as usize;
        let first = || first_deadline(len, MIN_CHUNK_BYTES_PER_S, REQUEST_TIMEOUT);
        self.nodes[n as usize].blobs[b].rates.deadline(len, first)
    }

    /// When a request `n` sends now for chunk `c` of blob `b` is past its
    /// deadline.
    fn deadline_ns(&self, n: u32, b: usize, c: u32) -> u64 {
        self.after_ns(self.deadline(n, b, c).wait)
    }

    /// `wait` from now, in the simulation's nanoseconds.
    fn after_ns(&self, wait: Duration) -> u64 {
        u64::try_from(wait.as_nanos()).map_or(u64::MAX, |ns| self.net.now_ns().saturating_add(ns))
    }

    /// When a request `n` sent for chunk `c` of blob `b`, deadline
    /// `deadline_ns`, is given up on once its peer stops answering now:
    /// at its deadline, or after the request timeout without a byte,
    /// whichever comes first (the agent's `fetch_chunk_noting` fails a
    /// peer silent for that long).
    pub(super) fn silent_due_ns(&self, deadline_ns: u64) -> u64 {
        let now = self.net.now_ns();
        let left = Duration::from_nanos(deadline_ns.saturating_sub(now));
        self.after_ns(silent_deadline(left, REQUEST_TIMEOUT))
    }

    /// When a request sent now to a trickler, with `deadline`, for a chunk
    /// of `len` bytes is given up on: at its deadline, unless what it
    /// trickled by then earns it the agent's extension
    /// (`pull::deadline::extension`; at [`TRICKLE_BYTES_PER_S`] it never
    /// does for a chunk of a few KiB or more).
    fn trickled_due_ns(&self, deadline: Deadline, len: f64) -> u64 {
        let received = (TRICKLE_BYTES_PER_S * deadline.wait.as_secs_f64()) as usize;
        let more = extension(deadline, received, len as usize).unwrap_or_default();
        self.after_ns(deadline.wait.saturating_add(more))
    }

    /// `n` asks frozen peer, withholder or trickler `p` for chunks of blob
    /// `b` in its free slots: the requests go out and nothing comes back,
    /// or from a trickler a byte now and then (the request ends at its
    /// deadline, not after the request timeout, and is not silent).
    fn hang(&mut self, n: u32, b: usize, slot: usize) {
        let p = self.nodes[n as usize].blobs[b].peers.live()[slot].key;
        let trickles = self.nodes[p as usize].trickles;
        while let Some(c) = self.take_request(n, b, slot) {
            let deadline = self.deadline(n, b, c);
            let due_ns = match trickles {
                true => self.trickled_due_ns(deadline, self.chunk_bytes(b as u16, c)),
                false => self.silent_due_ns(self.after_ns(deadline.wait)),
            };
            self.nodes[n as usize].hung.push(Hung {
                blob: b as u16,
                chunk: c,
                peer: p,
                due_ns,
            });
            if due_ns != u64::MAX {
                self.net.at_ns(due_ns, Ev::Deadline(n));
            }
        }
    }

    /// `n`'s requests to frozen peers past their deadlines: as the agent's
    /// lane does, each chunk goes back to the picker and the peer is dropped
    /// from the pull of the blob for good, its other requests cancelled.
    pub(super) fn deadlines(&mut self, n: u32) {
        let nu = n as usize;
        let now = self.net.now_ns();
        while let Some(h) = self.nodes[nu]
            .hung
            .iter()
            .find(|h| h.due_ns <= now)
            .copied()
        {
            let b = h.blob as usize;
            let mut k = 0;
            while k < self.nodes[nu].hung.len() {
                let o = self.nodes[nu].hung[k];
                if o.peer != h.peer || o.blob != h.blob {
                    k += 1;
                    continue;
                }
                self.nodes[nu].hung.swap_remove(k);
                self.nodes[nu].downloads -= 1;
                let up = &mut self.uploads[h.peer as usize];
                *up = up.saturating_sub(1);
                if let Some(picker) = self.nodes[nu].blobs[b].picker.as_mut() {
                    picker.failed(o.chunk);
                }
            }
            self.drop_peer(n, b, h.peer);
            if let Some(picker) = self.nodes[nu].blobs[b].picker.as_mut() {
                picker.ban(&h.peer);
            }
            self.adversity.frozen_dropped += 1;
            self.silenced(n, b, h.peer, h.chunk);
        }
        self.try_fill(n);
    }

    /// `n`'s pull of blob `b` dropped `p`, which left its request for chunk
    /// `c` unanswered: recorded for the pull's reports, and reported now.
    pub(super) fn silenced(&mut self, n: u32, b: usize, p: u32, c: u32) {
        self.nodes[n as usize].blobs[b].silence.dropped(p, c);
        self.report_silent(n, b);
    }

    /// Tells the tracker about the peers `n`'s pull of blob `b` dropped
    /// for requests they left unanswered: at once, and again while the
    /// pull runs, as the agent's pull does (`pull::silence`).
    pub(super) fn report_silent(&mut self, n: u32, b: usize) {
        if !self.reaches_tracker(n) {
            return;
        }
        let at = self.instant();
        for (p, c) in self.nodes[n as usize].blobs[b].silence.due(at) {
            self.send_silent(n, b, p, c);
        }
    }

    /// Tells the tracker about the chunks `n`'s pull of blob `b` found
    /// failing their hash, if it reaches it; those it does not hear wait
    /// for the next announce.
    pub(super) fn report_bad_chunks(&mut self, n: u32, b: usize) {
        if !self.reaches_tracker(n) {
            return;
        }
        for (p, c) in std::mem::take(&mut self.nodes[n as usize].blobs[b].unreported) {
            self.send_bad_chunk(n, b, p, c);
        }
    }

    /// Sends the tracker `n`'s report that `p` sent chunk `c` of blob `b`
    /// with bytes that fail its hash (an accuser sends it of anyone: the
    /// tracker cannot tell it from a true one).
    pub(super) fn send_bad_chunk(&mut self, n: u32, b: usize, p: u32, c: u32) {
        let report = dray_protocol::scheduler::BadChunk {
            reporter: self.names[n as usize].clone(),
            offender: self.names[p as usize].clone(),
            digest: self.blobs[b].digest,
            index: c,
            confirmed: false,
        };
        let at = self.instant();
        self.sched.report_bad_chunk(report, at);
    }

    /// Sends the tracker `n`'s report that `p` left its request for chunk
    /// `c` of blob `b` unanswered (an accuser sends it of anyone).
    pub(super) fn send_silent(&mut self, n: u32, b: usize, p: u32, c: u32) {
        let report = dray_protocol::scheduler::Silent {
            reporter: self.names[n as usize].clone(),
            offender: self.names[p as usize].clone(),
            digest: self.blobs[b].digest,
            index: c,
        };
        let at = self.instant();
        self.sched.report_silent(report, at);
    }

    /// `n` received chunk `c` of blob `b` from peer `p`, sent `asked_ns`
    /// ago: its bytes are checked against the chunk's hash as the agent's
    /// store checks them. True if they pass; if not, `n` bans `p` from its
    /// pull of the blob (the agent's lane) and the chunk may be picked again.
    pub(super) fn check_peer_chunk(
        &mut self,
        n: u32,
        b: usize,
        c: u32,
        p: u32,
        asked_ns: u64,
    ) -> bool {
        let (nu, pu) = (n as usize, p as usize);
        if self.nodes[pu].liar && !std::mem::replace(&mut self.nodes[pu].lied, true) {
            self.adversity.liars_served += 1;
        }
        let bad = self.nodes[pu].liar || self.nodes[pu].blobs[b].bad.get(c);
        let got = if bad { FORGED_HASH } else { TRUE_HASH };
        if dray_protocol::chunkmap::hash_matches(&TRUE_HASH, &got) {
            if bad {
                self.nodes[nu].blobs[b].bad.set(c);
            }
            if self.sc.peers_may_hang() {
                let took = (self.net.now_ns() - asked_ns).max(1) as f64 / 1e9;
                let rate = self.chunk_bytes(b as u16, c) / took;
                self.nodes[nu].blobs[b].rates.record(rate);
            }
            return true;
        }
        if let Some(picker) = self.nodes[nu].blobs[b].picker.as_mut() {
            picker.failed(c);
        }
        // Reported to the tracker at once, as the agent's pull does.
        self.nodes[nu].blobs[b].unreported.push((p, c));
        self.report_bad_chunks(n, b);
        self.drop_peer(n, b, p);
        if let Some(picker) = self.nodes[nu].blobs[b].picker.as_mut()
            && !picker.is_banned(&p)
        {
            picker.ban(&p);
            if !self.nodes[pu].liar {
                self.adversity.honest_dropped += 1;
            } else if !std::mem::replace(&mut self.nodes[pu].caught, true) {
                self.adversity.liars_banned += 1;
            }
        }
        false
    }

    /// Forgets a peer that left; the kraken-like graph gets a random live
    /// replacement, as Kraken's tracker would hand out.
    pub(super) fn drop_peer(&mut self, n: u32, b: usize, p: u32) {
        let nb = &mut self.nodes[n as usize].blobs[b];
        if nb.peers.leave(&p).is_none() {
            return;
        }
        if let Some(picker) = nb.picker.as_mut() {
            picker.remove_peer(&p);
        }
        self.unwatch(n, b, p);
        if self.strategy == Strategy::KrakenLike {
            for _ in 0..8 {
                let q = self.rng.below(self.pullers as usize) as u32;
                let known = self.nodes[n as usize].blobs[b].peers.contains(&q);
                if q != n && self.nodes[q as usize].alive && !known {
                    self.add_peer(n, b, q);
                    break;
                }
            }
        }
    }
}
