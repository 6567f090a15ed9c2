//! The withholder of `dray bench swarm --hostile K --attacks withhold`: a
//! cluster member with a valid certificate that announces the whole blob
//! to the tracker, says hello and answers bitfield requests with every
//! chunk held, as an honest holder would, and answers no chunk request
//! (it takes each and keeps it open). The agent's peer server cannot be
//! made to do this, so the withholder speaks the peer protocol itself,
//! over the agent's own QUIC endpoint settings (`peer::quic_endpoint`).

use anyhow::{Context, Result};
use dray_agent::discovery::tracker_client::TrackerClient;
use dray_agent::identity::Identity;
use dray_agent::peer::{PeerConfig, quic_endpoint};
use dray_protocol::framing::{self, MAX_PEER_FRAME, PeerRequest};
use dray_protocol::pb::{self, peer_message::Body, tracker_request::Body as TrackerBody};
use dray_protocol::{Bitfield, ChunkMap, PROTOCOL_VERSION};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How often the withholder announces, as a pulling agent does.
const ANNOUNCE_EVERY: Duration = Duration::from_millis(500);

/// A withholder of `map`'s blob, serving until `stop`.
pub struct Withholder {
    endpoint: quinn::Endpoint,
    identity: Identity,
    map: ChunkMap,
}

impl Withholder {
    pub fn bind(identity: Identity, map: ChunkMap) -> Result<Self> {
        let any = "127.0.0.1:0".parse()?;
        let endpoint = quic_endpoint(&identity, any, &PeerConfig::default().transport)
            .context("binding the withholder's endpoint")?;
        Ok(Self {
            endpoint,
            identity,
            map,
        })
    }

    /// Announces the whole blob to the tracker at `url` and takes every
    /// connection, until `stop` (or `limit`, whatever the storm does).
    pub async fn run(self, url: String, stop: Arc<AtomicBool>, limit: Duration) {
        let me = Arc::new(self);
        let accept = tokio::spawn(me.clone().accept());
        let tracker = TrackerClient::new(vec![url.clone()], &me.identity);
        let started = std::time::Instant::now();
        while !stop.load(Ordering::Relaxed) && started.elapsed() < limit {
            // Refused or not, it keeps claiming the blob.
            _ = tracker.send(&url, me.announce()).await;
            tokio::time::sleep(ANNOUNCE_EVERY).await;
        }
        accept.abort();
        me.endpoint.close(0u32.into(), b"done");
    }

    fn announce(&self) -> TrackerBody {
        let all = Bitfield::full(self.map.chunk_count());
        TrackerBody::Announce(pb::Announce {
            peer_id: self.identity.peer_id.clone(),
            address: self
                .endpoint
                .local_addr()
                .map_or_else(|_| String::new(), |a| a.to_string()),
            full: true,
            blobs: vec![pb::BlobHolding {
                digest: self.map.digest().to_string(),
                size: self.map.size(),
                chunk_size: self.map.chunk_size(),
                bits: all.as_bytes().to_vec().into(),
                complete: true,
                ..Default::default()
            }],
            ..Default::default()
        })
    }

    async fn accept(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            let me = self.clone();
            tokio::spawn(async move {
                if let Ok(conn) = incoming.await {
                    me.serve(conn).await;
                }
            });
        }
    }

    /// Hello first; then each stream: a bitfield request is answered with
    /// every chunk (after the long poll's wait, as nothing changes), a chunk
    /// request is taken and never answered.
    async fn serve(&self, conn: quinn::Connection) {
        let mut held = Vec::new();
        let mut first = true;
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let Some(msg) = read_message(&mut recv).await else {
                continue;
            };
            if std::mem::take(&mut first) {
                let hello = pb::PeerMessage {
                    body: Some(Body::Hello(pb::Hello {
                        version: PROTOCOL_VERSION,
                        peer_id: self.identity.peer_id.clone(),
                    })),
                };
                write_message(&mut send, &hello).await;
                continue;
            }
            match PeerRequest::from_pb(msg) {
                Ok(PeerRequest::Bitfield {
                    wait_above,
                    wait_ms,
                    ..
                }) => {
                    let count = self.map.chunk_count();
                    if wait_above >= count {
                        tokio::time::sleep(Duration::from_millis(wait_ms.into())).await;
                    }
                    let all = Bitfield::full(count);
                    let reply = pb::PeerMessage {
                        body: Some(Body::Bitfield(pb::Bitfield {
                            digest: self.map.digest().to_string(),
                            chunk_count: count,
                            bits: all.as_bytes().to_vec().into(),
                            hashes: Vec::new(),
                        })),
                    };
                    write_message(&mut send, &reply).await;
                }
                // Taken, and kept unanswered for as long as the connection lives.
                Ok(PeerRequest::Chunks { .. }) => held.push((send, recv)),
                Err(_) => {}
            }
        }
    }
}

async fn read_message(recv: &mut quinn::RecvStream) -> Option<pb::PeerMessage> {
    let mut buf = Vec::new();
    loop {
        if let Ok(Some((msg, _))) = framing::take::<pb::PeerMessage>(&buf, MAX_PEER_FRAME) {
            return Some(msg);
        }
        let chunk = recv.read_chunk(64 << 10, true).await.ok()??;
        if buf.len() + chunk.bytes.len() > MAX_PEER_FRAME + 4 {
            return None;
        }
        buf.extend_from_slice(&chunk.bytes);
    }
}

async fn write_message(send: &mut quinn::SendStream, msg: &pb::PeerMessage) {
    if let Ok(frame) = framing::encode(msg, MAX_PEER_FRAME) {
        _ = send.write_all(&frame).await;
    }
}
