//! The serving side of the peer plane: accepting connections, checking each
//! peer's `Hello` and answering its requests within the node's upload,
//! watcher and connection caps.

use super::*;
use dray_protocol::framing::MAX_HASHES_PER_ANSWER;

fn reject(reason: Reason, detail: impl Into<String>) -> pb::PeerMessage {
    pb::PeerMessage {
        body: Some(Body::Reject(pb::Reject {
            reason: reason as i32,
            detail: detail.into(),
        })),
    }
}

pub(super) async fn accept_loop(node: Arc<PeerNode>) {
    while let Some(incoming) = node.endpoint.accept().await {
        if node.endpoint.open_connections() >= node.config.max_connections {
            tracing::warn!(remote = %incoming.remote_address(), max = node.config.max_connections, "refused a peer connection: this node has as many connections open as it allows");
            incoming.refuse();
            continue;
        }
        let node = node.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => {
                    if let Err(e) = serve_connection(node, conn).await {
                        tracing::info!(%remote, error = %e, "peer connection ended");
                    }
                }
                Err(e) => tracing::warn!(%remote, error = %e, "refused peer connection"),
            }
        });
    }
}

async fn serve_connection(node: Arc<PeerNode>, conn: quinn::Connection) -> Result<()> {
    let peer = connection_peer_id(&conn)?;
    let Some(_slot) = node.connection_slot(&peer) else {
        let cap = node.config.max_connections_per_peer;
        let why = format!(
            "{cap} connections from peer {peer} already, the most this node accepts from one peer"
        );
        conn.close(quinn::VarInt::from_u32(2), why.as_bytes());
        return Err(peer_err(&peer, format!("refused: {why}")));
    };
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| peer_err(&peer, e))?;
    let hello: pb::PeerMessage = read_frame(&mut recv, &peer).await?;
    let refusal = match hello.body {
        Some(Body::Hello(h)) if h.version != PROTOCOL_VERSION => Some((
            Reason::Version,
            format!(
                "speaks protocol version {}, not {}",
                h.version, PROTOCOL_VERSION
            ),
        )),
        Some(Body::Hello(h)) if h.peer_id != peer => Some((
            Reason::Identity,
            format!(
                "hello names {:?} but the certificate names {peer:?}",
                h.peer_id
            ),
        )),
        Some(Body::Hello(_)) => None,
        _ => Some((
            Reason::BadRequest,
            "first message must be hello".to_string(),
        )),
    };
    if let Some((reason, detail)) = refusal {
        let _ = write_frame(&mut send, &reject(reason, detail.clone())).await;
        let _ = send.finish();
        // Let the refusal reach the peer before the connection goes.
        let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
        conn.close(quinn::VarInt::from_u32(1), b"hello refused");
        return Err(peer_violation(&peer, &detail));
    }
    let ours = pb::PeerMessage {
        body: Some(Body::Hello(pb::Hello {
            version: PROTOCOL_VERSION,
            peer_id: node.identity.peer_id.clone(),
        })),
    };
    write_frame(&mut send, &ours)
        .await
        .map_err(|e| peer_err(&peer, e))?;
    loop {
        let (send, recv) = conn.accept_bi().await.map_err(|e| peer_err(&peer, e))?;
        let node = node.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_request(&node, send, recv, &peer).await {
                tracing::debug!(%peer, error = %e, "request failed");
            }
        });
    }
}

