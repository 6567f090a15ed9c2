//! The pull machine: one pull's registry runs and fallback, as a state
//! machine with the time passed in and the transfer's [`ChunkPicker`] read
//! (never written) for what is held, in flight and offered.
//!
//! Its driver feeds it:
//! - [`PullMachine::answered`]: the tracker's news (or the DHT
//!   coordinator's): whether it sees a registry fetch of the blob under way,
//!   and the registry runs it hands this node;
//! - [`PullMachine::tracker_failed`]: the tracker client is failing;
//! - [`PullMachine::run_ended`]: a run it started ended, for whatever reason;
//! - [`PullMachine::poll`]: how many chunks are held now, and whether the
//!   blob failed its digest; the machine escalates its fallback and plans
//!   registry runs for free slots.
//!
//! and carries out the [`Action`]s it answers with: start a registry run,
//! stop one, note a fallback, give up.
//!
//! Three rules that the agent and the simulator once each wrote their own
//! way are this machine's, once:
//! - **A run missing from a complete answer was taken back** and is stopped
//!   (the tracker lists every live run a node holds; it took this one back
//!   as stalled and gave it to another node, so fetching on sends its chunks
//!   from the registry twice). The DHT coordinator's lists are partial
//!   (`runs_complete` false) and stop nothing.
//! - **The fallback fetches runs of up to `run_chunks` consecutive chunks**,
//!   not single chunks: a run is one registry request after another on one
//!   connection, and the tracker's runs are cut the same way, so the
//!   fallback's registry load has the shape the scheduler plans for.
//! - **Fallback state is per pull** (per blob): one blob whose peers vanished
//!   does not send a node's other pulls, which are being served, to the
//!   registry.
//!
//! Chunks inside a live run are never planned into another run: a run
//! claims its chunks one at a time as it reaches them (so that a chunk a
//! peer delivers first is skipped), and without this a fallback planned
//! while a run is under way fetched the run's later chunks too.

use super::fallback::{Fallback, FallbackRule};
use crate::picker::ChunkPicker;
use crate::planted::{self, Bug};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The timings and limits of a pull (`swarm.*` in the agent's settings).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullConfig {
    /// Tracker silence after which chunks no peer gives come from the
    /// registry; `Duration::MAX` with no tracker configured.
    pub tracker_grace: Duration,
    /// Nothing arrived and nothing in flight for this long: every chunk
    /// comes from the registry.
    pub stall: Duration,
    /// Stall periods a registry fetch the tracker reports holds the stall rule.
    pub patience: u32,
    /// Chunks per registry run of the fallback.
    pub run_chunks: u32,
    /// Registry runs under way at once, beyond which the fallback plans none.
    pub registry_parallel: usize,
}

/// A run the machine started, named in [`Action::Start`] and [`Action::Stop`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u64);

/// Who a registry run is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// Handed out by the tracker or the DHT coordinator.
    Assigned,
    /// The tracker-silence fallback's: stopped when the tracker answers.
    Silent,
    /// The fallback's, to the end of the pull (starved or stalled).
    Fallback,
}

/// What the driver does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Fetch chunks `[first, first + count)` from the registry, claiming
    /// each as it is reached and skipping those held or in flight; report
    /// the end with [`PullMachine::run_ended`].
    Start {
        run: RunId,
        first: u32,
        count: u32,
        kind: RunKind,
    },
    /// Stop that run; the chunk it has in flight is released. Its end is
    /// still reported.
    Stop(RunId),
    /// The pull falls back to the registry in this mode (log it, count it).
    FellBack(Fallback),
    /// Nothing arrived for `stall`: said once per quiet spell.
    Quiet,
    /// The stall rule fired while every chunk is held and the blob failed
    /// its digest: the registry has nothing left to give; the pull fails.
    RecheckStalled,
    /// The tracker answers after a spell it could not be heard: publish the
    /// hashes of every chunk held again. Those fetched from the registry in
    /// the meantime were published to nobody, and until the tracker has
    /// them no other node can verify, so take, those chunks.
    Republish,
}

/// The tracker's (or the DHT coordinator's) news for this pull.
#[derive(Clone, Copy, Debug)]
pub struct News<'a> {
    /// A registry fetch of the blob is under way somewhere.
    pub fetching: bool,
    /// Registry runs handed to this node, `(first, count)`.
    pub runs: &'a [(u32, u32)],
    /// `runs` lists every live run of this node (a tracker's answer does).
    pub runs_complete: bool,
}

