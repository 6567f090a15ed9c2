//! The dray node model: announces, the tracker's answers and runs, registry
//! fetches, and the fallback rules the agent runs (`dray_protocol::pull`).

use super::*;

impl World<'_> {
    pub(super) fn announce(&mut self, n: u32) {
        let nu = n as usize;
        if !self.nodes[nu].alive {
            return;
        }
        let pulling = self.nodes[nu].done_at.is_none();
        let every = if pulling {
            self.sc.announce_interval_s
        } else {
            self.sched_config.announce_interval.as_secs_f64()
        };
        let every = announce_spread(Duration::from_secs_f64(every), self.rng.unit()).as_secs_f64();
        self.schedule_announce(n, every);
        if !self.tracker_up {
            return;
        }
        self.send_announce(n);
    }

    /// Sends `n`'s announce (full if the tracker asked for one, else what
    /// it gained since); the answer comes a round trip later.
    pub(super) fn send_announce(&mut self, n: u32) {
        let nu = n as usize;
        let full = self.nodes[nu].need_full;
        let blobs = (0..self.blobs.len())
            .map(|b| {
                let info = &self.blobs[b];
                let nb = &mut self.nodes[nu].blobs[b];
                let held = if full {
                    nb.added.clear();
                    Held::Bits(nb.held.clone())
                } else {
                    Held::Added(std::mem::take(&mut nb.added))
                };
                BlobAnnounce {
                    digest: info.digest,
                    chunk_count: info.chunks,
                    size: info.bytes,
                    chunk_size: 0,
                    held,
                    wanted: !nb.complete,
                    // Every blob comes from the one registry.
                    origin: REGISTRY_ORIGIN.to_owned(),
                }
            })
            .collect();
        let mut labels = BTreeMap::new();
        if let Some(r) = self.rack(n) {
            labels.insert("rack".to_owned(), r.to_string());
        }
        let a = Announce {
            peer: self.names[nu].clone(),
            address: String::new(),
            upload_bytes_per_s: self.sc.node_up_bps as u64,
            active_uploads: self.uploads[nu],
            labels,
            blobs,
            full,
        };
        self.sched.announce(a, self.instant());
        self.net.after(self.sc.rtt_s, Ev::Answer(n, full));
    }

    /// The tracker's answer to `n`'s announce (`full` if it was) arrives.
    pub(super) fn answered(&mut self, n: u32, full: bool) {
        let nu = n as usize;
        let d = self.sched.answer();
        // Lost with the connection if the tracker or the node went down.
        if !self.tracker_up || !self.nodes[nu].alive {
            return;
        }
        let at = self.instant();
        // A registry fetch under way is not a stall (within patience).
        if self.nodes[nu]
            .fallback
            .tracker_answered(at, !d.fetching.is_empty())
        {
            self.end_tracker_fallback(n);
        }
        if d.resend_full {
            // A restarted tracker asks for a full announce; send it straight away.
            self.nodes[nu].need_full = true;
            self.send_announce(n);
            return;
        }
        if full {
            self.nodes[nu].need_full = false;
        }
        // The answer carries the tracker's maps of the wanted blobs; a full
        // announce republishes the hashes of the chunks the node holds
        // (after a restart the tracker has none: without them, chunks only
        // partial holders have could never be verified by anyone else).
        for b in 0..self.blobs.len() {
            if full {
                let held: Vec<u32> = self.nodes[nu].blobs[b].held.ones().collect();
                for c in held {
                    self.publish(b, c);
                }
            }
            let nb = &mut self.nodes[nu].blobs[b];
            if !nb.complete {
                let fresh: Vec<u32> = self.published[b]
                    .ones()
                    .filter(|&c| nb.known.set(c))
                    .collect();
                if !fresh.is_empty() {
                    self.learn_hashes(n, b, &fresh);
                }
            }
        }
        self.apply_decision(n, d);
        self.try_fill(n);
    }

    pub(super) fn apply_decision(&mut self, n: u32, d: AnnounceDecision) {
        let nu = n as usize;
        for (digest, contacts) in &d.peers {
            let Some(&b) = self.digest_index.get(digest) else {
                continue;
            };
            for c in contacts {
                let Some(p) = c.peer.strip_prefix('n').and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if p == n || p as usize >= self.nodes.len() {
                    continue;
                }
                self.learn_peer(n, b as usize, p);
            }
        }
        let wanted: Vec<(u16, u32, u32)> = d
            .assignments
            .iter()
            .filter_map(|a| {
                let b = *self.digest_index.get(&a.digest)?;
                Some((b, a.first, a.count))
            })
            .collect();
        // Runs missing from the answer were taken back: stop fetching them.
        let mut k = 0;
        while k < self.nodes[nu].runs.len() {
            let r = &self.nodes[nu].runs[k];
            if wanted.iter().any(|&(b, f, _)| b == r.blob && f == r.first) {
                k += 1;
                continue;
            }
            let run = self.nodes[nu].runs.swap_remove(k);
            self.release_run(n, run);
        }
        for (b, first, count) in wanted {
            self.start_run(n, b, first, count);
        }
    }

    /// `n` fetches chunks `[first, first + count)` of blob `b` from the
    /// registry, less those it holds or has on their way, unless it runs
    /// that run already.
    pub(super) fn start_run(&mut self, n: u32, b: u16, first: u32, count: u32) {
        let nu = n as usize;
        if self.nodes[nu]
            .runs
            .iter()
            .any(|r| r.blob == b && r.first == first)
        {
            return;
        }
        let nb = &mut self.nodes[nu].blobs[b as usize];
        let chunks = match nb.picker.as_mut() {
            Some(p) => (first..first.saturating_add(count))
                .filter(|&c| p.claim(c))
                .collect(),
            None => Vec::new(),
        };
        self.nodes[nu].runs.push(RunState {
            blob: b,
            first,
            chunks,
            next: 0,
            flow: None,
        });
        let k = self.nodes[nu].runs.len() - 1;
        self.advance_run(n, k);
    }

    pub(super) fn learn_peer(&mut self, n: u32, b: usize, p: u32) {
        let nb = &self.nodes[n as usize].blobs[b];
        if nb.picker.is_none() || nb.peers.contains(&p) {
            return;
        }
        // A peer watched by as many as it serves answers BUSY, and is
        // retired as soon as it is named (a simulated peer's lanes have
        // nothing in flight yet).
        if !may_watch(
            self.nodes[p as usize].blobs[b].watchers.len(),
            self.sc.max_watchers_per_blob,
        ) {
            return;
        }
        self.add_peer(n, b, p);
    }

    /// `n` knows `p` as a peer of blob `b`, and watches it; past dray's
    /// cap, the oldest peer goes at once (a simulated peer's requests end
    /// with its flows), and what it offered, others now offer too.
    pub(super) fn add_peer(&mut self, n: u32, b: usize, p: u32) {
        self.nodes[p as usize].blobs[b].watchers.push(n);
        let nb = &mut self.nodes[n as usize].blobs[b];
        if let Admit::Added { retired: Some(old) } = nb.peers.admit(p, false) {
            nb.peers.leave(&old);
            if let Some(picker) = nb.picker.as_mut() {
                picker.remove_peer(&old);
            }
            self.unwatch(n, b, old);
        }
        self.nodes[n as usize].blobs[b].unlooked = true;
    }

    /// `n` no longer watches `p` (a peer it has just forgotten) for blob `b`.
    /// A watcher list holds at most `max_watchers_per_blob`, a few cache lines to search.
    pub(super) fn unwatch(&mut self, n: u32, b: usize, p: u32) {
        let watchers = &mut self.nodes[p as usize].blobs[b].watchers;
        if let Some(at) = watchers.iter().position(|&x| x == n) {
            watchers.swap_remove(at);
        }
    }

    /// Stops a run: the chunk in flight and the claimed rest become pickable again.
    pub(super) fn release_run(&mut self, n: u32, run: RunState) {
        if let Some(id) = run.flow {
            self.net.remove(id);
            remove_item(&mut self.nodes[n as usize].in_flows, id);
        }
        let nb = &mut self.nodes[n as usize].blobs[run.blob as usize];
        if let Some(p) = nb.picker.as_mut() {
            for &c in &run.chunks[run.next.min(run.chunks.len())..] {
                p.failed(c);
            }
        }
    }

    /// Fetches the run's next chunk, or finishes the run and announces.
    pub(super) fn advance_run(&mut self, n: u32, k: usize) {
        let run = &self.nodes[n as usize].runs[k];
        if let Some(&c) = run.chunks.get(run.next) {
            let b = run.blob;
            let id = self.registry_chunk(n, b, c, Purpose::RunChunk);
            self.nodes[n as usize].runs[k].flow = Some(id);
        } else {
            let run = self.nodes[n as usize].runs.swap_remove(k);
            // Only a run that fetched something has news for the tracker; an
            // empty one (its chunks already arriving from peers) announcing at
            // once would be handed the same run again at the same instant.
            // Without a tracker the next lookup hands out the next run.
            if !run.chunks.is_empty() && self.strategy == Strategy::Dray {
                // The agent announces as it publishes the last hash; the
                // answer (the next run) comes a round trip later.
                self.schedule_announce(n, self.sc.rtt_s);
            }
        }
    }

    pub(super) fn poll(&mut self, n: u32) {
        let nu = n as usize;
        self.nodes[nu].poll_at = None;
        if !self.nodes[nu].alive || self.nodes[nu].done_at.is_some() {
            return;
        }
        if matches!(self.strategy, Strategy::Dray | Strategy::DrayDht) {
            let at = self.instant();
            let node = &mut self.nodes[nu];
            if node.downloads > 0
                || node.runs.iter().any(|r| r.flow.is_some())
                || !node.fallback_flows.is_empty()
            {
                node.fallback.busy(at);
            }
            node.fallback.escalate(at);
            self.continue_fallback(n);
        }
        self.try_fill(n);
    }

    /// Keeps `registry_parallel` registry fetches going for the chunks the
    /// fallback wants: every unclaimed one after a stall, those no known peer
    /// holds while the tracker is silent.
    pub(super) fn continue_fallback(&mut self, n: u32) {
        let nu = n as usize;
        let why = self.nodes[nu].fallback.mode();
        if why == Fallback::Off || !self.nodes[nu].alive {
            return;
        }
        for b in 0..self.blobs.len() {
            self.look_all(n, b);
            let chunks = self.blobs[b].chunks;
            while self.nodes[nu].fallback_flows.len() < self.sc.registry_parallel {
                let Some(p) = self.nodes[nu].blobs[b].picker.as_mut() else {
                    break;
                };
                let candidate = match why {
                    Fallback::All => (p.cursor()..chunks).find(|&c| p.is_unclaimed(c)),
                    _ => p.unavailable().find(|&c| p.is_unclaimed(c)),
                };
                let Some(c) = candidate else {
                    break;
                };
                p.claim(c);
                let id = self.registry_chunk(n, b as u16, c, Purpose::FallbackChunk);
                self.nodes[nu].fallback_flows.push(id);
            }
        }
    }

    /// The tracker answered: its runs take over from the fallback's registry
    /// fetches, whose chunks become pickable again.
    pub(super) fn end_tracker_fallback(&mut self, n: u32) {
        let nu = n as usize;
        for id in std::mem::take(&mut self.nodes[nu].fallback_flows) {
            let (p, _) = self.net.remove(id);
            remove_item(&mut self.nodes[nu].in_flows, id);
            if let Some(picker) = self.nodes[nu].blobs[p.blob as usize].picker.as_mut() {
                picker.failed(p.chunk);
            }
        }
    }

    /// Gives the picker a view of every live known peer it has not looked at.
    pub(super) fn look_all(&mut self, n: u32, b: usize) {
        let nu = n as usize;
        if !std::mem::take(&mut self.nodes[nu].blobs[b].unlooked) {
            return;
        }
        for slot in 0..self.nodes[nu].blobs[b].peers.live().len() {
            let p = self.nodes[nu].blobs[b].peers.live()[slot].key;
            if self.nodes[p as usize].alive {
                self.look(n, b, slot);
            }
        }
    }
}
