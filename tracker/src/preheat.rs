//! Preheat jobs, as the coordinating replica keeps them (see
//! [`dray_protocol::preheat`]): which nodes a job chose, spread over zones
//! and racks, and how far each is. Soft state like the rest of the tracker:
//! a restarted coordinator has no jobs, and `dray preheat` says so.
//!
//! A job's nodes are chosen from the members this replica knows (every
//! `dray agent` announces to the coordinator at least every `idle_announce`),
//! filtered by the request's labels, then taken one zone at a time and,
//! within a zone, one rack at a time, so that a 25% preheat of three zones
//! lands in all three. A node learns its jobs from announce answers until
//! it reports each done or failed; a chosen node that leaves the tracker
//! before that is reported failed.

use dray_protocol::pb;
use dray_protocol::preheat::{
    MAX_ERROR_BYTES, MAX_ID_BYTES, MAX_IMAGE_BYTES, MAX_JOBS, MAX_NODE_JOBS, NodeProgress,
    NodeState, PreheatJob, PreheatRequest, wanted,
};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::Instant;

/// Label keys read as a node's zone (the first present), and as its rack.
const ZONE_KEYS: [&str; 2] = ["topology.kubernetes.io/zone", "zone"];
const RACK_KEYS: [&str; 2] = ["topology.kubernetes.io/rack", "rack"];

/// Why a preheat request was refused (HTTP 400, or 503 for `NoNodes`).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PreheatError {
    #[error("preheat request: {0}")]
    Invalid(String),
    #[error("no node to preheat: {0}")]
    NoNodes(String),
    #[error(
        "this replica keeps {MAX_JOBS} preheat jobs and none of them has ended: wait for one to end"
    )]
    TooMany,
}

struct Node {
    peer_id: String,
    labels: BTreeMap<String, String>,
    state: NodeState,
    have: u64,
    size: u64,
    error: Option<String>,
}

struct Job {
    id: String,
    image: String,
    matched: u32,
    made: Instant,
    nodes: Vec<Node>,
    /// Each node's place in `nodes`: every announce asks for its node.
    at: HashMap<String, usize>,
}

impl Job {
    fn ended(&self) -> bool {
        self.nodes.iter().all(|n| n.state.is_final())
    }

    fn node(&self, peer: &str) -> Option<&Node> {
        self.at.get(peer).map(|&i| &self.nodes[i])
    }
}

/// The jobs this replica coordinates, oldest first.
#[derive(Default)]
pub struct Jobs {
    jobs: VecDeque<Job>,
}

fn label<'a>(labels: &'a BTreeMap<String, String>, keys: &[&str]) -> &'a str {
    keys.iter()
        .find_map(|k| labels.get(*k))
        .map_or("", String::as_str)
}

/// A member: its peer id and topology labels.
pub type Member<'a> = (&'a str, &'a BTreeMap<String, String>);

/// `n` of `members`, spread over zones, then racks: each round takes one
/// node of every zone, each zone's turn the next of its racks. Within a
/// rack the order is a hash of `seed` and the peer id, so that jobs with
/// other seeds land on other nodes.
pub fn choose<'a>(members: &[Member<'a>], n: usize, seed: &str) -> Vec<Member<'a>> {
    type Racks<'a> = BTreeMap<&'a str, VecDeque<Member<'a>>>;
    let mut zones: BTreeMap<&str, Racks<'a>> = BTreeMap::new();
    let mut ranked: Vec<(u64, &'a str, &'a BTreeMap<String, String>)> = members
        .iter()
        .map(|&(id, labels)| {
            let mut h = std::hash::DefaultHasher::new();
            (seed, id).hash(&mut h);
            (h.finish(), id, labels)
        })
        .collect();
    ranked.sort();
    for (_, id, labels) in ranked {
        zones
            .entry(label(labels, &ZONE_KEYS))
            .or_default()
            .entry(label(labels, &RACK_KEYS))
            .or_default()
            .push_back((id, labels));
    }
    // Each zone's nodes, one rack at a time.
    let mut per_zone: Vec<VecDeque<Member<'a>>> = zones
        .into_values()
        .map(|mut racks| {
            let mut order = VecDeque::new();
            while racks.values().any(|r| !r.is_empty()) {
                for r in racks.values_mut() {
                    order.extend(r.pop_front());
                }
            }
            order
        })
        .collect();
    let mut chosen = Vec::with_capacity(n);
    while chosen.len() < n && per_zone.iter().any(|z| !z.is_empty()) {
        for z in &mut per_zone {
            if chosen.len() == n {
                break;
            }
            chosen.extend(z.pop_front());
        }
    }
    chosen
}

