//! Peer transfers: filling a node's download slots from the peers it knows,
//! and the flows that carry chunks between nodes.

use super::*;

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
                if self.uploads[pu] >= max_up {
                    // The agent's request would be refused BUSY.
                    busy = true;
                    continue;
                }
                if !self.nodes[pu].alive {
                    gone.push(p);
                    continue;
                }
                while self.nodes[nu].downloads < max_down && self.uploads[pu] < max_up {
                    let Some(c) = self.nodes[nu].blobs[b]
                        .picker
                        .as_mut()
                        .and_then(|picker| picker.pick(&p))
                    else {
                        break;
                    };
                    self.nodes[nu].downloads += 1;
                    self.uploads[pu] += 1;
                    let bytes = self.chunk_bytes(b as u16, c);
                    let payload = Payload {
                        to: n,
                        from: Source::Peer(p),
                        blob: b as u16,
                        chunk: c,
                        purpose: Purpose::PeerChunk,
                    };
                    self.start_flow(payload, bytes);
                }
            }
            for p in gone {
                self.drop_peer(n, b, p);
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
