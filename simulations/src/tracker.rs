//! The tracker's scheduling core, run on a thread of its own.
//!
//! The simulation is sequential, but the tracker need not answer at once:
//! an announce's answer reaches the agent a round trip later, and the nodes
//! go on moving data meanwhile. So the simulated cluster sends each call
//! ([`Scheduler::announce`], `tick`, `leave`, a restart) down a channel in
//! simulated-time order and takes an announce's answer when its round trip
//! ends. The scheduler sees the same calls in the same order on every run,
//! so a seed still gives the same numbers; its work (mostly scoring
//! candidate peers) overlaps the rest of the simulation on the second core:
//! `storm-10k` took 62-65 s of wall time instead of 78-93 s.

use dray_protocol::BlobDigest;
use dray_protocol::scheduler::{
    Announce, AnnounceDecision, BadChunk, ScheduleError, Scheduler, SchedulerConfig, Silent,
};
use std::collections::BTreeSet;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

enum Call {
    Announce(Box<Announce>, Instant),
    Tick(Instant),
    Leave(String),
    /// The tracker took a chunk's hash (as its publication handler does).
    HashSettled(BlobDigest, u32, Instant),
    /// A peer reports a chunk that failed its hash.
    BadChunk(Box<BadChunk>, Instant),
    /// A peer reports a peer that left its request unanswered.
    Silent(Box<Silent>, Instant),
    /// The tracker restarts empty.
    Restart,
    /// Which peers bad-chunk reports have banned so far.
    Banned(Sender<Vec<String>>),
}

/// Calls sent to the thread together: each send may wake it, and a wake-up
/// costs more than a call (`storm-10k` 66-69 s one by one, 64-65 s in 16s,
/// alone; half the system time). An answer needed sooner flushes the batch.
const BATCH: usize = 16;

/// A [`Scheduler`] on its own thread; answers come back in the order the
/// announces were sent.
pub(crate) struct Tracker {
    calls: Option<Sender<Vec<Call>>>,
    /// Calls not yet sent (at most `BATCH`).
    batch: Vec<Call>,
    answers: Receiver<AnnounceDecision>,
    thread: Option<JoinHandle<()>>,
}

impl Tracker {
    pub fn new(config: SchedulerConfig) -> Self {
        let (calls, inbox) = channel::<Vec<Call>>();
        let (outbox, answers) = channel();
        let thread = std::thread::Builder::new()
            .name("sim-tracker".into())
            .spawn(move || {
                let mut sched = Scheduler::new(config.clone());
                let mut banned = BTreeSet::new();
                for call in inbox.into_iter().flatten() {
                    match call {
                        Call::Announce(a, at) => {
                            // The simulation is gone if nobody takes answers.
                            if outbox.send(sched.announce(*a, at)).is_err() {
                                return;
                            }
                        }
                        Call::Tick(at) => _ = sched.tick(at),
                        Call::Leave(peer) => _ = sched.leave(&peer),
                        Call::HashSettled(d, i, at) => sched.hash_settled(&d, i, at),
                        // Refused reports (an unknown peer, say) change nothing.
                        Call::BadChunk(r, at) => match sched.report_bad_chunk(&r, at) {
                            Ok(standing) if standing.banned => _ = banned.insert(r.offender),
                            Err(ScheduleError::ReporterBanned(reporter)) => {
                                _ = banned.insert(reporter)
                            }
                            _ => {}
                        },
                        Call::Silent(r, at) => _ = sched.report_silent(&r, at),
                        Call::Restart => sched = Scheduler::new(config.clone()),
                        Call::Banned(reply) => _ = reply.send(banned.iter().cloned().collect()),
                    }
                }
            })
            .expect("spawning the simulated tracker's thread");
        Self {
            calls: Some(calls),
            batch: Vec::with_capacity(BATCH),
            answers,
            thread: Some(thread),
        }
    }

    fn send(&mut self, call: Call) {
        self.batch.push(call);
        if self.batch.len() >= BATCH {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        self.calls
            .as_ref()
            .expect("calls are open until drop")
            .send(batch)
            .expect("the simulated tracker's thread is running");
    }

    /// Sends an announce; [`Tracker::answer`] returns its answer, after
    /// those of the announces sent before it.
    pub fn announce(&mut self, announce: Announce, at: Instant) {
        self.send(Call::Announce(Box::new(announce), at));
    }

    pub fn tick(&mut self, at: Instant) {
        self.send(Call::Tick(at));
    }

    pub fn leave(&mut self, peer: &str) {
        self.send(Call::Leave(peer.to_owned()));
    }

    pub fn hash_settled(&mut self, digest: BlobDigest, index: u32, at: Instant) {
        self.send(Call::HashSettled(digest, index, at));
    }

    pub fn report_bad_chunk(&mut self, report: BadChunk, at: Instant) {
        self.send(Call::BadChunk(Box::new(report), at));
    }

    pub fn report_silent(&mut self, report: Silent, at: Instant) {
        self.send(Call::Silent(Box::new(report), at));
    }

    /// The peers bad-chunk reports have banned (offenders, or reporters
    /// accusing too many), after every call sent so far.
    pub fn banned(&mut self) -> Vec<String> {
        let (reply, answer) = channel();
        self.send(Call::Banned(reply));
        self.flush();
        answer
            .recv()
            .expect("the simulated tracker answers every question")
    }

    pub fn restart(&mut self) {
        self.send(Call::Restart);
    }

    /// The answer to the oldest announce not yet answered (waits for it).
    pub fn answer(&mut self) -> AnnounceDecision {
        if let Ok(answer) = self.answers.try_recv() {
            return answer;
        }
        // It may still be in the batch.
        self.flush();
        self.answers
            .recv()
            .expect("the simulated tracker answers every announce")
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.calls = None;
        if let Some(thread) = self.thread.take() {
            // A panic there has already been reported; the answers it owed
            // failed loudly on this side.
            _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dray_protocol::BlobDigest;
    use dray_protocol::scheduler::{BlobAnnounce, Held};
    use std::collections::BTreeMap;

    fn announce(peer: &str, digest: BlobDigest) -> Announce {
        Announce {
            peer: peer.to_owned(),
            address: String::new(),
            upload_bytes_per_s: 1,
            active_uploads: 0,
            labels: BTreeMap::new(),
            blobs: vec![BlobAnnounce {
                digest,
                chunk_count: 4,
                size: 4 << 20,
                chunk_size: 1 << 20,
                held: Held::Bits(dray_protocol::Bitfield::new(4)),
                wanted: true,
                origin: String::new(),
                ranges_ignored: false,
            }],
            full: true,
        }
    }

    #[test]
    fn answers_as_the_scheduler_does_in_the_order_asked() {
        let config = SchedulerConfig::default();
        let digest = BlobDigest::of(b"layer");
        let at = Instant::now();
        let mut tracker = Tracker::new(config.clone());
        let mut direct = Scheduler::new(config);
        for peer in ["a", "b", "c"] {
            tracker.announce(announce(peer, digest), at);
        }
        tracker.leave("b");
        tracker.announce(announce("a", digest), at);
        for peer in ["a", "b", "c"] {
            let want = direct.announce(announce(peer, digest), at);
            assert_eq!(tracker.answer(), want);
        }
        direct.leave("b");
        let want = direct.announce(announce("a", digest), at);
        assert_eq!(tracker.answer(), want);
    }
}
