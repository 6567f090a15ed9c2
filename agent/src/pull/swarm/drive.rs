//! The pull driver: one blob's pull from start to a verified blob. It feeds
//! the pull's news (tracker answers, DHT findings, timers, lanes and runs
//! ending) to the blob's [`dray_protocol::pull::PullMachine`] and carries
//! out its actions (start and stop registry runs, fall back, recheck a
//! chunk), and starts again, or alone, when the assembled blob fails its
//! digest.

use super::registry_runs::{check_chunk, fetch_run};
use super::{PullReport, Swarm, Update, Want, lock};
use crate::error::{Error, Result};
use crate::pull::events::EventKind;
use crate::pull::fetch::Transfer;
use crate::pull::registry::RegistryClient;
use crate::serving::metrics::FallbackReason;
use dray_protocol::defaults::DEFAULTS;
use dray_protocol::pull::{Action, Arbiter, Fallback, News, PullConfig, PullMachine, RunId};
use dray_protocol::{BlobDigest, ChunkMap, VerifyError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

impl Swarm {
    /// Pulls a blob into the store, asking the registry its size first;
    /// returns when it is complete and verified.
    pub async fn pull(
        self: &Arc<Self>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        digest: BlobDigest,
    ) -> Result<PullReport> {
        let size = registry.blob_size(repo, &digest).await?;
        self.pull_sized(registry, repo, digest, size).await
    }

    /// Pulls a blob of `size` bytes (from a verified manifest, or the
    /// registry's answer to the caller's own access check: a wrong size
    /// fails the digest) into the store; returns when it is complete and
    /// verified. Its lines, and its tasks' (peer lanes, registry runs), are
    /// logged in a `pull` span naming the blob.
    #[tracing::instrument(name = "pull", skip_all, fields(%digest))]
    pub async fn pull_sized(
        self: &Arc<Self>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        digest: BlobDigest,
        size: u64,
    ) -> Result<PullReport> {
        let started = Instant::now();
        let timer = self.node.metrics().pull_started();
        let mut report = PullReport {
            digest: digest.to_string(),
            size,
            ..Default::default()
        };
        let dht = self.dht.clone();
        let mut alone = !self.tracker.is_configured() && dht.is_none();
        // Without a tracker to recheck a wrong map against the registry,
        // the first one sends the pull to the registry alone.
        let failures_before_alone = if dht.is_some() && !self.tracker.is_configured() {
            1
        } else {
            MAP_FAILURES_BEFORE_ALONE
        };
        let mut recut = false;
        // Wrong maps this node found itself (not replacements it was told of).
        let mut own_failures = 0;
        // Whose word each hash taken from a peer is, across attempts: a
        // liar ruled in one attempt stays out of the next.
        let mut arbiter = None;
        loop {
            let map = ChunkMap::unhashed(digest, size, self.config.chunk_size)?;
            let transfer = Transfer::start(&self.node, &map, true).await?;
            let chunks = transfer.blob().map().chunk_count();
            transfer.judged_by(
                arbiter
                    .get_or_insert_with(|| Arc::new(Mutex::new(Arbiter::new(chunks))))
                    .clone(),
            );
            let (tx, rx) = watch::channel(Update {
                tracker_ok: true,
                ..Default::default()
            });
            // Without a tracker, or while every replica is down, the DHT's
            // members and the rendezvous rule stand in for its answers.
            let _coordinator = match &dht {
                Some(dht) if !alone => {
                    let task = self
                        .clone()
                        .coordinate(dht.clone(), transfer.clone(), tx.clone());
                    Some(AbortOnDrop(tokio::spawn(task.in_current_span())))
                }
                _ => None,
            };
            lock(&self.wanted).insert(
                digest,
                Want {
                    updates: tx,
                    registry: registry.clone(),
                    repo: repo.to_owned(),
                    started,
                    transfer: transfer.clone(),
                },
            );
            self.poke.notify_one();
            let outcome = self
                .drive(&transfer, rx, registry, repo, alone, &mut report)
                .await;
            // Still wanted while a failure is reported: a node the tracker
            // saw give the blob up could not report it.
            let fetched = transfer.finish().await.inspect_err(|_| {
                lock(&self.wanted).remove(&digest);
            })?;
            report.resumed_chunks = report.resumed_chunks.max(fetched.resumed_chunks);
            report.chunks_from_peers += fetched.chunks_by_peer.values().sum::<u32>();
            report.bytes_from_peers += fetched.bytes_received;
            report.chunks_from_registry += fetched.chunks_from_registry;
            report.bytes_from_registry += fetched.bytes_from_registry;
            for (peer, index) in &fetched.slow_peers {
                let why = format!("chunk {index} past its deadline");
                self.events.record(
                    EventKind::Dropped,
                    digest.to_string(),
                    Some(peer.clone()),
                    why,
                );
            }
            report.slow_peers.extend(fetched.slow_peers.into_keys());
            report.extended_requests += fetched.extended_requests;
            report.liars.extend(fetched.liars);
            report.checks += fetched.checks;
            self.spawn_reports(&digest, &transfer);
            for (peer, index) in &fetched.bad_peers {
                report.bad_peers.push(peer.clone());
                let why = format!("chunk {index} failed its hash");
                self.events
                    .record(EventKind::Ban, digest.to_string(), Some(peer.clone()), why);
            }
            if alone || !matches!(&outcome, Err(e) if is_map_failure(e)) {
                lock(&self.wanted).remove(&digest);
            }
            match outcome {
                Ok(()) => {
                    self.publish(transfer.blob()).await;
                    self.poke.notify_one();
                    report.seconds = started.elapsed().as_secs_f64();
                    timer.completed();
                    return Ok(report);
                }
                // Once: the swarm's geometry is the blob's now.
                Err(Error::Recut { chunk_size, .. }) if !recut => {
                    tracing::info!(%digest, chunk_size, "joining the swarm in its chunk size");
                    recut = true;
                    arbiter = None;
                }
                // Liars were found out: what was held on their word goes,
                // and the next attempt fetches it from others.
                Err(Error::Ruled { chunks, liars, .. }) => {
                    report.discarded_bytes += u64::from(chunks) * u64::from(map.chunk_size());
                    tracing::warn!(%digest, chunks, %liars, "dropped the chunks held on liars' word; fetching them again");
                }
                // A recheck found a wrong chunk held here: the new attempt
                // fetches what was dropped, through the swarm.
                Err(Error::Replaced { chunks, .. }) => {
                    report.map_failures += 1;
                    report.discarded_bytes += u64::from(chunks) * u64::from(map.chunk_size());
                    tracing::warn!(%digest, chunks, "the swarm replaced chunks held here; fetching them again");
                }
                Err(e) if is_map_failure(&e) && !alone => {
                    report.map_failures += 1;
                    own_failures += 1;
                    // A second wrong map of our own in one pull: the swarm
                    // cannot be trusted with this blob now, the registry
                    // alone can.
                    alone = own_failures >= failures_before_alone;
                    // The tracker believes a node once per report window.
                    if own_failures == 1 {
                        self.report_digest_failure(&transfer.blob().map(), registry.base())
                            .await;
                    }
                    if alone {
                        tracing::warn!(error = %e, %digest, "the published chunk map was wrong again; pulling the blob from the registry alone");
                        self.node.metrics().fell_back(FallbackReason::MapFailure);
                        self.events.record(
                            EventKind::Fallback,
                            digest.to_string(),
                            None,
                            format!("map_failure: {e}"),
                        );
                        report.discarded_bytes += transfer.blob().held_bytes();
                        lock(&self.wanted).remove(&digest);
                        self.forget(digest).await?;
                    } else {
                        tracing::warn!(error = %e, %digest, "the published chunk map was wrong; keeping the chunks while the swarm rechecks them against the registry");
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Drops `digest`'s file and record, to pull it anew.
    async fn forget(&self, digest: BlobDigest) -> Result<()> {
        let store = self.node.store().clone();
        tokio::task::spawn_blocking(move || store.remove(&digest)).await?
    }

    /// Runs one attempt of a pull until the blob completes or fails.
    async fn drive(
        self: &Arc<Self>,
        t: &Arc<Transfer>,
        mut rx: watch::Receiver<Update>,
        registry: &Arc<RegistryClient>,
        repo: &str,
        alone: bool,
        report: &mut PullReport,
    ) -> Result<()> {
        let digest = t.blob().digest();
        // The registry runs under way, each ending with its id, and the
        // token that stops each.
        let mut runs = tokio::task::JoinSet::new();
        let mut stops: HashMap<RunId, CancellationToken> = HashMap::new();
        // Chunks fetched from the registry to settle whose word was true.
        let mut checks = tokio::task::JoinSet::new();
        // With no tracker configured (the DHT's mode), no tracker can fall silent.
        let tracker_grace = match self.tracker.is_configured() {
            true => self.config.tracker_grace,
            false => Duration::MAX,
        };
        let mut machine = PullMachine::new(
            Instant::now(),
            alone,
            t.blob().held().count(),
            PullConfig {
                tracker_grace,
                stall: self.config.stall,
                patience: DEFAULTS.fetching_patience,
                run_chunks: self.config.run_chunks,
                registry_parallel: self.config.registry_parallel,
            },
        );
        let mut actions = Vec::new();
        let mut woke = false;
        loop {
            if let Some(e) = t.take_error() {
                return Err(e);
            }
            while let Some(done) = runs.try_join_next() {
                let (run, result) = done?;
                stops.remove(&run);
                machine.run_ended(run);
                match result {
                    // Failed with chunks on peers' word: checked below.
                    Err(Error::Verify(VerifyError::BlobDigest { .. }))
                        if t.blob().unvouched() > 0 => {}
                    r => r?,
                }
            }
            while let Some(done) = checks.try_join_next() {
                done??;
            }
            self.spawn_reports(&digest, t);
            if t.blob().is_complete() {
                return Ok(());
            }
            // Disputes, and after a failed digest the suspects: one chunk
            // from the registry each (see `dray_protocol::pull::arbiter`).
            let mut due: Vec<u32> = std::iter::from_fn(|| t.next_check()).collect();
            if checks.is_empty()
                && due.is_empty()
                && t.blob().is_failed()
                && t.blob().unvouched() > 0
            {
                match t.suspect() {
                    Some(index) => due.push(index),
                    // Every claimant's checked chunk held: a lie only the
                    // whole blob shows. The registry alone can serve it.
                    None => return Err(Error::RecheckStalled(digest)),
                }
            }
            for index in due {
                let task = check_chunk(t.clone(), registry.clone(), repo.to_string(), index);
                checks.spawn(task.in_current_span());
            }
            let now = Instant::now();
            if std::mem::take(&mut woke) || rx.has_changed().unwrap_or(false) {
                let u = rx.borrow_and_update().clone();
                if !u.tracker_ok {
                    machine.tracker_failed();
                } else {
                    if !alone {
                        self.take_news(t, &u)?;
                    }
                    let news = News {
                        fetching: u.fetching,
                        runs: &u.runs,
                        runs_complete: u.runs_complete,
                    };
                    machine.answered(now, news, &mut actions);
                }
            }
            // Chunks whose hashes are published: somebody holds them.
            let published = t.blob().known();
            let progress = (t.blob().held().count(), t.blob().is_failed());
            t.with_picker(|p| machine.poll(now, progress, p, |c| published.get(c), &mut actions));
            for action in actions.drain(..) {
                match action {
                    Action::Start {
                        run, first, count, ..
                    } => {
                        let stop = CancellationToken::new();
                        stops.insert(run, stop.clone());
                        let fetch = fetch_run(
                            self.clone(),
                            t.clone(),
                            registry.clone(),
                            repo.to_string(),
                            first,
                            count,
                            stop,
                        );
                        runs.spawn(async move { (run, fetch.await) }.in_current_span());
                    }
                    Action::Stop(run) => {
                        if let Some(stop) = stops.get(&run) {
                            tracing::info!(%digest, ?run, "stopping a registry run (taken back, or the tracker answers again)");
                            stop.cancel();
                        }
                    }
                    Action::FellBack(mode) => {
                        let reason = match mode {
                            Fallback::All => FallbackReason::Stall,
                            Fallback::Starved => FallbackReason::Starved,
                            _ => FallbackReason::TrackerSilent,
                        };
                        tracing::warn!(%digest, ?reason, tracker_silent_s = machine.rule().tracker_silent_for(now).as_secs_f64(), "falling back to the registry");
                        self.node.metrics().fell_back(reason);
                        self.events.record(
                            EventKind::Fallback,
                            digest.to_string(),
                            None,
                            reason.as_str().to_string(),
                        );
                        report.fell_back = true;
                    }
                    Action::Quiet => tracing::info!(
                        held = t.blob().held().count(),
                        chunks = t.blob().map().chunk_count(),
                        in_flight = t.in_flight(),
                        tracker_fetching = machine.rule().tracker_fetching(),
                        fallback = ?machine.mode(),
                        "no chunk arrived for swarm.stall; waiting on the requests in flight and the registry fetches the tracker reports"
                    ),
                    // Every chunk is held: the registry fallback has nothing
                    // to fetch, and the recheck found nothing wrong in time.
                    Action::RecheckStalled => return Err(Error::RecheckStalled(digest)),
                    Action::Republish => {
                        let (publisher, blob) = (self.clone(), t.blob().clone());
                        tokio::spawn(async move { publisher.publish(&blob).await });
                    }
                }
            }
            // `changed()` marks the value seen, so remember that it fired.
            woke = matches!(
                tokio::time::timeout(Duration::from_millis(50), rx.changed()).await,
                Ok(Ok(()))
            );
        }
    }

    /// Takes what a pull's news says of the swarm: the chunk map (joining
    /// the swarm's chunk geometry if it differs) and the peers.
    fn take_news(&self, t: &Arc<Transfer>, u: &Update) -> Result<()> {
        let digest = t.blob().digest();
        if let Some(m) = u
            .map
            .as_ref()
            .filter(|m| m.chunk_size() != t.blob().chunk_size())
        {
            // The swarm's first holders had another `swarm.chunk_size`:
            // join it in its chunks, unless this node holds chunks
            // of its own (then the registry fallback serves it).
            if t.blob().adopt_geometry(m)? {
                return Err(Error::Recut {
                    digest,
                    chunk_size: m.chunk_size(),
                });
            }
            tracing::warn!(%digest, swarm = m.chunk_size(), ours = t.blob().chunk_size(), "the swarm cuts this blob in other chunks than the ones held here");
        } else if let Some(m) = &u.map {
            match t.blob().adopt(m)? {
                (_, chunks @ 1..) => return Err(Error::Replaced { digest, chunks }),
                (1.., _) => t.nudge(),
                _ => {}
            }
        }
        for p in &u.peers {
            t.add_peer(p.clone());
        }
        Ok(())
    }
}

/// Wrong chunk maps one pull finds itself before it fetches the blob from
/// the registry alone. After the first the node keeps its chunks: once a
/// quorum of nodes reports the failure the tracker has the chunks fetched
/// again from the registry, a few at a time, until one differs, whose hash
/// it replaces; every node then fetches that chunk again from a peer (about
/// half a copy more of the blob from the registry on average, whatever the
/// node count). A second failure in the same pull means the swarm keeps
/// getting it wrong.
const MAP_FAILURES_BEFORE_ALONE: u32 = 2;

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Errors that mean the published chunk map cannot be trusted.
fn is_map_failure(e: &Error) -> bool {
    matches!(
        e,
        Error::RecheckStalled(_)
            | Error::Verify(VerifyError::BlobDigest { .. } | VerifyError::HashConflict { .. })
    )
}
