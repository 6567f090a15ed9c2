//! The preheat jobs this node was handed (see [`dray_protocol::preheat`]):
//! what it reports to the coordinating replica in its announces, and the
//! hand-off of new jobs to whatever runs them (`dray agent`'s local API,
//! which resolves the image and pulls its blobs through the swarm).
//!
//! Bounded: at most [`MAX_NODE_JOBS`] jobs are kept; a new one past that
//! takes the place of the oldest ended one, or waits for the tracker to
//! offer it again. A job id seen before is not started again.

use dray_protocol::pb::{self, preheat_status::State};
use dray_protocol::preheat::MAX_NODE_JOBS;
use std::sync::Mutex;
use tokio::sync::mpsc;

/// A new job for the runner.
pub type Task = pb::PreheatTask;

#[derive(Default)]
pub struct Preheats {
    /// Oldest first.
    jobs: Mutex<Vec<pb::PreheatStatus>>,
    /// Where new jobs go; none: this agent runs no preheats (no local API),
    /// and reports each job failed.
    runner: Mutex<Option<mpsc::UnboundedSender<Task>>>,
}

fn ended(s: &pb::PreheatStatus) -> bool {
    matches!(s.state(), State::Done | State::Failed)
}

impl Preheats {
    /// Jobs from now on go to `runner`.
    pub fn set_runner(&self, runner: mpsc::UnboundedSender<Task>) {
        *lock(&self.runner) = Some(runner);
    }

    /// Whether this agent runs preheat jobs (then it announces to the
    /// coordinating replica even when it holds nothing there, to be chosen).
    pub fn runs_jobs(&self) -> bool {
        lock(&self.runner).is_some()
    }

    /// What the next announce to the coordinator reports.
    pub fn reports(&self) -> Vec<pb::PreheatStatus> {
        lock(&self.jobs).clone()
    }

    /// Takes the jobs of an announce answer: those not seen before start.
    pub fn offer(&self, tasks: Vec<Task>) {
        let mut jobs = lock(&self.jobs);
        for task in tasks {
            if jobs.iter().any(|j| j.id == task.id) {
                continue;
            }
            if jobs.len() >= MAX_NODE_JOBS {
                let Some(oldest_ended) = jobs.iter().position(ended) else {
                    tracing::warn!(id = %task.id, image = %task.image, "{MAX_NODE_JOBS} preheat jobs under way: this one waits for the tracker to offer it again");
                    continue;
                };
                jobs.remove(oldest_ended);
            }
            let mut status = pb::PreheatStatus {
                id: task.id.clone(),
                ..Default::default()
            };
            let sent = lock(&self.runner)
                .as_ref()
                .is_some_and(|r| r.send(task.clone()).is_ok());
            if sent {
                tracing::info!(id = %task.id, image = %task.image, "preheat job started");
            } else {
                status.set_state(State::Failed);
                status.error = "this agent runs no preheat jobs (it serves no local API)".into();
            }
            jobs.push(status);
        }
    }

    /// A job's progress: `have` of `size` bytes of the image's blobs.
    pub fn progress(&self, id: &str, have: u64, size: u64) {
        self.update(id, |s| {
            s.set_state(State::Pulling);
            (s.have, s.size) = (have, size);
        });
    }

    /// A job ended: done, or failed with why.
    pub fn finish(&self, id: &str, result: Result<(), String>) {
        self.update(id, |s| match result {
            Ok(()) => {
                s.set_state(State::Done);
                s.have = s.size;
            }
            Err(e) => {
                s.set_state(State::Failed);
                s.error = e;
            }
        });
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut pb::PreheatStatus)) {
        if let Some(s) = lock(&self.jobs).iter_mut().find(|s| s.id == id) {
            f(s);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str) -> Task {
        Task {
            id: id.into(),
            image: "r/app:1".into(),
        }
    }

    #[test]
    fn a_job_starts_once_and_reports_until_it_ends() {
        let p = Preheats::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        p.set_runner(tx);
        p.offer(vec![task("a"), task("a")]);
        p.offer(vec![task("a")]);
        assert_eq!(rx.try_recv().unwrap().id, "a");
        assert!(rx.try_recv().is_err(), "a job offered again started again");
        p.progress("a", 5, 10);
        assert_eq!(p.reports()[0].state(), State::Pulling);
        p.finish("a", Ok(()));
        let r = &p.reports()[0];
        assert_eq!((r.state(), r.have, r.size), (State::Done, 10, 10));
    }

    #[test]
    fn without_a_runner_a_job_fails_with_why() {
        let p = Preheats::default();
        p.offer(vec![task("a")]);
        let r = &p.reports()[0];
        assert_eq!(r.state(), State::Failed);
        assert!(r.error.contains("no local API"), "{}", r.error);
    }

    #[test]
    fn jobs_are_bounded_and_an_ended_one_makes_room() {
        let p = Preheats::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        p.set_runner(tx);
        p.offer((0..MAX_NODE_JOBS).map(|i| task(&i.to_string())).collect());
        p.offer(vec![task("late")]);
        assert_eq!(p.reports().len(), MAX_NODE_JOBS);
        assert!(!p.reports().iter().any(|r| r.id == "late"));
        p.finish("3", Err("no".into()));
        p.offer(vec![task("late")]);
        let ids: Vec<String> = p.reports().into_iter().map(|r| r.id).collect();
        assert!(ids.contains(&"late".to_string()) && !ids.contains(&"3".to_string()));
    }
}
