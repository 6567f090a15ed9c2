//! A node's life in the simulation: it starts, receives chunks and finishes.

use super::*;

impl World<'_> {
    pub(super) fn start_node(&mut self, n: u32) {
        let (sc, instant) = (self.sc, self.instant());
        let node = &mut self.nodes[n as usize];
        if node.started || !node.alive {
            return;
        }
        node.started = true;
        if node.disk_full {
            for b in 0..self.blobs.len() as u16 {
                let bytes = self.blobs[b as usize].bytes as f64;
                self.fetch_whole(n, b, bytes);
            }
            return;
        }
        if node.claims {
            // A claimer holds nothing and says it holds everything: as the
            // tracker and its askers see it, a seed from the start.
            for nb in &mut node.blobs {
                fill(&mut nb.held);
                nb.complete = true;
                nb.picker = None;
            }
            node.done_at = Some(self.net.now());
            self.pending -= 1;
        } else if matches!(self.strategy, Strategy::Dray | Strategy::DrayDht) {
            let config = pull_config(sc, self.strategy);
            for nb in &mut node.blobs {
                nb.pull = Some(PullMachine::new(instant, false, 0, config.clone()));
            }
        }
        match self.strategy {
            Strategy::Dray => {
                self.nodes[n as usize].need_full = true;
                self.announce(n);
            }
            Strategy::DrayDht => self.dht_start(n),
            Strategy::KrakenLike => self.try_fill(n),
            Strategy::Direct | Strategy::SpegelLike => {
                for b in 0..self.blobs.len() as u16 {
                    let bytes = self.blobs[b as usize].bytes as f64;
                    self.fetch_whole(n, b, bytes);
                }
            }
        }
    }

    /// Direct and spegel-like: the whole blob from a complete holder if
    /// spegel-like and one exists, else from the registry.
    pub(super) fn fetch_whole(&mut self, n: u32, blob: u16, bytes: f64) {
        let mut from = Source::Registry;
        if self.strategy == Strategy::SpegelLike {
            let seeds = &mut self.seeds[blob as usize];
            while !seeds.is_empty() {
                let k = self.rng.below(seeds.len());
                let s = seeds[k];
                if self.nodes[s as usize].alive {
                    from = Source::Peer(s);
                    break;
                }
                seeds.swap_remove(k);
            }
        }
        if let Source::Peer(s) = from {
            self.uploads[s as usize] += 1;
        }
        let payload = Payload::new(n, from, blob, 0, Purpose::Whole);
        self.start_flow(payload, bytes);
    }

    /// A chunk (or, for whole-blob strategies, a blob) arrived at `n`.
    pub(super) fn receive(&mut self, n: u32, blob: u16, chunk: Option<u32>) {
        let now = self.net.now();
        let node = &mut self.nodes[n as usize];
        let nb = &mut node.blobs[blob as usize];
        match chunk {
            Some(c) => {
                if !nb.held.set(c) {
                    return;
                }
                nb.known.set(c);
                if let Some(p) = nb.picker.as_mut() {
                    p.completed(c);
                }
                nb.added.push(c);
                self.tell_watchers(n, blob, c);
            }
            None => {
                fill(&mut nb.held);
                for c in 0..nb.held.len() {
                    self.tell_watchers(n, blob, c);
                }
            }
        }
        let nb = &mut self.nodes[n as usize].blobs[blob as usize];
        if !nb.held.is_full() || nb.complete {
            return;
        }
        nb.complete = true;
        nb.picker = None;
        nb.pull = None;
        nb.peers.clear();
        if self.strategy == Strategy::SpegelLike {
            self.seeds[blob as usize].push(n);
        }
        let node = &mut self.nodes[n as usize];
        if node.done_at.is_none() && node.blobs.iter().all(|b| b.complete) && n < self.pullers {
            node.done_at = Some(now);
            self.pending -= 1;
            // A full disk keeps nothing to seed.
            if self.strategy == Strategy::Dray && !node.disk_full {
                // Publish the whole map, and tell the tracker at once: the node
                // now seeds instead of wanting.
                let heard = self.reaches_tracker(n);
                for b in 0..self.blobs.len() {
                    if heard && !self.published[b].is_full() {
                        for c in 0..self.published[b].len() {
                            self.publish(b, c);
                        }
                    }
                    fill(&mut self.nodes[n as usize].blobs[b].known);
                }
                self.schedule_announce(n, 0.0);
            }
        }
    }

    /// `n` gained chunk `c` of `blob`: each watcher that can verify it adds
    /// it to its view of `n`, and an idle one that lacks it looks for work
    /// after half a round trip.
    pub(super) fn tell_watchers(&mut self, n: u32, blob: u16, c: u32) {
        let max_down = self.sc.max_downloads;
        let b = blob as usize;
        for k in 0..self.nodes[n as usize].blobs[b].watchers.len() {
            let w = self.nodes[n as usize].blobs[b].watchers[k];
            let node = &mut self.nodes[w as usize];
            if !node.alive {
                continue;
            }
            let idle = node.done_at.is_none() && node.downloads < max_down;
            let nb = &mut node.blobs[b];
            if !nb.known.get(c) || nb.held.get(c) {
                continue;
            }
            let Some(picker) = nb.picker.as_mut() else {
                continue;
            };
            picker.peer_has(&n, c);
            // A chunk already on its way from elsewhere gives no new work.
            if idle && picker.is_unclaimed(c) {
                self.schedule_poll(w, self.sc.rtt_s / 2.0);
            }
        }
    }

    pub(super) fn flow_done(&mut self, id: FlowId) {
        let (p, _) = self.net.remove(id);
        let to = p.to;
        let node = &mut self.nodes[to as usize];
        remove_item(&mut node.in_flows, id);
        if let Source::Peer(s) = p.from {
            let sender = &mut self.nodes[s as usize];
            remove_item(&mut sender.out_flows, id);
            self.uploads[s as usize] = self.uploads[s as usize].saturating_sub(1);
        }
        match p.purpose {
            Purpose::Whole => self.receive(to, p.blob, None),
            Purpose::PeerChunk => {
                self.nodes[to as usize].downloads -= 1;
                let verified = match p.from {
                    Source::Peer(s) => {
                        self.request_ended(to, p.blob as usize, s);
                        self.check_peer_chunk(to, p.blob as usize, p.chunk, s, p.asked_ns)
                    }
                    Source::Registry => true,
                };
                if verified {
                    self.receive(to, p.blob, Some(p.chunk));
                }
            }
            Purpose::RunChunk => {
                // The fetcher publishes the chunk's hash to the tracker, if
                // it is there to hear it.
                if self.reaches_tracker(to) {
                    self.publish(p.blob as usize, p.chunk);
                }
                self.receive(to, p.blob, Some(p.chunk));
                self.keep_answer(to, p.blob, p.chunk);
                if let Some(k) = self.run_of_flow(to, id) {
                    let run = &mut self.nodes[to as usize].runs[k];
                    run.flow = None;
                    run.next += 1;
                    run.attempts = 0;
                    self.advance_run(to, k);
                }
            }
            Purpose::RunChunkCut => {
                self.adversity.registry_errors += 1;
                if let Some(k) = self.run_of_flow(to, id) {
                    self.nodes[to as usize].runs[k].flow = None;
                    self.retry_later(to, k, 0.0);
                }
            }
        }
        if p.purpose != Purpose::Whole {
            // The pull engine wakes on every chunk: progress, and a free
            // registry slot for the fallback's next run.
            self.pull_poll(to, p.blob as usize);
        }
        if matches!(
            self.strategy,
            Strategy::Dray | Strategy::DrayDht | Strategy::KrakenLike
        ) {
            self.try_fill(to);
        }
    }
}
