//! `dray status` as text: `KEY  value` lines for the node, its tracker, DHT
//! and store, then aligned tables (pulls, recent events, blobs) with human
//! sizes, rates and durations, as `kubectl get` and `docker ps` print.

use dray_agent::serving::status::Status;
use indicatif::HumanBytes;
use std::fmt::Write;

/// Digest characters shown in tables (`sha256:` and 12 hex, as docker does).
const SHORT_DIGEST: usize = 19;

/// The whole text of `status`; `now` (Unix seconds) dates the events.
pub fn render(status: &Status, now: u64) -> String {
    let mut out = String::new();
    let mut line = |key: &str, value: String| {
        let _ = writeln!(out, "{key:<9}{value}");
    };
    line(
        "NODE",
        format!(
            "{} on {}, up {}",
            status.peer_id,
            status.peer_addr,
            duration(status.uptime_s)
        ),
    );
    line(
        "TRACKER",
        match (status.trackers.as_slice(), status.tracker_reachable) {
            ([], _) => "none configured".into(),
            (t, Some(false)) => format!("{}: UNREACHABLE", t.join(", ")),
            (t, _) => format!("{}: reachable", t.join(", ")),
        },
    );
    line(
        "DHT",
        match &status.dht {
            Some(d) => format!("joined, {} peers in the routing table", d.routing_peers),
            None => "off".into(),
        },
    );
    if let Some(gc) = &status.gc {
        let (c, u) = (&gc.config, &gc.usage);
        let budget = c.budget.map_or("no budget".to_string(), |b| {
            format!("budget {}", HumanBytes(b))
        });
        line(
            "STORE",
            format!(
                "{} in {} blobs ({budget}); filesystem {} of {} used",
                HumanBytes(u.store_bytes),
                u.store_blobs,
                HumanBytes(u.fs_bytes.saturating_sub(u.fs_free)),
                HumanBytes(u.fs_bytes)
            ),
        );
        let over = if gc.use_share > c.critical_watermark {
            "  PAST CRITICAL: new blobs refused, last copies evicted"
        } else if gc.use_share > c.high_watermark {
            "  PAST HIGH: evicting"
        } else {
            ""
        };
        line(
            "USE",
            format!(
                "{} of the limit; watermarks low {}, high {}, critical {}{over}",
                percent(gc.use_share),
                percent(c.low_watermark),
                percent(c.high_watermark),
                percent(c.critical_watermark)
            ),
        );
    }
    line(
        "UPLOADS",
        format!("{} in progress", status.uploads_in_progress),
    );

    out.push('\n');
    if status.pulls.is_empty() {
        out.push_str("No pulls in progress.\n");
    } else {
        let mut rows = vec![row(&[
            "BLOB",
            "REPOSITORY",
            "PROGRESS",
            "FROM PEERS",
            "FROM REGISTRY",
            "RATE",
            "ETA",
            "PEERS",
        ])];
        for p in &status.pulls {
            rows.push(vec![
                short(&p.digest),
                p.repository.clone(),
                format!(
                    "{}/{} {}",
                    HumanBytes(p.have),
                    HumanBytes(p.size),
                    percent(p.have as f64 / p.size.max(1) as f64)
                ),
                HumanBytes(p.bytes_from_peers).to_string(),
                HumanBytes(p.bytes_from_registry).to_string(),
                format!("{}/s", HumanBytes(p.rate as u64)),
                p.eta_s.map_or("-".into(), duration),
                p.peer_count.to_string(),
            ]);
        }
        table(&mut out, &rows);
        if status.pulls_running > status.pulls.len() {
            let _ = writeln!(
                out,
                "({} more pulls not listed)",
                status.pulls_running - status.pulls.len()
            );
        }
    }

    out.push('\n');
    if status.events.is_empty() {
        out.push_str("No recent fallbacks or bans.\n");
    } else {
        let mut rows = vec![row(&["AGE", "EVENT", "BLOB", "PEER", "REASON"])];
        for e in &status.events {
            rows.push(vec![
                duration(now.saturating_sub(e.at) as f64),
                e.kind.as_str().to_string(),
                short(&e.digest),
                e.peer.clone().unwrap_or_else(|| "-".into()),
                e.reason.clone(),
            ]);
        }
        table(&mut out, &rows);
    }

    out.push('\n');
    let mut rows = vec![row(&["BLOB", "SIZE", "HELD", "STATE"])];
    for b in &status.blobs {
        rows.push(vec![
            short(&b.digest),
            HumanBytes(b.size).to_string(),
            HumanBytes(b.have).to_string(),
            if b.complete { "complete" } else { "partial" }.into(),
        ]);
    }
    table(&mut out, &rows);
    if status.blobs_held > status.blobs.len() {
        let _ = writeln!(
            out,
            "({} more blobs held, not listed)",
            status.blobs_held - status.blobs.len()
        );
    }
    out
}

