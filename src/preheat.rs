//! `dray preheat`: starts a preheat job at the tracker (see
//! `dray_protocol::preheat`) and follows it, with a progress bar per chosen
//! node, until every node holds the image or failed; with `--json`, the
//! job's last state as one JSON object. Exit status 0 only if every chosen
//! node holds the image.
//!
//! It speaks to the tracker as the agents do, with a certificate of the
//! cluster CA (the tracker must list its peer id in `preheaters`): the
//! certificate, key, CA and tracker replicas come from an agent
//! configuration file or the flags.

use anyhow::{Context, Result, bail};
use clap::Args;
use dray_agent::config::AgentConfig;
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::identity::Identity;
use dray_protocol::preheat::{NodeState, PreheatJob, PreheatRequest};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often the job's progress is read.
const POLL: Duration = Duration::from_millis(500);

#[derive(Args)]
pub struct PreheatArgs {
    /// Image reference, e.g. registry.example:5000/team/app:1.0.
    image: String,
    /// Preheat this many nodes (all that match, if fewer).
    #[arg(long, conflicts_with = "percent")]
    count: Option<u32>,
    /// Preheat this share of the matching nodes (rounded up).
    #[arg(long)]
    percent: Option<f64>,
    /// Only nodes announcing this topology label, KEY=VALUE; repeat for several.
    #[arg(long = "label", value_parser = key_value)]
    labels: Vec<(String, String)>,
    /// Give up after this long (e.g. 90s, 10m).
    #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print the job's final state as one JSON object instead of bars.
    #[arg(long)]
    json: bool,
    /// Agent configuration file: `cert`, `key`, `ca` and `swarm.trackers`.
    #[arg(long, short, env = "DRAY_AGENT_CONFIG")]
    config: Option<PathBuf>,
    /// A certificate of the cluster CA whose peer id the tracker's
    /// `preheaters` lists (overrides `cert`).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Its key (overrides `key`).
    #[arg(long)]
    key: Option<PathBuf>,
    /// The cluster CA certificate (overrides `ca`).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// A tracker replica URL; repeat for several (overrides `swarm.trackers`).
    #[arg(long = "tracker", env = "DRAY_TRACKERS", value_delimiter = ',')]
    trackers: Vec<String>,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// One line per chosen node: its id, state, bytes and labels.
fn summary(job: &PreheatJob) -> String {
    let mut text = String::new();
    for n in &job.nodes {
        let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        text += &format!(
            "{:<24} {:<8} {:>10} / {:<10} {}{}\n",
            n.peer_id,
            state_name(n.state),
            indicatif::HumanBytes(n.have).to_string(),
            indicatif::HumanBytes(n.size).to_string(),
            labels.join(","),
            n.error
                .as_deref()
                .map(|e| format!(" error: {e}"))
                .unwrap_or_default(),
        );
    }
    text
}

fn state_name(s: NodeState) -> &'static str {
    match s {
        NodeState::Queued => "queued",
        NodeState::Pulling => "pulling",
        NodeState::Done => "done",
        NodeState::Failed => "failed",
    }
}

pub async fn run(args: PreheatArgs) -> Result<()> {
    let cfg = match &args.config {
        Some(path) => AgentConfig::load(path)?,
        None => AgentConfig::default(),
    };
    let cert = args.cert.unwrap_or(cfg.cert);
    let key = args.key.unwrap_or(cfg.key);
    let ca = args.ca.unwrap_or(cfg.ca);
    let trackers = if args.trackers.is_empty() {
        cfg.swarm.trackers
    } else {
        args.trackers
    };
    if trackers.is_empty() {
        bail!("no tracker named: give --tracker URL, or --config with swarm.trackers");
    }
    let identity = Identity::load(&cert, &key, &ca).with_context(|| {
        format!(
            "loading the certificate to speak to the tracker with ({})",
            cert.display()
        )
    })?;
    let tracker = TrackerClient::new(trackers, &identity);
    let req = PreheatRequest {
        image: args.image.clone(),
        count: args.count,
        percent: args.percent,
        labels: args.labels.into_iter().collect::<BTreeMap<_, _>>(),
    };
    let (replica, mut job) = tracker
        .start_preheat(&req)
        .await
        .with_context(|| format!("starting the preheat of {}", args.image))?;
    if !args.json {
        eprintln!(
            "preheating {} on {} of {} nodes (job {} at {replica})",
            job.image,
            job.nodes.len(),
            job.matched,
            job.id
        );
    }
    let bars = MultiProgress::new();
    if args.json {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style =
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}")
            .expect("valid template")
            .progress_chars("=> ");
    let mut by_node: HashMap<String, ProgressBar> = HashMap::new();
    let started = Instant::now();
    let mut unreachable = 0;
    loop {
        for n in &job.nodes {
            let bar = by_node.entry(n.peer_id.clone()).or_insert_with(|| {
                let b = bars.add(ProgressBar::new(0).with_style(style.clone()));
                b.set_prefix(n.peer_id.clone());
                b
            });
            bar.set_length(n.size);
            bar.set_position(n.have);
            bar.set_message(match &n.error {
                Some(e) => format!("{}: {e}", state_name(n.state)),
                None => state_name(n.state).to_string(),
            });
        }
        if job.ended() || started.elapsed() > args.timeout {
            break;
        }
        tokio::time::sleep(POLL).await;
        match tracker.preheat(&replica, &job.id).await {
            Ok(j) => (job, unreachable) = (j, 0),
            // A moment's unreachability is no reason to give up on a job.
            Err(e) if unreachable < 10 => {
                unreachable += 1;
                tracing::warn!(error = %e, "could not read the preheat job's progress");
            }
            Err(e) => return Err(e).context("reading the preheat job's progress"),
        }
    }
    for bar in by_node.values() {
        bar.finish();
    }
    if args.json {
        println!("{}", serde_json::to_string(&job)?);
    } else {
        print!("{}", summary(&job));
    }
    let held = job
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Done)
        .count();
    if job.done {
        if !args.json {
            println!(
                "preheated {} on {held} nodes in {:.1} s",
                job.image,
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    } else if job.ended() {
        bail!(
            "preheating {}: {} of {} nodes failed",
            job.image,
            job.failed,
            job.nodes.len()
        )
    } else {
        bail!(
            "preheating {}: {held} of {} nodes hold it after {} s (--timeout)",
            job.image,
            job.nodes.len(),
            args.timeout.as_secs()
        )
    }
}