#[derive(Clone, Copy, Debug)]
struct Run {
    first: u32,
    count: u32,
    kind: RunKind,
    /// Not yet stopped.
    live: bool,
}

impl Run {
    fn covers(&self, chunk: u32) -> bool {
        self.live && chunk >= self.first && chunk - self.first < self.count
    }
}

/// One pull's registry runs and fallback.
#[derive(Clone, Debug)]
pub struct PullMachine {
    config: PullConfig,
    rule: FallbackRule,
    /// Alone: the swarm is not used; every chunk from the registry.
    alone: bool,
    /// Runs started and not yet reported ended (stopped ones included:
    /// they hold a registry slot until they end).
    runs: BTreeMap<RunId, Run>,
    next_run: u64,
    held: u32,
    /// The current quiet spell was reported.
    quiet: bool,
    /// The tracker failed or fell silent since its last answer.
    missed: bool,
    /// A starved pull's chunks: those no peer could give when the rule
    /// fired and not held or offered since, ascending.
    starved: Vec<u32>,
}

impl PullMachine {
    /// A pull starting at `now` with `held` chunks; `alone` pulls with no
    /// swarm (no tracker, or a swarm that cannot be trusted with the blob).
    pub fn new(now: Instant, alone: bool, held: u32, config: PullConfig) -> Self {
        let rule = FallbackRule::new(
            now,
            alone,
            config.tracker_grace,
            config.stall,
            config.patience,
        );
        Self {
            config,
            rule,
            alone,
            runs: BTreeMap::new(),
            next_run: 0,
            held,
            quiet: false,
            missed: false,
            starved: Vec::new(),
        }
    }

    pub fn mode(&self) -> Fallback {
        self.rule.mode()
    }

    /// The fallback rules' state, for logs.
    pub fn rule(&self) -> &FallbackRule {
        &self.rule
    }

    /// Runs started and not yet ended.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// The tracker client is failing: what it reported being fetched is
    /// not news any more.
    pub fn tracker_failed(&mut self) {
        self.rule.tracker_failed();
        self.missed = true;
    }

    /// News at `now`. A tracker-silence fallback ends (its runs stop, their
    /// chunks become pickable again); runs a complete answer leaves out
    /// stop; runs handed out that are not under way start (a run handed out
    /// again after ours ended starts again: ours may have skipped a chunk
    /// then in flight from a peer that has since gone).
    pub fn answered(&mut self, now: Instant, news: News<'_>, out: &mut Vec<Action>) {
        if self.rule.tracker_answered(now, news.fetching) {
            self.stop_where(|r| r.kind == RunKind::Silent, out);
            self.missed = true;
        }
        if std::mem::take(&mut self.missed) {
            out.push(Action::Republish);
        }
        if self.alone {
            return;
        }
        if news.runs_complete {
            self.stop_where(
                |r| r.kind == RunKind::Assigned && !news.runs.iter().any(|&(f, _)| f == r.first),
                out,
            );
        }
        for &(first, count) in news.runs {
            let running = self
                .runs
                .values()
                .any(|r| r.live && r.kind == RunKind::Assigned && r.first == first);
            if !running {
                self.start(first, count, RunKind::Assigned, out);
            }
        }
    }

    /// Run `run` ended: done, stopped or failed.
    pub fn run_ended(&mut self, run: RunId) {
        self.runs.remove(&run);
    }

    /// Progress at `now`: `held` chunks are held, `failed` the blob failed
    /// its digest, and `published(c)` says whether chunk `c`'s hash is
    /// published (somebody holds it). Escalates the fallback when its rules
    /// say so, and plans registry runs into free slots for the chunks the
    /// fallback wants (none in flight, none in a live run): every chunk not
    /// held after a stall, those no usable peer holds while the tracker is
    /// silent, and those of them that were published when the pull starved,
    /// until each is held or offered by a peer (the starvation is then over).
    pub fn poll<P: Clone + Eq + std::hash::Hash>(
        &mut self,
        now: Instant,
        (held, failed): (u32, bool),
        picker: &ChunkPicker<P>,
        published: impl Fn(u32) -> bool,
        out: &mut Vec<Action>,
    ) {
        if held != self.held {
            self.held = held;
            self.rule.arrived(now);
            self.quiet = false;
        }
        // Chunks in flight count as progress: only a swarm with nothing to
        // offer is stalled.
        if picker.in_flight() > 0 {
            self.rule.busy(now);
        }
        if self.rule.quiet_for(now) > self.config.stall && !std::mem::replace(&mut self.quiet, true)
        {
            out.push(Action::Quiet);
        }
        let published = |c| published(c) || planted::is(Bug::StarveUnpublished);
        // Published chunks no peer gives and nothing claims.
        let starving = || {
            picker
                .unavailable()
                .filter(|&c| picker.is_unclaimed(c) && published(c))
        };
        let starvable = || {
            (picker.banned_any() || planted::is(Bug::StarveUnpublished))
                && starving().next().is_some()
        };
        if let Some(mode) = self.rule.escalate(now, starvable) {
            if mode == Fallback::All && failed {
                out.push(Action::RecheckStalled);
                return;
            }
            if mode == Fallback::Starved {
                self.starved = starving().collect();
            }
            out.push(Action::FellBack(mode));
        }
        if self.rule.mode() == Fallback::Starved {
            self.starved_still_wanted(picker);
        }
        self.plan(picker, out);
    }