fn row(cells: &[&str]) -> Vec<String> {
    cells.iter().map(|c| c.to_string()).collect()
}

/// Rows as columns padded to their widest cell, three spaces apart.
fn table(out: &mut String, rows: &[Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut text = String::new();
        for (cell, width) in r.iter().zip(&widths) {
            let _ = write!(text, "{cell:<width$}   ");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
}

fn short(digest: &str) -> String {
    digest.chars().take(SHORT_DIGEST).collect()
}

fn percent(share: f64) -> String {
    format!("{:.0}%", share * 100.0)
}

/// `45s`, `3m12s`, `2h5m`, `3d4h`, as kubectl prints ages.
fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dray_agent::pull::events::{Event, EventKind};
    use dray_agent::serving::status::{BlobStatus, PullStatus};

    #[test]
    fn prints_pulls_events_and_blobs_in_aligned_columns() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        let status = Status {
            peer_id: "node-a".into(),
            peer_addr: "127.0.0.1:7000".into(),
            trackers: vec!["https://tracker:7880".into()],
            tracker_reachable: Some(false),
            uptime_s: 125.0,
            pulls: vec![PullStatus {
                digest: digest.clone(),
                repository: "team/app".into(),
                size: 100 << 20,
                have: 25 << 20,
                bytes_from_peers: 20 << 20,
                bytes_from_registry: 5 << 20,
                rate: (5 << 20) as f64,
                eta_s: Some(15.0),
                peer_count: 3,
                ..Default::default()
            }],
            pulls_running: 1,
            events: vec![Event {
                at: 1000,
                kind: EventKind::Ban,
                digest: digest.clone(),
                peer: Some("node-b".into()),
                reason: "chunk 3 failed its hash".into(),
            }],
            blobs: vec![BlobStatus {
                digest: digest.clone(),
                size: 100 << 20,
                have: 25 << 20,
                complete: false,
            }],
            blobs_held: 3,
            ..Default::default()
        };
        let text = render(&status, 1090);
        assert!(
            text.contains("NODE     node-a on 127.0.0.1:7000, up 2m5s"),
            "{text}"
        );
        assert!(text.contains("https://tracker:7880: UNREACHABLE"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().position(|l| l.starts_with("BLOB ")).unwrap();
        let pull = lines[header + 1];
        assert!(pull.starts_with("sha256:abababababab   team/app"), "{text}");
        // Each header starts where its column's cells start.
        for (name, cell) in [
            ("PROGRESS", "25.00 MiB/100.00 MiB 25%"),
            ("FROM PEERS", "20.00 MiB"),
            ("ETA", "15s"),
            ("PEERS", "3"),
        ] {
            assert_eq!(
                lines[header].rfind(name),
                pull.rfind(cell),
                "{name} in\n{text}"
            );
        }
        assert!(text.contains("1m30s   ban"), "{text}");
        assert!(text.contains("node-b   chunk 3 failed its hash"), "{text}");
        assert!(text.contains("(2 more blobs held, not listed)"), "{text}");
    }
}
