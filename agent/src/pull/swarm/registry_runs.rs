//! Registry runs: the chunks a pull fetches from the registry itself (a run
//! the tracker or the DHT rank assigned, a fallback, a recheck of one
//! chunk), each verified and published as it lands.

use super::Swarm;
use crate::error::{Error, Result};
use crate::pull::fetch::Transfer;
use crate::pull::registry::RegistryClient;
use crate::serving::metrics::Source;
use crate::store::PutOutcome;
use dray_protocol::{ChunkMap, VerifyError};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Fetches chunks `[first, first + count)` from the registry into the blob
/// and publishes each chunk's hash; stops (releasing the chunk it was
/// fetching) when `cancel` fires. A chunk then in flight from a peer is
/// left to that request and, after the rest of the run, waited for: if the
/// request fails (the peer left, or lied), the run fetches the chunk itself,
/// as the tracker that assigned it expects.
pub(super) async fn fetch_run(
    swarm: Arc<Swarm>,
    t: Arc<Transfer>,
    registry: Arc<RegistryClient>,
    repo: String,
    first: u32,
    count: u32,
    cancel: CancellationToken,
) -> Result<()> {
    let map = t.blob().map();
    let mut in_flight = Vec::new();
    for index in first..first.saturating_add(count).min(map.chunk_count()) {
        if cancel.is_cancelled() {
            return Ok(());
        }
        // A chunk held by a blob that failed its digest is fetched again and
        // compared: the tracker's recheck.
        let recheck = t.blob().take_recheck(index);
        if !recheck && !t.claim(index) {
            if !t.blob().has(index) {
                in_flight.push(index);
            }
            continue;
        }
        if !fetch_chunk(
            &swarm,
            &t,
            (&registry, &repo),
            &map,
            index,
            recheck,
            &cancel,
        )
        .await?
        {
            return Ok(());
        }
    }
    for index in in_flight {
        let Some(true) = cancel.run_until_cancelled(t.claim_when_free(index)).await else {
            continue;
        };
        if !fetch_chunk(&swarm, &t, (&registry, &repo), &map, index, false, &cancel).await? {
            return Ok(());
        }
    }
    Ok(())
}

/// Fetches chunk `index` from the registry to settle a dispute or check a
/// suspect claim, stores it (vouched) and hands the transfer the ruling.
pub(super) async fn check_chunk(
    t: Arc<Transfer>,
    registry: Arc<RegistryClient>,
    repo: String,
    index: u32,
) -> Result<()> {
    let map = t.blob().map();
    let (digest, offset, len) = (map.digest(), map.offset(index), map.chunk_len(index));
    tracing::info!(
        index,
        "fetching a chunk from the registry to check peers' word for it"
    );
    let data = match registry
        .blob_range(&repo, &digest, offset, len as u64)
        .await
    {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(index, error = %e, "could not check a chunk against the registry");
            return t.checked(index, None);
        }
    };
    let hash = dray_protocol::chunkmap::chunk_hash(&data);
    match t.store(index, data, None).await {
        // The blob failed its digest again: the next suspect is checked.
        Ok(_) | Err(Error::Verify(VerifyError::BlobDigest { .. })) => t.checked(index, Some(hash)),
        Err(e) => {
            t.checked(index, None)?;
            Err(e)
        }
    }
}

/// Fetches one claimed chunk (or one to recheck) from the registry, stores
/// and publishes it. False when `cancel` fired first (the claim released).
async fn fetch_chunk(
    swarm: &Arc<Swarm>,
    t: &Arc<Transfer>,
    (registry, repo): (&RegistryClient, &str),
    map: &ChunkMap,
    index: u32,
    recheck: bool,
    cancel: &CancellationToken,
) -> Result<bool> {
    let settle = |stored| {
        if !recheck {
            t.settle(index, stored);
        }
    };
    tracing::debug!(index, recheck, "requesting registry chunk");
    let digest = map.digest();
    let range = registry.blob_range(
        repo,
        &digest,
        map.offset(index),
        map.chunk_len(index) as u64,
    );
    let Some(fetched) = cancel.run_until_cancelled(range).await else {
        settle(false);
        return Ok(false);
    };
    let data = match fetched {
        Ok(d) => d,
        Err(e) => {
            settle(false);
            return Err(e.into());
        }
    };
    match t.store(index, data, None).await {
        // A recheck publishes the hash even when it is the same: that
        // settles the chunk at the tracker, and the next goes out.
        Ok(outcome) if recheck || outcome != PutOutcome::Duplicate => {
            tracing::debug!(index, recheck, "registry chunk stored");
            settle(true);
            // Peers can take the chunk only once its hash is published;
            // the next chunk need not wait for that (nor for a dead
            // tracker's timeout), and neither need the announce that
            // tells the tracker we hold it and brings our next run: the
            // two round trips overlap.
            let (publisher, blob) = (swarm.clone(), t.blob().clone());
            tokio::spawn(async move { publisher.publish_chunk(index, &blob).await });
            swarm.poke.notify_one();
        }
        Ok(_) => t.settle(index, true),
        Err(e) => {
            if matches!(
                e,
                Error::Verify(VerifyError::ChunkLength { .. } | VerifyError::HashConflict { .. })
            ) {
                swarm.node.metrics().verify_failed(Source::Registry);
            }
            settle(false);
            return Err(e);
        }
    }
    Ok(true)
}