/// Checks a request's fields before anything is chosen.
fn check(req: &PreheatRequest) -> Result<(), PreheatError> {
    let bad = |m: String| Err(PreheatError::Invalid(m));
    if req.image.is_empty() {
        return bad("no image named".into());
    }
    if req.image.len() > MAX_IMAGE_BYTES {
        return bad(format!(
            "the image reference is {} bytes, more than {MAX_IMAGE_BYTES}",
            req.image.len()
        ));
    }
    if req
        .image
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return bad(format!("{:?} is not an image reference", req.image));
    }
    if req.count.is_some() && req.percent.is_some() {
        return bad("give a count or a percent, not both".into());
    }
    if req.count == Some(0) {
        return bad("a count of 0 nodes preheats nothing".into());
    }
    if let Some(p) = req.percent
        && !(p > 0.0 && p <= 100.0)
    {
        return bad(format!("percent {p} is not in (0, 100]"));
    }
    if req.labels.len() > crate::MAX_LABELS {
        return bad(format!(
            "{} labels, more than {}",
            req.labels.len(),
            crate::MAX_LABELS
        ));
    }
    if let Some(long) = req
        .labels
        .iter()
        .flat_map(|(k, v)| [k, v])
        .find(|s| s.len() > crate::MAX_LABEL_BYTES)
    {
        return bad(format!(
            "a label of {} bytes, more than {}",
            long.len(),
            crate::MAX_LABEL_BYTES
        ));
    }
    Ok(())
}

/// A report field cut to `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Jobs {
    /// Starts a job on nodes chosen among `members` (this replica's, with
    /// their labels).
    pub fn start(
        &mut self,
        req: &PreheatRequest,
        members: &[Member],
        now: Instant,
    ) -> Result<PreheatJob, PreheatError> {
        check(req)?;
        let matching: Vec<_> = members
            .iter()
            .filter(|(_, labels)| req.labels.iter().all(|(k, v)| labels.get(k) == Some(v)))
            .copied()
            .collect();
        if matching.is_empty() {
            let wanted_labels: Vec<String> =
                req.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            return Err(PreheatError::NoNodes(if wanted_labels.is_empty() {
                "no agent has announced to this replica yet".into()
            } else {
                format!(
                    "none of the {} agents known here is labelled {}",
                    members.len(),
                    wanted_labels.join(",")
                )
            }));
        }
        if self.jobs.len() >= MAX_JOBS {
            let ended = self.jobs.iter().position(Job::ended);
            self.jobs.remove(ended.ok_or(PreheatError::TooMany)?);
        }
        let id = format!("{:016x}", fastrand::u64(..));
        let n = wanted(matching.len(), req.count, req.percent);
        let nodes: Vec<Node> = choose(&matching, n, &id)
            .into_iter()
            .map(|(peer, labels)| Node {
                peer_id: peer.to_string(),
                labels: labels.clone(),
                state: NodeState::Queued,
                have: 0,
                size: 0,
                error: None,
            })
            .collect();
        let at = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.peer_id.clone(), i))
            .collect();
        self.jobs.push_back(Job {
            id: id.clone(),
            image: req.image.clone(),
            matched: u32::try_from(matching.len()).unwrap_or(u32::MAX),
            made: now,
            nodes,
            at,
        });
        Ok(self.view(&id, now).expect("just made"))
    }

    /// Jobs kept, ended ones included.
    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }

    /// Chosen nodes that have not ended their jobs.
    pub fn pending_nodes(&self) -> usize {
        self.jobs
            .iter()
            .flat_map(|j| &j.nodes)
            .filter(|n| !n.state.is_final())
            .count()
    }

    /// A job as clients see it.
    pub fn view(&self, id: &str, now: Instant) -> Option<PreheatJob> {
        let job = self.jobs.iter().find(|j| j.id == id)?;
        let nodes: Vec<NodeProgress> = job
            .nodes
            .iter()
            .map(|n| NodeProgress {
                peer_id: n.peer_id.clone(),
                labels: n.labels.clone(),
                state: n.state,
                have: n.have,
                size: n.size,
                error: n.error.clone(),
            })
            .collect();
        Some(PreheatJob {
            id: job.id.clone(),
            image: job.image.clone(),
            matched: job.matched,
            done: nodes.iter().all(|n| n.state == NodeState::Done),
            failed: nodes
                .iter()
                .filter(|n| n.state == NodeState::Failed)
                .count() as u32,
            nodes,
            age_s: now.saturating_duration_since(job.made).as_secs_f64(),
        })
    }

    /// Takes in `peer`'s reports (checked: at most [`MAX_NODE_JOBS`], ids
    /// and errors within their limits). A report of a job that did not
    /// choose `peer`, or that it already ended, changes nothing.
    pub fn note(&mut self, peer: &str, reports: &[pb::PreheatStatus]) {
        for r in reports {
            let Some(node) = self.jobs.iter_mut().find(|j| j.id == r.id).and_then(|j| {
                let i = *j.at.get(peer)?;
                Some(&mut j.nodes[i])
            }) else {
                continue;
            };
            if node.state.is_final() {
                continue;
            }
            node.state = NodeState::of(r.state());
            node.have = r.have;
            node.size = r.size;
            node.error = (!r.error.is_empty()).then(|| cut(&r.error, MAX_ERROR_BYTES));
        }
    }

    /// The jobs `peer` was chosen for and has not ended.
    pub fn tasks_for(&self, peer: &str) -> Vec<pb::PreheatTask> {
        self.jobs
            .iter()
            .filter(|j| j.node(peer).is_some_and(|n| !n.state.is_final()))
            .map(|j| pb::PreheatTask {
                id: j.id.clone(),
                image: j.image.clone(),
            })
            .collect()
    }

    /// Chosen nodes that are no longer members (expired, or left) fail the
    /// jobs they had not ended: nobody would report them.
    pub fn forget_gone(&mut self, known: impl Fn(&str) -> bool) {
        for n in self.jobs.iter_mut().flat_map(|j| j.nodes.iter_mut()) {
            if !n.state.is_final() && !known(&n.peer_id) {
                n.state = NodeState::Failed;
                n.error = Some("the node left the tracker before it finished".into());
            }
        }
    }
}