    /// Keeps the starved chunks that are neither held nor offered by a peer;
    /// with none left, the starvation is over.
    fn starved_still_wanted<P: Clone + Eq + std::hash::Hash>(&mut self, picker: &ChunkPicker<P>) {
        let mut wanted = self.starved.iter().copied().peekable();
        let mut kept = Vec::with_capacity(self.starved.len());
        for c in picker.unavailable() {
            while wanted.next_if(|&w| w < c).is_some() {}
            if wanted.next_if_eq(&c).is_some() {
                kept.push(c);
            }
        }
        self.starved = kept;
        if self.starved.is_empty() {
            self.rule.starvation_over();
        }
    }

    /// Starts fallback runs into free registry slots.
    fn plan<P: Clone + Eq + std::hash::Hash>(
        &mut self,
        picker: &ChunkPicker<P>,
        out: &mut Vec<Action>,
    ) {
        let kind = match self.rule.mode() {
            Fallback::Off => return,
            Fallback::Unavailable => RunKind::Silent,
            Fallback::Starved | Fallback::All => RunKind::Fallback,
        };
        if self.runs.len() >= self.config.registry_parallel {
            return;
        }
        let mode = self.rule.mode();
        let wanted: Vec<u32> = match mode {
            Fallback::All => picker.unclaimed().collect(),
            Fallback::Starved => self
                .starved
                .iter()
                .copied()
                .filter(|&c| picker.is_unclaimed(c))
                .collect(),
            _ => picker
                .unavailable()
                .filter(|&c| picker.is_unclaimed(c))
                .collect(),
        };
        let wanted: Vec<u32> = wanted
            .into_iter()
            .filter(|&c| !self.runs.values().any(|r| r.covers(c)))
            .collect();
        let mut wanted = wanted.into_iter().peekable();
        while self.runs.len() < self.config.registry_parallel {
            let Some(first) = wanted.next() else { break };
            let mut count = 1;
            while count < self.config.run_chunks && wanted.next_if_eq(&(first + count)).is_some() {
                count += 1;
            }
            self.start(first, count, kind, out);
        }
    }

    fn start(&mut self, first: u32, count: u32, kind: RunKind, out: &mut Vec<Action>) {
        let run = RunId(self.next_run);
        self.next_run += 1;
        self.runs.insert(
            run,
            Run {
                first,
                count,
                kind,
                live: true,
            },
        );
        out.push(Action::Start {
            run,
            first,
            count,
            kind,
        });
    }

