//! DHT coordination: a pull without a tracker finds the blob's members
//! through the DHT, hands itself the registry runs its rank among the
//! fetchers gives it, and picks which members to watch.

use super::{Swarm, Update};
use crate::discovery::advertise::{self};
use crate::discovery::dht::{Dht, NodeRecord};
use crate::pull::fetch::{PeerAddr, Transfer};
use dray_protocol::dht::{
    FETCHERS, counted_fetchers, dht_runs, lookup_after, overflow_list, pick_peers,
};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

impl Swarm {
    /// A pull's stand-in for the tracker when there is none, or while every
    /// replica is down (it waits while one answers: the tracker's runs
    /// come first). Every `dht.lookup` it hands the transfer the blob's
    /// other holders and pullers as peers, whose word it takes for chunk
    /// hashes; it asks the DHT for them again at that pace while they
    /// change, and less often while they stay the same ([`lookup_after`]).
    /// A node the blob's list leaves out joins an overflow list
    /// ([`overflow_list`]), whose members are peers, not fetchers. After
    /// `dht.settle` (time for the other pullers of a storm to show up), it
    /// also hands the pull its registry runs ([`dht_runs`]) among the
    /// blob's fetchers: its first candidates by
    /// [`dray_protocol::dht::fetcher_rank`] ([`FETCHERS`]) that answered
    /// this pull's bitfield request (which every puller makes of them; no
    /// runs while one is still to answer), so a member named by a forged
    /// list, that neither holds nor pulls the blob, is never given blocks
    /// to wait for; with every candidate failed here, the pull fetches
    /// alone. A fetcher's blocks that never come are fetched by the stall
    /// fallback.
    pub(super) async fn coordinate(
        self: Arc<Self>,
        dht: Arc<Dht>,
        t: Arc<Transfer>,
        updates: watch::Sender<Update>,
    ) {
        let digest = t.blob().digest();
        let Ok(local) = self.node.local_addr() else {
            return;
        };
        let me = self.node.peer_id().to_string();
        let mut standing_in: Option<Instant> = None;
        // The members last found (the reachable fetcher candidates, watched
        // ones of the blob's own list and of this node's overflow list, and
        // whether the DHT lists this node and it is a candidate), and how
        // many answers in a row named them.
        let mut found: Option<Found> = None;
        // The overflow list this node provides the blob in, once its own
        // list is full without it.
        let mut overflow = None;
        let mut asked_at = Instant::now();
        let mut unchanged = 0;
        loop {
            let tracker_answers = self.tracker.is_configured() && !self.tracker.all_down();
            match (tracker_answers, standing_in) {
                (true, None) => {}
                (true, Some(_)) => {
                    tracing::info!(%digest, "a tracker replica answers again: its runs take over from the DHT's");
                    standing_in = None;
                }
                (false, None) => {
                    if self.tracker.is_configured() {
                        tracing::warn!(%digest, "every tracker replica is down: finding peers through the DHT");
                    }
                    t.take_hashes_from_peers();
                    // Only now: while a tracker answers, it names the peers.
                    dht.provide(&digest).await;
                    standing_in = Some(Instant::now());
                }
                (false, Some(since)) => {
                    let due = asked_at.elapsed() >= lookup_after(dht.config().lookup, unchanged);
                    let watch = self.node.config.max_peers_per_blob.saturating_sub(FETCHERS);
                    let now = match found.clone() {
                        Some(kept) if !due => kept,
                        _ => {
                            let gone = |p: &str| t.is_gone(p);
                            let members = dht.members(&digest, overflow, watch, gone).await;
                            asked_at = Instant::now();
                            if !members.listed && overflow.is_none() {
                                let list = overflow_list(&me);
                                tracing::info!(%digest, list, "the blob's list in the DHT is full: joining an overflow list");
                                dht.provide_overflow(&digest, list).await;
                                overflow = Some(list);
                            }
                            let reachable = |records: Vec<NodeRecord>| {
                                let mut peers: Vec<PeerAddr> = records
                                    .into_iter()
                                    .filter_map(|m| {
                                        Some(PeerAddr {
                                            addr: advertise::reachable(&m.address, local)?,
                                            peer_id: m.peer_id,
                                        })
                                    })
                                    .collect();
                                peers.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
                                peers
                            };
                            let now = Found {
                                fetchers: reachable(members.fetchers),
                                peers: reachable(members.others),
                                more: reachable(members.overflow),
                                fetcher: members.fetcher,
                            };
                            unchanged = if found.as_ref() == Some(&now) {
                                unchanged + 1
                            } else {
                                0
                            };
                            found = Some(now.clone());
                            now
                        }
                    };
                    let mut runs = Vec::new();
                    if since.elapsed() >= dht.config().settle {
                        // The candidates that answered here (every puller
                        // asks the same ones): the set every puller computes
                        // the same, once none is still to answer. This node
                        // only if it is a candidate (nobody else counts it),
                        // or if every other failed here.
                        let live: Vec<(&str, bool)> = now
                            .fetchers
                            .iter()
                            .filter(|p| !t.is_gone(&p.peer_id))
                            .map(|p| (p.peer_id.as_str(), t.has_shown(&p.peer_id)))
                            .collect();
                        let fetchers = counted_fetchers(&me, now.fetcher, &live);
                        let mut held = t.held_by_peers();
                        for i in t.blob().held().ones() {
                            held.set(i);
                        }
                        runs = dht_runs(
                            &digest,
                            &me,
                            fetchers.into_iter(),
                            &held,
                            self.config.run_chunks,
                        );
                        // As many as run at once: the next come as these finish.
                        runs.truncate(self.config.registry_parallel.max(1));
                    }
                    updates.send_replace(Update {
                        tracker_ok: true,
                        fetching: false,
                        runs_complete: false,
                        // Its overflow list's members are peers, not fetchers.
                        peers: self.dht_peers(now, &t),
                        runs,
                        map: None,
                    });
                }
            }
            tokio::time::sleep(dht.config().lookup).await;
        }
    }