async fn serve_request(
    node: &PeerNode,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    peer: &str,
) -> Result<()> {
    // A stream that never sends its request costs a task and a stream of the
    // connection's 256 until this ends it.
    let wait = node.config.request_timeout;
    let msg: pb::PeerMessage = tokio::time::timeout(wait, read_frame(&mut recv, peer))
        .await
        .map_err(|_| peer_err(peer, format!("sent no request within {wait:?}")))??;
    let req = match PeerRequest::from_pb(msg) {
        Ok(r) => r,
        Err(e) => {
            let _ = write_frame(&mut send, &reject(Reason::BadRequest, e.to_string())).await;
            return Err(Error::Frame {
                peer: peer.into(),
                source: e,
            });
        }
    };
    let io = |e: std::io::Error| peer_err(peer, e);
    match req {
        PeerRequest::Bitfield {
            digest,
            wait_above,
            wait_ms,
            known,
        } => {
            // A long poll holds a place among the blob's watchers while it waits.
            let slot = (wait_ms > 0).then(|| node.watch_slot(digest));
            let reply = match (lookup(node, digest).await?, slot) {
                (None, _) => reject(Reason::NotHeld, format!("{digest} is not here")),
                (Some(_), Some(None)) => reject(
                    Reason::Busy,
                    format!(
                        "{} watchers of {digest} already, the most this node serves",
                        node.config.max_watchers_per_blob
                    ),
                ),
                (Some(blob), slot) => {
                    if slot.is_some() {
                        // A long poll: answer as soon as there is news, or when the asked wait ends.
                        let mut progress = blob.subscribe();
                        let news =
                            progress.wait_for(|p| p.held > wait_above || p.complete || p.failed);
                        let _ =
                            tokio::time::timeout(Duration::from_millis(wait_ms.into()), news).await;
                    }
                    // Only what this node vouches for: never a chunk it
                    // holds on another member's word (see `Blob::offered`).
                    let held = blob.offered();
                    let hashes = known
                        .map(|k| hashes_unknown_to(&blob, &held, &k))
                        .unwrap_or_default();
                    pb::PeerMessage {
                        body: Some(Body::Bitfield(pb::Bitfield {
                            digest: digest.to_string(),
                            chunk_count: held.len(),
                            bits: Bytes::copy_from_slice(held.as_bytes()),
                            hashes,
                        })),
                    }
                }
            };
            write_frame(&mut send, &reply).await.map_err(io)?;
        }
        PeerRequest::Chunks {
            digest,
            first,
            count,
        } => {
            let _slot = match node.upload_slots.try_acquire() {
                Ok(slot) => slot,
                Err(e) => {
                    node.metrics.upload_refused();
                    let why = match e {
                        TryAcquireError::Closed => "this node is shutting down",
                        TryAcquireError::NoPermits => "all upload slots in use",
                    };
                    write_frame(&mut send, &reject(Reason::Busy, why))
                        .await
                        .map_err(io)?;
                    return Ok(());
                }
            };
            let Some(blob) = lookup(node, digest).await? else {
                write_frame(
                    &mut send,
                    &reject(Reason::NotHeld, format!("{digest} is not here")),
                )
                .await
                .map_err(io)?;
                return Ok(());
            };
            // The slot is held until the requester has read the answer, but
            // not past a deadline: one that reads slowly or not at all (its
            // flow-control window full) is cut off and the slot freed.
            let map = blob.map();
            let bytes: u64 = (first..first + count)
                .filter(|&i| i < map.chunk_count())
                .map(|i| map.chunk_len(i) as u64)
                .sum();
            let deadline = node.upload_deadline(bytes);
            let answer = async {
                send_chunks(node, &mut send, &blob, first, count, peer).await?;
                let _ = send.finish();
                // Wait until the peer has read everything (or gone) so the stream is not cut short.
                let _ = send.stopped().await;
                Ok(())
            };
            return match tokio::time::timeout(deadline, answer).await {
                Ok(done) => done,
                Err(_) => {
                    let _ = send.reset(quinn::VarInt::from_u32(1));
                    tracing::info!(%peer, %digest, first, count, ?deadline, "released an upload slot: the peer did not take the chunk within its deadline");
                    Err(peer_err(
                        peer,
                        format!(
                            "did not read {bytes} bytes of {digest} within {deadline:?}; upload cut off"
                        ),
                    ))
                }
            };
        }
    }
    let _ = send.finish();
    // Wait until the peer has read everything (or gone) so the stream is not cut short.
    let _ = send.stopped().await;
    Ok(())
}

/// Sends chunks `first..first + count` of `blob`, each a header and its raw
/// bytes, paced by the upload budget; a chunk not held ends the answer with
/// a reject.
async fn send_chunks(
    node: &PeerNode,
    send: &mut quinn::SendStream,
    blob: &Arc<crate::store::Blob>,
    first: u32,
    count: u32,
    peer: &str,
) -> Result<()> {
    let io = |e: std::io::Error| peer_err(peer, e);
    let digest = blob.digest();
    for index in first..first + count {
        let b = blob.clone();
        let chunk = tokio::task::spawn_blocking(move || b.read_chunk(index))
            .await
            .map_err(|e| peer_err(peer, e))??;
        let Some(chunk) = chunk else {
            let r = reject(
                Reason::NotHeld,
                format!("chunk {index} of {digest} is not held"),
            );
            write_frame(send, &r).await.map_err(io)?;
            break;
        };
        let header = pb::PeerMessage {
            body: Some(Body::Piece(pb::PieceHeader {
                index,
                length: chunk.len() as u32,
            })),
        };
        write_frame(send, &header).await.map_err(io)?;
        let len = chunk.len() as u64;
        // Paced slice by slice, so the chunk streams at the upload cap
        // instead of waiting out its whole budget before the first byte.
        let chunk = Bytes::from(chunk);
        for start in (0..chunk.len()).step_by(PACE_SLICE) {
            let slice = chunk.slice(start..chunk.len().min(start + PACE_SLICE));
            node.upload.take(slice.len()).await;
            send.write_chunk(slice)
                .await
                .map_err(|e| peer_err(peer, e))?;
        }
        node.metrics.uploaded(len);
    }
    Ok(())
}

async fn lookup(node: &PeerNode, digest: BlobDigest) -> Result<Option<Arc<crate::store::Blob>>> {
    let store = node.store.clone();
    tokio::task::spawn_blocking(move || store.get(&digest)).await?
}

/// The hashes of held chunks whose bit in `known` (an asker's bitfield of
/// known hashes, possibly short or empty) is clear, at most
/// [`MAX_HASHES_PER_ANSWER`] of them.
fn hashes_unknown_to(
    blob: &crate::store::Blob,
    held: &dray_protocol::Bitfield,
    known: &[u8],
) -> Vec<pb::ChunkHashEntry> {
    let knows = |i: u32| {
        known
            .get(i as usize / 8)
            .is_some_and(|b| b & (0x80 >> (i % 8)) != 0)
    };
    blob.hashes_of(held.ones().filter(|&i| !knows(i)), MAX_HASHES_PER_ANSWER)
        .into_iter()
        .map(|(index, hash)| pb::ChunkHashEntry {
            index,
            hash: Bytes::copy_from_slice(&hash),
        })
        .collect()
}
