//! `dray pull`, `status`, `gc`, `pin` and `unpin`: clients of a running
//! agent's local API on its unix socket (see `dray_agent::serving::local_api`).

use anyhow::{Context, Result, bail};
use dray_agent::serving::local_api::{PinRequest, PullProgress, PullRequest};
use dray_agent::serving::status::Status;
use futures_util::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::path::Path;

fn client(socket: &Path) -> Result<reqwest::Client> {
    dray_agent::pull::registry::install_crypto_provider();
    reqwest::Client::builder()
        .unix_socket(socket)
        .build()
        .context("building the local API client")
}

/// Turns a failed call into one line naming the socket.
async fn checked(
    socket: &Path,
    resp: reqwest::Result<reqwest::Response>,
) -> Result<reqwest::Response> {
    let resp = resp.with_context(|| {
        format!(
            "no agent answers on {} (is `dray agent` running, and are you root?)",
            socket.display()
        )
    })?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        bail!(
            "agent answered {status}: {}",
            body["error"].as_str().unwrap_or("no detail")
        );
    }
    Ok(resp)
}

/// Pulls every layer of `image` into the agent's store, with progress bars
/// (or, with `json`, the final progress line as JSON).
pub async fn pull(socket: &Path, image: &str, json: bool) -> Result<()> {
    let resp = client(socket)?
        .post("http://agent/v1/images/pull")
        .json(&PullRequest {
            image: image.to_string(),
        })
        .send()
        .await;
    let resp = checked(socket, resp).await?;
    let bars = MultiProgress::new();
    if json {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style =
        ProgressStyle::with_template("{prefix:>19} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}")
            .expect("valid template")
            .progress_chars("=> ");
    let mut by_layer: HashMap<String, ProgressBar> = HashMap::new();
    let mut last = PullProgress::default();
    let mut pending = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(piece) = body.next().await {
        pending.extend_from_slice(&piece.context("reading the agent's progress")?);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            last = serde_json::from_slice(&line).context("parsing the agent's progress")?;
            for l in &last.layers {
                let bar = by_layer.entry(l.digest.clone()).or_insert_with(|| {
                    let b = bars.add(ProgressBar::new(l.size).with_style(style.clone()));
                    b.set_prefix(l.digest.chars().take(19).collect::<String>());
                    b
                });
                bar.set_position(l.have);
                if l.complete {
                    bar.finish_with_message(format!(
                        "peers {} registry {}",
                        indicatif::HumanBytes(l.bytes_from_peers),
                        indicatif::HumanBytes(l.bytes_from_registry)
                    ));
                }
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string(&last)?);
    }
    match (&last.error, last.done) {
        (Some(e), _) => bail!("pulling {image}: {e}"),
        (None, true) => Ok(()),
        (None, false) => bail!("pulling {image}: the agent stopped answering before the end"),
    }
}

/// Prints what the agent is doing now, as kubectl and docker print:
/// a few `KEY  value` lines, then aligned tables with human sizes.
pub async fn status(socket: &Path, json: bool) -> Result<()> {
    let resp = client(socket)?.get("http://agent/v1/status").send().await;
    let status: Status = checked(socket, resp)
        .await?
        .json()
        .await
        .context("parsing the agent's status")?;
    if json {
        println!("{}", serde_json::to_string(&status)?);
    } else {
        print!("{}", crate::status_text::render(&status, now_unix()));
    }
    Ok(())
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Runs one garbage collection in the agent (or, `dry_run`, lists what it
/// would evict now).
pub async fn gc(socket: &Path, dry_run: bool, json: bool) -> Result<()> {
    let resp = client(socket)?
        .post("http://agent/v1/gc")
        .json(&serde_json::json!({ "dry_run": dry_run }))
        .send()
        .await;
    let done: dray_agent::store::gc::Collection = checked(socket, resp)
        .await?
        .json()
        .await
        .context("parsing the agent's collection")?;
    if json {
        println!("{}", serde_json::to_string(&done)?);
        return Ok(());
    }
    let verb = if dry_run { "would evict" } else { "evicted" };
    println!(
        "store {} in {} blobs; {} to free{}",
        indicatif::HumanBytes(done.usage.store_bytes),
        done.usage.store_blobs,
        indicatif::HumanBytes(done.need),
        if done.critical {
            " (past the critical watermark)"
        } else {
            ""
        }
    );
    for e in &done.evicted {
        println!(
            "{verb} {}  {:>10}  {}",
            e.digest,
            indicatif::HumanBytes(e.bytes).to_string(),
            e.reason.as_str()
        );
    }
    let total: u64 = done.evicted.iter().map(|e| e.bytes).sum();
    println!(
        "{verb} {} blobs, {}",
        done.evicted.len(),
        indicatif::HumanBytes(total)
    );
    Ok(())
}

fn print_pinned(p: &dray_agent::store::gc::PinnedImage) {
    println!("{}  {} blobs", p.image, p.blobs.len());
    for b in &p.blobs {
        println!("  {b}");
    }
}

/// Pins `image` (or, with none, lists the pinned images).
pub async fn pin(socket: &Path, image: Option<&str>, json: bool) -> Result<()> {
    let request = client(socket)?.request(
        if image.is_some() {
            reqwest::Method::POST
        } else {
            reqwest::Method::GET
        },
        "http://agent/v1/pins",
    );
    let resp = match image {
        Some(i) => request.json(&PinRequest { image: i.into() }),
        None => request,
    }
    .send()
    .await;
    let body = checked(socket, resp).await?;
    let pinned: Vec<dray_agent::store::gc::PinnedImage> = match image {
        Some(_) => vec![body.json().await.context("parsing the agent's answer")?],
        None => body.json().await.context("parsing the agent's answer")?,
    };
    if json {
        println!("{}", serde_json::to_string(&pinned)?);
        return Ok(());
    }
    if image.is_none() && pinned.is_empty() {
        println!("no images pinned");
    }
    pinned.iter().for_each(print_pinned);
    Ok(())
}

/// Unpins `image`.
pub async fn unpin(socket: &Path, image: &str) -> Result<()> {
    let resp = client(socket)?
        .delete("http://agent/v1/pins")
        .json(&PinRequest {
            image: image.into(),
        })
        .send()
        .await;
    let was: dray_agent::store::gc::PinnedImage = checked(socket, resp)
        .await?
        .json()
        .await
        .context("parsing the agent's answer")?;
    println!("unpinned {} ({} blobs)", was.image, was.blobs.len());
    Ok(())
}
