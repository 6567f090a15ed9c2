//! Disturbances a scenario injects: nodes leaving, crashing or freezing,
//! the tracker going down and restarting, hanging, or cut off from some
//! nodes (the registry's faults: `registry`).

use super::*;

/// How a node goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exit {
    /// It tells the tracker.
    Leave,
    /// Without telling the tracker; its connections break.
    Crash,
    /// Without telling the tracker; its connections stay open, and what
    /// was asked of it is never answered (its askers wait out their deadlines).
    Freeze,
}

impl World<'_> {
    /// `n` goes.
    pub(super) fn leave(&mut self, n: u32, how: Exit) {
        let nu = n as usize;
        if !self.nodes[nu].alive {
            return;
        }
        self.nodes[nu].alive = false;
        self.nodes[nu].frozen = how == Exit::Freeze;
        // Its uploads end below; a zero count lets askers see it is gone.
        self.uploads[nu] = 0;
        if self.nodes[nu].done_at.is_none() {
            self.pending -= 1;
        }
        if self.strategy == Strategy::Dray
            && self.tracker_up
            && how == Exit::Leave
            && !self.nodes[nu].cut_off
        {
            self.sched.leave(&self.names[nu]);
        }
        for h in std::mem::take(&mut self.nodes[nu].hung) {
            let up = &mut self.uploads[h.peer as usize];
            *up = up.saturating_sub(1);
        }
        for id in std::mem::take(&mut self.nodes[nu].in_flows) {
            let (p, _) = self.net.remove(id);
            if let Source::Peer(s) = p.from {
                let sender = &mut self.nodes[s as usize];
                remove_item(&mut sender.out_flows, id);
                self.uploads[s as usize] = self.uploads[s as usize].saturating_sub(1);
            }
        }
        self.nodes[nu].runs.clear();
        let mut receivers = Vec::new();
        let mut unanswered = Vec::new();
        for id in std::mem::take(&mut self.nodes[nu].out_flows) {
            let (p, left) = self.net.remove(id);
            let r = p.to;
            remove_item(&mut self.nodes[r as usize].in_flows, id);
            match p.purpose {
                // Its askers hear nothing: the request hangs until its deadline.
                Purpose::PeerChunk if how == Exit::Freeze => {
                    let due_ns = self.silent_due_ns(p.deadline_ns);
                    self.nodes[r as usize].hung.push(Hung {
                        blob: p.blob,
                        chunk: p.chunk,
                        peer: n,
                        due_ns,
                    });
                    self.uploads[nu] += 1;
                    if due_ns != u64::MAX {
                        self.net.at_ns(due_ns, Ev::Deadline(r));
                    }
                }
                Purpose::PeerChunk => {
                    self.request_ended(r, p.blob as usize, n);
                    let rn = &mut self.nodes[r as usize];
                    rn.downloads = rn.downloads.saturating_sub(1);
                    // A crashed peer says nothing more: its askers drop it
                    // for good and report it silent, as the agent's lanes
                    // do once the request goes unanswered; one that left
                    // closed its connections, and is only forgotten.
                    if let Some(picker) = rn.blobs[p.blob as usize].picker.as_mut() {
                        picker.failed(p.chunk);
                        match how {
                            Exit::Crash => picker.ban(&n),
                            _ => picker.remove_peer(&n),
                        }
                    }
                    receivers.push(r);
                    if how == Exit::Crash {
                        unanswered.push((r, p.blob as usize, p.chunk));
                    }
                }
                // A whole-blob download resumes elsewhere for the bytes it lacks.
                _ => self.fetch_whole(r, p.blob, left),
            }
        }
        for (r, b, c) in unanswered {
            self.silenced(r, b, n, c);
        }
        for r in receivers {
            self.try_fill(r);
        }
    }

    /// The scenario's partition starts (`cut`) or heals.
    pub(super) fn partition(&mut self, cut: bool) {
        let Some(p) = &self.sc.partition else {
            return;
        };
        if !cut {
            for node in &mut self.nodes {
                node.cut_off = false;
            }
            return;
        }
        let mut order: Vec<u32> = (0..self.pullers).collect();
        self.rng.shuffle(&mut order);
        let count = (p.fraction * f64::from(self.pullers)).round() as usize;
        for n in order.into_iter().take(count) {
            self.nodes[n as usize].cut_off = true;
        }
    }

    pub(super) fn churn(&mut self) {
        let Some(c) = &self.sc.churn else {
            return;
        };
        let mut order: Vec<u32> = (0..self.pullers).collect();
        self.rng.shuffle(&mut order);
        let count = (c.fraction * f64::from(self.pullers)).round() as usize;
        for n in order.into_iter().take(count) {
            self.leave(n, if c.crash { Exit::Crash } else { Exit::Leave });
        }
    }

    /// The scenario's share of nodes freeze.
    pub(super) fn freeze(&mut self) {
        let Some(f) = &self.sc.freeze else {
            return;
        };
        let mut order: Vec<u32> = (0..self.pullers).collect();
        self.rng.shuffle(&mut order);
        let count = (f.fraction * f64::from(self.pullers)).round() as usize;
        for n in order.into_iter().take(count) {
            self.leave(n, Exit::Freeze);
        }
    }

    pub(super) fn sample(&mut self) {
        let bytes = self.net.registry_bytes_now();
        let dt = self.samples.push(self.net.now(), bytes);
        self.net.after(dt, Ev::Sample);
    }

    pub(super) fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Flow(id, v) => {
                if self.net.finishes(id, v) {
                    self.flow_done(id);
                }
            }
            Ev::Begin(id, v) => self.net.begin(id, v),
            Ev::Start(n) => self.start_node(n),
            Ev::Announce(n, generation) => {
                if self.nodes[n as usize].announce_gen == generation {
                    self.announce(n);
                }
            }
            Ev::Poll(n) => {
                if self.nodes[n as usize].poll_at == Some(self.net.now_ns()) {
                    self.poll(n);
                }
            }
            Ev::Answer(n, full) => self.answered(n, full),
            Ev::Tick => {
                if self.tracker_up {
                    let now = self.instant();
                    self.sched.tick(now);
                }
                self.net.after(tick_s(), Ev::Tick);
            }
            Ev::Sample => self.sample(),
            Ev::Provided(n) => self.dht_provided(n),
            Ev::Lookup(n) => self.dht_lookup(n),
            Ev::Found(n) => self.dht_found(n),
            Ev::Churn => self.churn(),
            Ev::Freeze => self.freeze(),
            Ev::Deadline(n) => self.deadlines(n),
            Ev::Retry(n, b, run) => self.retry(n, b, RunId(run)),
            Ev::OutageStart | Ev::HangStart => self.tracker_up = false,
            // A hung tracker carries on where it stopped.
            Ev::HangEnd => self.tracker_up = true,
            Ev::Partition(cut) => self.partition(cut),
            Ev::OutageEnd => {
                // Modelled as a restart: the tracker comes back empty and
                // rebuilds from the full announces its resend_full asks for.
                self.tracker_up = true;
                self.sched.restart();
                for published in &mut self.published {
                    *published = Bitfield::new(published.len());
                }
                self.tracked.fill(false);
            }
        }
    }
}