    fn stop_where(&mut self, stop: impl Fn(&Run) -> bool, out: &mut Vec<Action>) {
        for (&id, r) in &mut self.runs {
            if r.live && stop(r) {
                r.live = false;
                out.push(Action::Stop(id));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Bitfield;

    const GRACE: Duration = Duration::from_secs(3);
    const STALL: Duration = Duration::from_secs(30);

    fn config() -> PullConfig {
        PullConfig {
            tracker_grace: GRACE,
            stall: STALL,
            patience: 4,
            run_chunks: 4,
            registry_parallel: 2,
        }
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn picker(chunks: u32, held: &[u32]) -> ChunkPicker<u8> {
        let mut bits = Bitfield::new(chunks);
        for &c in held {
            bits.set(c);
        }
        ChunkPicker::new(bits, 8)
    }

    /// Every chunk's hash is published.
    fn all(_: u32) -> bool {
        true
    }

    fn starts(out: &[Action]) -> Vec<(u32, u32, RunKind)> {
        out.iter()
            .filter_map(|a| match *a {
                Action::Start {
                    first, count, kind, ..
                } => Some((first, count, kind)),
                _ => None,
            })
            .collect()
    }

    fn stops(out: &[Action]) -> Vec<RunId> {
        out.iter()
            .filter_map(|a| match *a {
                Action::Stop(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    fn run_ids(out: &[Action]) -> Vec<RunId> {
        out.iter()
            .filter_map(|a| match *a {
                Action::Start { run, .. } => Some(run),
                _ => None,
            })
            .collect()
    }

    fn news(runs: &[(u32, u32)], complete: bool) -> News<'_> {
        News {
            fetching: false,
            runs,
            runs_complete: complete,
        }
    }

    #[test]
    fn the_runs_of_an_answer_start_once_and_again_after_they_ended() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let mut out = Vec::new();
        m.answered(t0, news(&[(0, 4), (8, 4)], true), &mut out);
        assert_eq!(
            starts(&out),
            [(0, 4, RunKind::Assigned), (8, 4, RunKind::Assigned)]
        );
        let ids = run_ids(&out);
        out.clear();
        m.answered(t0 + s(1), news(&[(0, 4), (8, 4)], true), &mut out);
        assert!(out.is_empty(), "under way: {out:?}");
        m.run_ended(ids[0]);
        m.answered(t0 + s(2), news(&[(0, 4), (8, 4)], true), &mut out);
        assert_eq!(starts(&out), [(0, 4, RunKind::Assigned)]);
    }

    #[test]
    fn a_run_a_complete_answer_leaves_out_is_stopped_a_partial_list_stops_nothing() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let mut out = Vec::new();
        m.answered(t0, news(&[(0, 4), (8, 4)], true), &mut out);
        let ids = run_ids(&out);
        out.clear();
        m.answered(t0, news(&[(8, 4)], false), &mut out);
        assert!(out.is_empty(), "the DHT coordinator's list is partial");
        m.answered(t0, news(&[(8, 4)], true), &mut out);
        assert_eq!(stops(&out), [ids[0]]);
        out.clear();
        // Stopped, it still holds its slot until it ends; handed out
        // again, it starts anew.
        assert_eq!(m.runs(), 2);
        m.answered(t0, news(&[(0, 4), (8, 4)], true), &mut out);
        assert_eq!(starts(&out), [(0, 4, RunKind::Assigned)]);
    }

    #[test]
    fn a_silent_tracker_brings_runs_of_what_no_peer_holds_and_its_answer_stops_them() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let mut p = picker(16, &[]);
        // A peer holds chunks 4..8: only the others are unavailable.
        let mut theirs = Bitfield::new(16);
        for c in 4..8 {
            theirs.set(c);
        }
        p.set_peer(1, theirs);
        let mut out = Vec::new();
        m.poll(t0 + s(2), (0, false), &p, all, &mut out);
        assert!(out.is_empty());
        m.poll(t0 + s(4), (0, false), &p, all, &mut out);
        assert_eq!(out[0], Action::FellBack(Fallback::Unavailable));
        assert_eq!(
            starts(&out),
            [(0, 4, RunKind::Silent), (8, 4, RunKind::Silent)],
            "runs of run_chunks, skipping what a peer holds, two slots"
        );
        let ids = run_ids(&out);
        out.clear();
        m.answered(t0 + s(5), news(&[], true), &mut out);
        assert_eq!(stops(&out), ids);
        assert!(out.contains(&Action::Republish), "{out:?}");
        assert_eq!(m.mode(), Fallback::Off);
        // A failing tracker client, then an answer: republish once.
        out.clear();
        m.tracker_failed();
        m.answered(t0 + s(6), news(&[], true), &mut out);
        m.answered(t0 + s(7), news(&[], true), &mut out);
        assert_eq!(out, [Action::Republish]);
    }

    #[test]
    fn a_stall_plans_every_unclaimed_chunk_outside_live_runs() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, true, 0, config());
        let mut p = picker(12, &[1]);
        let mut out = Vec::new();
        m.poll(t0, (1, false), &p, all, &mut out);
        assert_eq!(
            starts(&out),
            [(0, 1, RunKind::Fallback), (2, 4, RunKind::Fallback)],
            "held chunk 1 splits the runs"
        );
        let ids = run_ids(&out);
        out.clear();
        // The first run claimed its chunk; the second has claimed only its first.
        assert!(p.claim(0));
        assert!(p.claim(2));
        m.run_ended(ids[0]);
        m.poll(t0, (1, false), &p, all, &mut out);
        assert_eq!(
            starts(&out),
            [(6, 4, RunKind::Fallback)],
            "chunks 3..6 are the live run's"
        );
        out.clear();
        m.run_ended(ids[1]);
        m.poll(t0, (1, false), &p, all, &mut out);
        assert_eq!(starts(&out), [(3, 3, RunKind::Fallback)]);
    }

    #[test]
    fn a_starved_pull_takes_only_published_chunks_no_peer_gives() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let mut p = picker(12, &[]);
        let mut out = Vec::new();
        // Nothing published: the tracker has yet to hand those chunks out.
        for at in 1..=10 {
            m.answered(t0 + s(at), news(&[], true), &mut out);
            m.poll(t0 + s(at), (0, false), &p, |_| false, &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
        // Chunks 2, 3 and 9 are published (held somewhere), and no peer
        // gives them: while the pull dropped no peer, the tracker's next
        // peers may (in a large storm the newest chunks take a while to
        // spread), and the pull waits.
        let published = |c| [2, 3, 9].contains(&c);
        m.answered(t0 + s(11), news(&[], true), &mut out);
        m.poll(t0 + s(11), (0, false), &p, published, &mut out);
        assert!(out.is_empty(), "{out:?}");
        // Once it dropped one, they come from the registry.
        p.ban(&1);
        m.poll(t0 + s(11), (0, false), &p, published, &mut out);
        assert_eq!(out[0], Action::FellBack(Fallback::Starved));
        assert_eq!(
            starts(&out),
            [(2, 2, RunKind::Fallback), (9, 1, RunKind::Fallback)]
        );
    }

    #[test]
    fn a_starvation_ends_once_its_chunks_are_held_or_offered() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let mut p = picker(12, &[]);
        p.ban(&1);
        let mut out = Vec::new();
        m.answered(t0 + s(4), news(&[], true), &mut out);
        m.poll(t0 + s(4), (0, false), &p, |c| [2, 3].contains(&c), &mut out);
        assert_eq!(out[0], Action::FellBack(Fallback::Starved));
        let run = run_ids(&out)[0];
        assert_eq!(starts(&out), [(2, 2, RunKind::Fallback)]);
        // The run fetches chunk 2; a peer joins with chunk 3.
        out.clear();
        assert!(p.claim(2));
        p.completed(2);
        m.poll(t0 + s(5), (1, false), &p, all, &mut out);
        assert_eq!(m.mode(), Fallback::Starved, "chunk 3 is still wanted");
        p.set_peer(7, {
            let mut b = Bitfield::new(12);
            b.set(3);
            b
        });
        m.poll(t0 + s(5), (1, false), &p, all, &mut out);
        assert_eq!(m.mode(), Fallback::Off, "back on the swarm");
        m.run_ended(run);
        // Every other chunk is published now, and no peer gives it: the
        // pull starves again only after another quiet `tracker_grace`.
        for at in 6..=8 {
            m.answered(t0 + s(at), news(&[], true), &mut out);
            m.poll(t0 + s(at), (1, false), &p, all, &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
        m.poll(t0 + s(9), (1, false), &p, all, &mut out);
        assert_eq!(out[0], Action::FellBack(Fallback::Starved));
        assert_eq!(
            starts(&out),
            [(0, 2, RunKind::Fallback), (4, 4, RunKind::Fallback)]
        );
    }

    #[test]
    fn a_pull_alone_ignores_the_runs_it_is_handed() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, true, 0, config());
        let mut out = Vec::new();
        m.answered(t0, news(&[(0, 4)], true), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn arrivals_hold_the_rules_and_a_stall_on_a_failed_blob_gives_up() {
        let t0 = Instant::now();
        let mut m = PullMachine::new(t0, false, 0, config());
        let p = picker(4, &[0, 1, 2, 3]);
        let mut out = Vec::new();
        for at in 1..=29 {
            m.answered(t0 + s(at), news(&[], true), &mut out);
            // A chunk every second: neither starved nor stalled.
            m.poll(t0 + s(at), (at as u32, false), &p, all, &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
        // Then nothing, and the tracker falls silent: past `stall` the
        // stall rule fires, on a blob every chunk of which is held.
        m.poll(t0 + s(60), (29, true), &p, all, &mut out);
        assert_eq!(out, [Action::Quiet, Action::RecheckStalled]);
        out.clear();
        m.poll(t0 + s(61), (29, true), &p, all, &mut out);
        assert!(out.is_empty(), "said once: {out:?}");
    }
}
