//! dray as a system service: the stop signals every long-running subcommand
//! obeys (`agent`, `tracker`, `snapshotter`, `blob pull --serve`), and the
//! agent's graceful stop.
//!
//! Kubernetes and systemd stop a service with SIGTERM; Ctrl-C is SIGINT. A
//! process that is PID 1 of its PID namespace (a container's entrypoint)
//! gets no default action for either: the kernel drops the signal unless a
//! handler is installed, and the pod waits out its whole grace period before
//! SIGKILL. So every server here installs one, through [`shutdown_signal`].
//!
//! The agent stops in this order, all within `shutdown_grace`: the mirror
//! and the local API take no new requests; the tracker is told this node
//! leaves (so it is handed out no more and its registry runs go to others
//! at once); new chunk requests from peers are answered BUSY; then it waits
//! for the answers and uploads under way, closes the peer endpoint, records
//! every blob's verified chunks, and exits 0.

use anyhow::{Context, Result, bail};
use dray_agent::config::AgentConfig;
use dray_agent::serving::metrics::{AdminEndpoint, AgentMetrics};
use dray_agent::serving::surfaces::Surfaces;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};

/// How often the stop checks whether uploads have finished.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long the peer endpoint may take to tell every peer it closes.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Installs the SIGTERM and SIGINT handlers now, and resolves with the
/// signal's name once either arrives.
pub fn shutdown_signal() -> Result<impl Future<Output = &'static str> + Send> {
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

/// `dray agent`: serves until SIGTERM or SIGINT, then stops gracefully.
pub async fn run_agent(cfg: AgentConfig) -> Result<()> {
    let stop = shutdown_signal()?;
    // Health checks answer while the store opens (which re-verifies partial blobs).
    let metrics = Arc::new(AgentMetrics::new());
    let admin = AdminEndpoint::new(metrics.clone());
    let admin_listener = tokio::net::TcpListener::bind(cfg.admin_listen)
        .await
        .with_context(|| format!("binding the admin endpoint to {}", cfg.admin_listen))?;
    let admin_addr = admin_listener.local_addr()?;
    let admin_task = tokio::spawn(admin.clone().serve(admin_listener));
    let mut agent = dray_agent::identity::enroll::open_agent(&cfg, metrics).await?;
    let (swarm, node) = (agent.swarm().clone(), agent.node().clone());
    admin.set_ready(node.clone());
    // Preheat jobs the tracker hands this node run through the local API's
    // pulls (started below); set before the first announce, which then
    // makes this node one the tracker may choose.
    let (preheats, preheat_tasks) = tokio::sync::mpsc::unbounded_channel();
    swarm.preheats().set_runner(preheats);
    agent.spawn_loops(true);
    let mut surfaces = Surfaces::serve(
        agent.pulls(),
        cfg.mirror.clone(),
        Some((&cfg.local_api, cfg.unpack.clone())),
    )
    .await?;
    let dht = match swarm.dht() {
        Some(dht) => format!(", DHT on {}", dht.listening().await?),
        None => String::new(),
    };
    eprintln!(
        "dray agent {} serving peers on {} and the registry mirror on {} (metrics on http://{admin_addr}/metrics, local API on {}{dht})",
        node.peer_id(),
        node.local_addr()?,
        surfaces.mirror_url(),
        cfg.local_api.socket.display()
    );
    let api = surfaces.local_api().expect("served above").clone();
    let preheat_task = tokio::spawn(api.run_preheats(preheat_tasks));
    let signal = tokio::select! {
        e = surfaces.failed() => return Err(e.into()),
        served = admin_task => {
            served.context("admin endpoint task")?
                .with_context(|| format!("serving the admin endpoint on {admin_addr}"))?;
            bail!("the admin endpoint on {admin_addr} stopped serving")
        }
        signal = stop => signal,
    };
    let grace = cfg.shutdown_grace;
    let deadline = tokio::time::Instant::now() + grace;
    eprintln!(
        "dray agent: {signal}: taking no new requests, leaving the tracker, finishing what is under way (at most {} s)",
        grace.as_secs_f64()
    );
    // A second signal cuts the wait short (the store is still flushed).
    let again = shutdown_signal()?;
    surfaces.drain();
    // No new preheat job starts; the pulls of those under way end with the process.
    preheat_task.abort();
    agent.stop_loops();
    let _ = tokio::time::timeout_at(deadline, swarm.leave()).await;
    node.drain();
    let finished = async {
        surfaces.finished().await;
        while node.active_uploads() > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    let cut_short = tokio::select! {
        _ = finished => None,
        _ = tokio::time::sleep_until(deadline) => Some(format!("shutdown_grace ({} s) passed", grace.as_secs_f64())),
        signal = again => Some(format!("{signal} again")),
    };
    if let Some(why) = cut_short {
        eprintln!(
            "dray agent: {why} with {} uploads under way and {} of the mirror and the local API still answering: stopping them",
            node.active_uploads(),
            surfaces.serving()
        );
        surfaces.abort();
    }
    node.close();
    node.closed(CLOSE_WAIT).await;
    let store = node.store().clone();
    tokio::task::spawn_blocking(move || {
        for blob in store.open_blobs() {
            if let Err(e) = store.persist(&blob) {
                eprintln!("dray agent: recording the chunks of {}: {e}", blob.digest());
            }
        }
    })
    .await
    .context("flushing the store")?;
    let _ = std::fs::remove_file(&cfg.local_api.socket);
    eprintln!("dray agent: stopped");
    Ok(())
}