    /// Of a blob's members, the peers a pull without a tracker hands its
    /// transfer: the fetcher candidates that have not failed there (asked
    /// by every puller, so that each learns which answer), then those of
    /// the blob's list (`peers`) and of its overflow list (`more`) that
    /// have not failed there nor refused to be watched (at their watcher
    /// cap), up to `peer.max_peers_per_blob` in all, half from each list
    /// if it can ([`pick_peers`]), in an order of this node's own (a hash
    /// of both ids), so that each node watches a different few of a large
    /// swarm, and the same few at every lookup.
    fn dht_peers(&self, found: Found, t: &Transfer) -> Vec<PeerAddr> {
        let fit = |mut v: Vec<PeerAddr>| {
            v.retain(|p| !t.is_gone(&p.peer_id) && !t.is_refused(&p.peer_id));
            v
        };
        let mut peers: Vec<PeerAddr> = found
            .fetchers
            .into_iter()
            .filter(|p| !t.is_gone(&p.peer_id))
            .collect();
        let room = self
            .node
            .config
            .max_peers_per_blob
            .saturating_sub(peers.len());
        if room > 0 {
            peers.extend(pick_peers(
                self.node.peer_id(),
                fit(found.peers),
                fit(found.more),
                |p| p.peer_id.as_str(),
                room,
            ));
        }
        peers
    }
}

/// The members a pull without a tracker last found through the DHT (see
/// [`crate::discovery::dht::Members`]), with the addresses it can reach them at.
#[derive(Clone, Debug, PartialEq)]
struct Found {
    fetchers: Vec<PeerAddr>,
    peers: Vec<PeerAddr>,
    more: Vec<PeerAddr>,
    fetcher: bool,
}
