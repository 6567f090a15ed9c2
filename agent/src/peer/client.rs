//! The requesting side of the peer plane: dialling a peer, exchanging
//! `Hello`s, bitfields (long-polled or not) and chunk requests.

use super::*;
use dray_protocol::framing::{MAX_BITFIELD_WAIT_MS, MAX_HASHES_PER_ANSWER};
use dray_protocol::{Bitfield, ChunkMap};
use std::sync::atomic::{AtomicUsize, Ordering};

impl PeerNode {
    /// Dials `peer_id` at `addr`, checks its certificate names that peer id, and
    /// exchanges `Hello`s.
    pub async fn connect(&self, peer_id: &str, addr: SocketAddr) -> Result<PeerLink> {
        let failed = |detail: String| Error::Connect {
            peer: peer_id.into(),
            addr: addr.to_string(),
            detail,
        };
        let conn = self
            .endpoint
            .connect(addr, peer_id)
            .map_err(|e| failed(e.to_string()))?
            .await
            .map_err(|e| failed(e.to_string()))?;
        // TLS 1.3 lets the client finish before the server has checked the
        // client certificate: a refusal shows up as the connection closing,
        // and a stream may fail a moment before the connection records why.
        // So the hello exchange reports the connection's close reason (the
        // peer's TLS alert) when it has one.
        let exchange = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| failed(e.to_string()))?;
            let hello = pb::PeerMessage {
                body: Some(Body::Hello(pb::Hello {
                    version: PROTOCOL_VERSION,
                    peer_id: self.identity.peer_id.clone(),
                })),
            };
            write_frame(&mut send, &hello)
                .await
                .map_err(|e| failed(e.to_string()))?;
            read_frame::<pb::PeerMessage>(&mut recv, peer_id).await
        };
        let reply = match exchange.await {
            Ok(r) => r,
            Err(e) => {
                let reason = tokio::time::timeout(Duration::from_secs(1), conn.closed()).await;
                return Err(reason.map_or(e, |reason| failed(reason.to_string())));
            }
        };
        match reply.body {
            Some(Body::Hello(h)) if h.version == PROTOCOL_VERSION && h.peer_id == peer_id => {
                Ok(PeerLink {
                    peer_id: peer_id.into(),
                    conn,
                })
            }
            Some(Body::Hello(h)) => Err(failed(format!(
                "answered as {:?} speaking version {}, expected {peer_id:?} speaking {PROTOCOL_VERSION}",
                h.peer_id, h.version
            ))),
            Some(Body::Reject(r)) => Err(rejected(peer_id, &r)),
            _ => Err(failed("did not answer hello".into())),
        }
    }

    /// Asks a peer which chunks of a blob it holds; it answers at once.
    pub async fn bitfield(&self, link: &PeerLink, map: &ChunkMap) -> Result<Bitfield> {
        self.bitfield_after(link, map, 0, Duration::ZERO).await
    }

    /// Asks a peer which chunks of a blob it holds, letting it hold the answer
    /// while it holds no more than `above` chunks, for up to `wait` (capped at
    /// [`MAX_BITFIELD_WAIT_MS`]): the answer comes when the peer stores a
    /// chunk, completes or fails the blob, or the wait ends. A peer that
    /// predates long polls answers at once.
    pub async fn bitfield_after(
        &self,
        link: &PeerLink,
        map: &ChunkMap,
        above: u32,
        wait: Duration,
    ) -> Result<Bitfield> {
        Ok(
            match self.ask_bitfield(link, map, above, wait, None).await? {
                Some((bits, _)) => bits,
                None => Bitfield::new(map.chunk_count()),
            },
        )
    }

    /// [`PeerNode::bitfield_after`], also asking for the hashes of the
    /// chunks the peer holds that `known` lacks: the peer's word for them,
    /// for a swarm without a tracker to vouch for hashes. Returns them as a
    /// map of the blob holding only those hashes (at most
    /// [`MAX_HASHES_PER_ANSWER`] of them; ask again for more). A peer whose
    /// store does not know the blob at all (it is neither pulling nor
    /// holding it, whatever the DHT still says) is refused as an error.
    pub async fn bitfield_with_hashes(
        &self,
        link: &PeerLink,
        map: &ChunkMap,
        above: u32,
        wait: Duration,
        known: &Bitfield,
    ) -> Result<(Bitfield, ChunkMap)> {
        let Some((bits, hashes)) = self
            .ask_bitfield(link, map, above, wait, Some(known))
            .await?
        else {
            return Err(Error::Rejected {
                peer: link.peer_id.clone(),
                reason: format!(
                    "{} is not there: it neither pulls nor holds it",
                    map.digest()
                ),
            });
        };
        let violation = |why: String| Error::Frame {
            peer: link.peer_id.clone(),
            source: FrameError::Violation(why),
        };
        if hashes.len() > MAX_HASHES_PER_ANSWER {
            return Err(violation(format!(
                "{} chunk hashes in one answer (at most {MAX_HASHES_PER_ANSWER})",
                hashes.len()
            )));
        }
        let mut theirs = ChunkMap::unhashed(map.digest(), map.size(), map.chunk_size())?;
        for h in hashes {
            let hash = <[u8; 32]>::try_from(&h.hash[..]).map_err(|_| {
                violation(format!(
                    "a chunk hash of {} bytes (BLAKE3 hashes are 32)",
                    h.hash.len()
                ))
            })?;
            if !bits.get(h.index) {
                return Err(violation(format!(
                    "sent the hash of chunk {} of {}, which it does not hold",
                    h.index,
                    map.digest()
                )));
            }
            theirs
                .set_hash(h.index, hash)
                .map_err(|e| violation(e.to_string()))?;
        }
        Ok((bits, theirs))
    }

    async fn ask_bitfield(
        &self,
        link: &PeerLink,
        map: &ChunkMap,
        above: u32,
        wait: Duration,
        known: Option<&Bitfield>,
    ) -> Result<Option<(Bitfield, Vec<pb::ChunkHashEntry>)>> {
        let peer = &link.peer_id;
        let wait_ms = u32::try_from(wait.as_millis())
            .unwrap_or(u32::MAX)
            .min(MAX_BITFIELD_WAIT_MS);
        let request = async {
            let (mut send, mut recv) = link.open().await?;
            let req = PeerRequest::Bitfield {
                digest: map.digest(),
                wait_above: above,
                wait_ms,
                known: known.map(|k| Bytes::copy_from_slice(k.as_bytes())),
            }
            .to_pb();
            write_frame(&mut send, &req)
                .await
                .map_err(|e| peer_err(peer, e))?;
            read_frame::<pb::PeerMessage>(&mut recv, peer).await
        };
        let limit = Duration::from_millis(wait_ms.into()) + self.config.request_timeout;
        let reply = tokio::time::timeout(limit, request)
            .await
            .unwrap_or_else(|_| {
                Err(peer_err(
                    peer,
                    format!("bitfield of {}: no answer within {limit:?}", map.digest()),
                ))
            })?;
        match reply.body {
            Some(Body::Bitfield(b)) => {
                let bits =
                    Bitfield::from_bytes(map.chunk_count(), &b.bits).map_err(|e| Error::Frame {
                        peer: peer.clone(),
                        source: FrameError::Violation(e.to_string()),
                    })?;
                Ok(Some((bits, b.hashes)))
            }
            Some(Body::Reject(r)) if r.reason() == Reason::NotHeld => Ok(None),
            Some(Body::Reject(r)) => Err(rejected(peer, &r)),
            _ => Err(peer_violation(
                peer,
                "answered a bitfield request with something else",
            )),
        }
    }

    /// Fetches chunk `index` of `map`'s blob from a peer, unverified: the caller
    /// checks it against the chunk map before trusting it.
    pub async fn fetch_chunk(
        &self,
        link: &PeerLink,
        map: &ChunkMap,
        index: u32,
    ) -> Result<Vec<u8>> {
        self.fetch_chunk_noting(link, map, index, &AtomicUsize::new(0))
            .await
    }

    /// [`PeerNode::fetch_chunk`], counting in `received` the chunk's bytes
    /// as they come (a header alone is not an answer: a withholder can send
    /// one): a caller past the request's deadline knows how far the peer
    /// got (`pull::deadline::extension`). A peer that answers nothing, or
    /// stops sending, for `request_timeout` fails with [`Error::PeerSilent`].
    pub async fn fetch_chunk_noting(
        &self,
        link: &PeerLink,
        map: &ChunkMap,
        index: u32,
        received: &AtomicUsize,
    ) -> Result<Vec<u8>> {
        let peer = &link.peer_id;
        let idle = self.config.request_timeout;
        let want = map.chunk_len(index);
        let request = async {
            let (mut send, mut recv) = link.open().await?;
            let req = PeerRequest::Chunks {
                digest: map.digest(),
                first: index,
                count: 1,
            }
            .to_pb();
            write_frame(&mut send, &req)
                .await
                .map_err(|e| peer_err(peer, e))?;
            let header: pb::PeerMessage = read_frame(&mut recv, peer).await?;
            match header.body {
                Some(Body::Piece(p)) if p.index == index && p.length as usize == want => Ok(recv),
                Some(Body::Piece(p)) => Err(peer_violation(
                    peer,
                    &format!(
                        "sent piece {} of {} bytes for chunk {index} of {want} bytes",
                        p.index, p.length
                    ),
                )),
                Some(Body::Reject(r)) => Err(rejected(peer, &r)),
                _ => Err(peer_violation(
                    peer,
                    "answered a chunk request with something else",
                )),
            }
        };
        let mut recv = tokio::time::timeout(idle, request)
            .await
            .unwrap_or_else(|_| {
                Err(Error::PeerSilent {
                    peer: peer.clone(),
                    detail: format!("chunk {index}: no answer within {idle:?}"),
                })
            })?;
        self.download.take(want).await;
        // On a slow or shared link a chunk may take long; only a transfer that
        // stops moving is abandoned. Quinn's own buffers are copied in once,
        // into memory nothing zeroes first.
        let mut buf = Vec::with_capacity(want);
        while buf.len() < want {
            let got = buf.len();
            match tokio::time::timeout(idle, recv.read_chunk(want - got, true)).await {
                Err(_) => {
                    return Err(Error::PeerSilent {
                        peer: peer.clone(),
                        detail: format!(
                            "chunk {index} stalled: no bytes for {idle:?} after {got} of {want}"
                        ),
                    });
                }
                Ok(Err(e)) => return Err(peer_err(peer, e)),
                Ok(Ok(None)) => {
                    return Err(peer_err(
                        peer,
                        format!("chunk {index} ended after {got} of {want} bytes"),
                    ));
                }
                Ok(Ok(Some(piece))) => {
                    buf.extend_from_slice(&piece.bytes);
                    received.store(buf.len(), Ordering::Release);
                }
            }
        }
        Ok(buf)
    }
}

impl PeerLink {
    pub(super) async fn open(&self) -> Result<(quinn::SendStream, quinn::RecvStream)> {
        self.conn
            .open_bi()
            .await
            .map_err(|e| peer_err(&self.peer_id, e))
    }

    /// The UDP payload size the path reached through MTU discovery.
    pub fn path_mtu(&self) -> u16 {
        self.conn.stats().path.current_mtu
    }

    /// Whether the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }
}
