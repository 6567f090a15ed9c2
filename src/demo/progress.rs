//! The demo's live display (indicatif): a bar per node with the bytes it holds
//! out of the image's and where they came from, and a line with the
//! registry's egress so far. Hidden when stdout is not a terminal or with
//! `--json`.

use super::image::Image;
use super::registry::DemoRegistry;
use dray_testkit::cluster::LocalCluster;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: f64 = (1u64 << 20) as f64;

/// The bars, refreshed from the stores and the registry's counters every 100 ms.
pub struct Display {
    /// Held by a tick while it draws; true once the display is gone, so that
    /// a tick on another thread cannot draw over what follows.
    closed: Arc<Mutex<bool>>,
    nodes: Vec<ProgressBar>,
    overall: ProgressBar,
    ticker: tokio::task::JoinHandle<()>,
    image_bytes: u64,
    bound_s: f64,
}

/// The line under the bars.
fn overall_line(egress: u64, image_bytes: u64, seconds: f64, bound_s: f64) -> String {
    format!(
        "registry egress {:.1} MiB ({:.2}× the image) · {seconds:.1} s (lower bound {bound_s:.1} s)",
        egress as f64 / MIB,
        egress as f64 / image_bytes as f64,
    )
}

impl Display {
    pub fn new(
        show: bool,
        image: &Image,
        cluster: &LocalCluster,
        registry: &Arc<DemoRegistry>,
        registry_bytes_per_s: u64,
    ) -> Display {
        let target = if show && std::io::stdout().is_terminal() {
            ProgressDrawTarget::stdout()
        } else {
            ProgressDrawTarget::hidden()
        };
        let multi = MultiProgress::with_draw_target(target);
        let style = ProgressStyle::with_template(
            "{prefix:<7} [{bar:32.cyan/blue}] {bytes:>10}/{total_bytes:<10} {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        let image_bytes = image.bytes();
        let nodes: Vec<ProgressBar> = (0..cluster.agents.len())
            .map(|i| {
                multi
                    .add(ProgressBar::new(image_bytes))
                    .with_style(style.clone())
                    .with_prefix(LocalCluster::node_id(i))
            })
            .collect();
        let overall = multi.add(
            ProgressBar::new_spinner()
                .with_style(ProgressStyle::with_template("{msg}").expect("a valid template")),
        );
        let bound_s = image_bytes as f64 / registry_bytes_per_s as f64;
        let closed = Arc::new(Mutex::new(false));
        let ticker = {
            let (nodes, overall, closed) = (nodes.clone(), overall.clone(), closed.clone());
            let stores: Vec<_> = cluster
                .agents
                .iter()
                .map(|s| s.node().store().clone())
                .collect();
            let registry = registry.clone();
            tokio::spawn(async move {
                let start = Instant::now();
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tick.tick().await;
                    let closed = closed.lock().unwrap_or_else(|p| p.into_inner());
                    if *closed {
                        return;
                    }
                    for (i, (bar, store)) in nodes.iter().zip(&stores).enumerate() {
                        if bar.is_finished() {
                            continue;
                        }
                        let held: u64 = store.holdings().iter().map(|h| h.held_bytes()).sum();
                        let from_registry = registry.egress_to(i);
                        bar.set_position(held);
                        bar.set_message(format!(
                            "peers {:>6.1} MiB · registry {:>6.1} MiB",
                            held.saturating_sub(from_registry) as f64 / MIB,
                            from_registry as f64 / MIB
                        ));
                    }
                    overall.set_message(overall_line(
                        registry.egress(),
                        image_bytes,
                        start.elapsed().as_secs_f64(),
                        bound_s,
                    ));
                }
            })
        };
        Display {
            closed,
            nodes,
            overall,
            ticker,
            image_bytes,
            bound_s,
        }
    }

    /// Node `i`'s bar, for [`finish`] from the node's task.
    pub fn node_bar(&self, i: usize) -> ProgressBar {
        self.nodes[i].clone()
    }

    /// Stops refreshing after the last node, `seconds` from the start, with
    /// the registry's final egress; the bars stay on screen above the table.
    pub fn done(&self, egress: u64, seconds: f64) {
        self.ticker.abort();
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.overall.finish_with_message(overall_line(
            egress,
            self.image_bytes,
            seconds,
            self.bound_s,
        ));
    }
}

/// Marks a node's bar done, after `seconds`.
pub fn finish(bar: &ProgressBar, seconds: f64) {
    bar.set_position(bar.length().unwrap_or(0));
    bar.finish_with_message(format!("done in {seconds:.2} s"));
}

impl Drop for Display {
    /// Stops drawing at once (an error or Ctrl-C follows); the bars stay on
    /// screen as they were.
    fn drop(&mut self) {
        self.ticker.abort();
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        // A bar dropped unfinished would clear its line.
        for bar in self.nodes.iter().chain([&self.overall]) {
            if !bar.is_finished() {
                bar.abandon();
            }
        }
    }
}