/// Checks a node's reports before the state's lock: their count and sizes.
pub fn check_reports(reports: &[pb::PreheatStatus]) -> Result<(), String> {
    if reports.len() > MAX_NODE_JOBS {
        return Err(format!(
            "{} preheat reports, more than {MAX_NODE_JOBS}",
            reports.len()
        ));
    }
    if let Some(r) = reports.iter().find(|r| r.id.len() > MAX_ID_BYTES) {
        return Err(format!(
            "a preheat job id of {} bytes, more than {MAX_ID_BYTES}",
            r.id.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(zone: &str, rack: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("zone".to_string(), zone.to_string()),
            ("rack".to_string(), rack.to_string()),
        ])
    }

    #[test]
    fn nodes_are_spread_over_zones_then_racks() {
        let mut ids = Vec::new();
        let mut labels = Vec::new();
        for z in ["a", "b", "c"] {
            for r in ["1", "2"] {
                for i in 0..4 {
                    ids.push(format!("{z}{r}-{i}"));
                    labels.push(labelled(z, r));
                }
            }
        }
        let members: Vec<_> = ids.iter().map(String::as_str).zip(labels.iter()).collect();
        let zone_rack = |id: &str| id[..2].to_string();
        let ids_of = |chosen: Vec<Member>| -> Vec<String> {
            chosen.into_iter().map(|(id, _)| id.to_string()).collect()
        };
        let three = ids_of(choose(&members, 3, "job-1"));
        let mut zones: Vec<_> = three.iter().map(|id| &id[..1]).collect();
        zones.sort();
        assert_eq!(zones, ["a", "b", "c"], "{three:?}");
        let six = ids_of(choose(&members, 6, "job-1"));
        let mut places: Vec<_> = six.iter().map(|id| zone_rack(id)).collect();
        places.sort();
        assert_eq!(places, ["a1", "a2", "b1", "b2", "c1", "c2"], "{six:?}");
        assert_eq!(choose(&members, 100, "job-1").len(), 24);
        // Another job's seed picks other nodes within the same places.
        let other: Vec<_> = (0..8)
            .map(|s| ids_of(choose(&members, 6, &format!("job-{s}"))))
            .collect();
        assert!(other.iter().any(|o| o != &six), "every seed chose {six:?}");
    }

    fn status(id: &str, state: pb::preheat_status::State) -> pb::PreheatStatus {
        pb::PreheatStatus {
            id: id.into(),
            state: state as i32,
            have: 10,
            size: 20,
            error: String::new(),
        }
    }

    #[test]
    fn a_job_tasks_its_nodes_until_they_report_it_ended() {
        use pb::preheat_status::State;
        let now = Instant::now();
        let none = BTreeMap::new();
        let members = [("n1", &none), ("n2", &none), ("n3", &none), ("n4", &none)];
        let mut jobs = Jobs::default();
        let req = PreheatRequest {
            image: "127.0.0.1:5000/app:1".into(),
            percent: Some(50.0),
            ..Default::default()
        };
        let job = jobs.start(&req, &members, now).unwrap();
        assert_eq!((job.matched, job.nodes.len(), job.done), (4, 2, false));
        let chosen: Vec<String> = job.nodes.iter().map(|n| n.peer_id.clone()).collect();
        let idle = members
            .iter()
            .map(|m| m.0)
            .find(|m| !chosen.iter().any(|c| c == m))
            .unwrap();
        assert!(jobs.tasks_for(idle).is_empty());
        assert_eq!(jobs.tasks_for(&chosen[0])[0].image, req.image);
        // A report from a node the job did not choose changes nothing.
        jobs.note(idle, &[status(&job.id, State::Done)]);
        jobs.note(&chosen[0], &[status(&job.id, State::Pulling)]);
        let seen = jobs.view(&job.id, now).unwrap();
        assert_eq!(seen.nodes[0].state, NodeState::Pulling);
        assert_eq!((seen.nodes[0].have, seen.nodes[0].size), (10, 20));
        jobs.note(&chosen[0], &[status(&job.id, State::Done)]);
        jobs.note(&chosen[1], &[status(&job.id, State::Done)]);
        assert!(jobs.tasks_for(&chosen[0]).is_empty());
        let seen = jobs.view(&job.id, now).unwrap();
        assert!(seen.done && seen.ended(), "{seen:?}");
        // An ended node's state is final.
        jobs.note(&chosen[0], &[status(&job.id, State::Pulling)]);
        assert!(jobs.view(&job.id, now).unwrap().done);
    }

    #[test]
    fn a_chosen_node_that_leaves_fails_its_job() {
        let now = Instant::now();
        let none = BTreeMap::new();
        let mut jobs = Jobs::default();
        let req = PreheatRequest {
            image: "r/app:1".into(),
            ..Default::default()
        };
        let job = jobs
            .start(&req, &[("n1", &none), ("n2", &none)], now)
            .unwrap();
        jobs.forget_gone(|p| p == "n1");
        let seen = jobs.view(&job.id, now).unwrap();
        assert_eq!(seen.failed, 1);
        assert!(!seen.ended());
        assert!(jobs.tasks_for("n2").is_empty());
    }

    #[test]
    fn bad_requests_are_refused_with_what_is_wrong() {
        let now = Instant::now();
        let zone_a = labelled("a", "1");
        let members = [("n1", &zone_a)];
        let mut jobs = Jobs::default();
        let refused = |jobs: &mut Jobs, req: PreheatRequest| {
            jobs.start(&req, &members, now).unwrap_err().to_string()
        };
        let image = |s: &str| PreheatRequest {
            image: s.into(),
            ..Default::default()
        };
        assert!(refused(&mut jobs, image("")).contains("no image named"));
        assert!(refused(&mut jobs, image(&"x".repeat(600))).contains("600 bytes"));
        assert!(refused(&mut jobs, image("a b")).contains("is not an image reference"));
        let mut r = image("r/a:1");
        r.percent = Some(0.0);
        assert!(refused(&mut jobs, r.clone()).contains("not in (0, 100]"));
        r.percent = None;
        r.count = Some(0);
        assert!(refused(&mut jobs, r.clone()).contains("preheats nothing"));
        r.count = None;
        r.labels.insert("zone".into(), "b".into());
        assert_eq!(
            refused(&mut jobs, r),
            "no node to preheat: none of the 1 agents known here is labelled zone=b"
        );
        assert!(
            Jobs::default()
                .start(&image("r/a:1"), &[], now)
                .unwrap_err()
                .to_string()
                .contains("no agent has announced")
        );
    }

    #[test]
    fn jobs_are_bounded_and_the_oldest_ended_one_goes_first() {
        use pb::preheat_status::State;
        let now = Instant::now();
        let none = BTreeMap::new();
        let members = [("n1", &none)];
        let mut jobs = Jobs::default();
        let req = PreheatRequest {
            image: "r/a:1".into(),
            ..Default::default()
        };
        let first = jobs.start(&req, &members, now).unwrap();
        for _ in 1..MAX_JOBS {
            jobs.start(&req, &members, now).unwrap();
        }
        assert_eq!(jobs.start(&req, &members, now), Err(PreheatError::TooMany));
        let second = jobs.jobs[1].id.clone();
        jobs.note("n1", &[status(&second, State::Failed)]);
        jobs.start(&req, &members, now).unwrap();
        assert!(jobs.view(&second, now).is_none());
        assert!(jobs.view(&first.id, now).is_some());
        let too_many: Vec<_> = (0..=MAX_NODE_JOBS)
            .map(|i| status(&i.to_string(), State::Done))
            .collect();
        assert!(
            check_reports(&too_many)
                .unwrap_err()
                .contains("more than 16")
        );
        let long_id = [status(&"f".repeat(MAX_ID_BYTES + 1), State::Done)];
        assert!(
            check_reports(&long_id)
                .unwrap_err()
                .contains("33 bytes, more than 32")
        );
    }
}
