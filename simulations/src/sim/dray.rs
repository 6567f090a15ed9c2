//! The dray node model: announces, the tracker's answers, and the registry
//! runs that each pull's machine (`dray_protocol::pull::PullMachine`, the
//! agent's) starts and stops; this file carries its actions out and
//! decides nothing of its own about the registry.

use super::*;
use disturbances::Exit;
use dray_protocol::defaults::registry_retry_after;

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
        if !self.tracker_up || self.nodes[nu].cut_off {
            // The agent's request fails (or hangs past `HUNG_AFTER`), and
            // its pulls hear so.
            self.tracker_failed(n);
            return;
        }
        self.send_announce(n);
    }

    /// Sends `n`'s announce (full if the tracker asked for one, else what
    /// it gained since); the answer comes a round trip later.
    pub(super) fn send_announce(&mut self, n: u32) {
        let nu = n as usize;
        let full = self.nodes[nu].need_full;
        // A withholder also says its registry ignores `Range`: if the
        // tracker took a few members' word, it would hand them runs to the
        // blob's end, a blob's worth of chunks nobody else gets.
        let withholds = self.nodes[nu].withholds;
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
                    ranges_ignored: nb.whole_answer || withholds,
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
        for b in 0..self.blobs.len() {
            if !self.nodes[nu].blobs[b].complete {
                self.report_bad_chunks(n, b);
                self.report_silent(n, b);
            }
        }
        if full {
            // Calls reach the tracker in order: its swarms exist for
            // whatever is published after this.
            self.tracked.fill(true);
        }
        self.net.after(self.sc.rtt_s, Ev::Answer(n, full));
    }

    /// The tracker's answer to `n`'s announce (`full` if it was) arrives.
    pub(super) fn answered(&mut self, n: u32, full: bool) {
        let nu = n as usize;
        let d = self.sched.answer();
        if !self.nodes[nu].alive {
            return;
        }
        // Lost with the connection if the tracker went down or the node was
        // cut off from it: the agent's request fails, and its pulls hear so.
        if !self.tracker_up || self.nodes[nu].cut_off {
            self.tracker_failed(n);
            return;
        }
        if d.resend_full {
            // An answer all the same (it ends a tracker-silence fallback),
            // with no runs; a restarted tracker asks for a full announce:
            // send it straight away.
            for b in 0..self.blobs.len() {
                let fetching = d.fetching.contains(&self.blobs[b].digest);
                let news = News {
                    fetching,
                    runs: &[],
                    runs_complete: false,
                };
                self.pull_news(n, b, news);
            }
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
                if self.nodes[n as usize].accuses && self.reaches_tracker(n) {
                    self.send_silent(n, b as usize, p, 0);
                    self.send_bad_chunk(n, b as usize, p, 0);
                }
            }
        }
        for b in 0..self.blobs.len() {
            let digest = self.blobs[b].digest;
            let runs: Vec<(u32, u32)> = d
                .assignments
                .iter()
                .filter(|a| a.digest == digest)
                .map(|a| (a.first, a.count))
                .collect();
            let news = News {
                fetching: d.fetching.contains(&digest),
                runs: &runs,
                runs_complete: true,
            };
            self.pull_news(n, b, news);
        }
    }

    /// `n`'s request to the tracker failed: each of its pulls hears so.
    fn tracker_failed(&mut self, n: u32) {
        for nb in &mut self.nodes[n as usize].blobs {
            if let Some(m) = nb.pull.as_mut() {
                m.tracker_failed();
            }
        }
    }

    /// `n`'s pull of blob `b` takes news from the tracker or the DHT
    /// coordinator; what its machine decides is carried out.
    pub(super) fn pull_news(&mut self, n: u32, b: usize, news: News<'_>) {
        let at = self.instant();
        let Some(m) = self.nodes[n as usize].blobs[b].pull.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        m.answered(at, news, &mut out);
        self.carry_out(n, b, out);
    }

    /// `n`'s pull of blob `b` checks its rules against what it holds now,
    /// as the agent's pull engine does on every wake-up.
    pub(super) fn pull_poll(&mut self, n: u32, b: usize) {
        let at = self.instant();
        let nb = &mut self.nodes[n as usize].blobs[b];
        let (Some(m), Some(picker)) = (nb.pull.as_mut(), nb.picker.as_ref()) else {
            return;
        };
        let mut out = Vec::new();
        let known = &nb.known;
        m.poll(
            at,
            (nb.held.count(), false),
            picker,
            |c| known.get(c),
            &mut out,
        );
        self.carry_out(n, b, out);
    }

    /// Carries out a pull machine's actions.
    fn carry_out(&mut self, n: u32, b: usize, out: Vec<Action>) {
        for action in out {
            match action {
                Action::Start {
                    run, first, count, ..
                } => self.start_run(n, b as u16, run, first, count),
                Action::Stop(run) => {
                    let runs = &mut self.nodes[n as usize].runs;
                    // Run ids are per pull: a node's runs of its blobs share them.
                    if let Some(k) = runs.iter().position(|r| r.id == run && r.blob == b as u16) {
                        let state = runs.swap_remove(k);
                        self.release_run(n, state);
                    }
                    self.run_ended(n, b, run);
                }
                Action::FellBack(mode) => self.fallbacks.record(mode, self.net.now()),
                Action::Republish => {
                    if self.reaches_tracker(n) {
                        let held: Vec<u32> = self.nodes[n as usize].blobs[b].held.ones().collect();
                        for c in held {
                            self.publish(b, c);
                        }
                    }
                }
                // A simulated blob never fails its digest; nothing to log.
                Action::Quiet | Action::RecheckStalled => {}
            }
        }
    }

    /// Run `run` of `n`'s pull of blob `b` ended.
    fn run_ended(&mut self, n: u32, b: usize, run: RunId) {
        if let Some(m) = self.nodes[n as usize].blobs[b].pull.as_mut() {
            m.run_ended(run);
        }
    }

    /// `n` fetches chunks `[first, first + count)` of blob `b` from the
    /// registry in order, less those it holds or has on their way.
    fn start_run(&mut self, n: u32, b: u16, id: RunId, first: u32, count: u32) {
        let nu = n as usize;
        let nb = &mut self.nodes[nu].blobs[b as usize];
        let chunks = match nb.picker.as_mut() {
            Some(p) => (first..first.saturating_add(count))
                .filter(|&c| p.claim(c))
                .collect(),
            None => Vec::new(),
        };
        self.nodes[nu].runs.push(RunState {
            id,
            blob: b,
            chunks,
            next: 0,
            flow: None,
            attempts: 0,
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
        if let Admit::Added { retired: Some(old) } = nb.peers.admit(p, PeerView::default()) {
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

    /// Which of `n`'s runs flow `id` is fetching for.
    pub(super) fn run_of_flow(&self, n: u32, id: FlowId) -> Option<usize> {
        self.nodes[n as usize]
            .runs
            .iter()
            .position(|r| r.flow == Some(id))
    }

    /// Fetches the run's next chunk, or finishes the run and announces.
    pub(super) fn advance_run(&mut self, n: u32, k: usize) {
        let run = &self.nodes[n as usize].runs[k];
        if let Some(&c) = run.chunks.get(run.next) {
            let b = run.blob;
            if self.registry_failing() {
                self.adversity.registry_errors += 1;
                // The error comes back a round trip later.
                self.retry_later(n, k, self.sc.rtt_s);
                return;
            }
            if self.token_refused(n) {
                // The 401's round trip and the token server's, then the
                // request again.
                let retry = Ev::Retry(n, b, self.nodes[n as usize].runs[k].id.0);
                self.net.after(2.0 * self.sc.rtt_s, retry);
                return;
            }
            let purpose = match self.registry_cutting() {
                true => Purpose::RunChunkCut,
                false => Purpose::RunChunk,
            };
            let id = self.registry_chunk(n, b, c, purpose);
            self.nodes[n as usize].runs[k].flow = Some(id);
        } else {
            let run = self.nodes[n as usize].runs.swap_remove(k);
            self.run_ended(n, run.blob as usize, run.id);
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

    /// The request for run `k`'s next chunk failed (a server error, known
    /// `known_in` seconds from now, or a cut body): `n` sends it again
    /// after the agent's registry client's backoff, and a request whose
    /// last attempt failed fails the run, and the pull with it (the
    /// agent's pull engine returns the run's error).
    pub(super) fn retry_later(&mut self, n: u32, k: usize, known_in: f64) {
        let run = &mut self.nodes[n as usize].runs[k];
        run.attempts += 1;
        let retry = Ev::Retry(n, run.blob, run.id.0);
        match registry_retry_after(run.attempts) {
            Some(wait) => {
                self.net.after(known_in + wait.as_secs_f64(), retry);
            }
            None => {
                self.adversity.failed_pulls += 1;
                // It pulls no more: gone, as far as this storm is concerned.
                self.leave(n, Exit::Crash);
            }
        }
    }

    /// `n` sends again the request its run `run` of blob `b` was refused,
    /// if the run was not stopped meanwhile.
    pub(super) fn retry(&mut self, n: u32, b: u16, run: RunId) {
        let nu = n as usize;
        if !self.nodes[nu].alive {
            return;
        }
        if let Some(k) = self.nodes[nu]
            .runs
            .iter()
            .position(|r| r.id == run && r.blob == b && r.flow.is_none())
        {
            self.advance_run(n, k);
        }
    }

    pub(super) fn poll(&mut self, n: u32) {
        let nu = n as usize;
        self.nodes[nu].poll_at = None;
        if !self.nodes[nu].alive || self.nodes[nu].done_at.is_some() {
            return;
        }
        for b in 0..self.blobs.len() {
            // The fallback's runs are planned from what known peers offer.
            if self.nodes[nu].blobs[b].pull.is_some() {
                self.look_all(n, b);
            }
            self.pull_poll(n, b);
        }
        self.try_fill(n);
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
