//! Length-delimited frames: a u32 big-endian body length, then a protobuf body.
//!
//! The length is checked against the channel's limit before a byte of the body
//! is read or allocated, so a hostile peer cannot make us buffer more than the
//! limit. The body is only decoded once it is complete.

use crate::digest::BlobDigest;
use crate::pb::{self, peer_message::Body};
use prost::Message;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 4;
/// Limit for peer-protocol control frames. Chunk bytes travel raw after a
/// `PieceHeader`, not inside frames; a bitfield of 512 Ki chunks (2 TiB of 4 MiB
/// chunks) is 64 KiB.
pub const MAX_PEER_FRAME: usize = 80 << 10;
/// Limit for tracker frames (announces of many blobs, chunk maps of large blobs:
/// a 100 GiB blob in 4 MiB chunks has a 0.8 MiB map).
pub const MAX_TRACKER_FRAME: usize = 4 << 20;
/// Most chunks one `ChunkRequest` may ask for.
pub const MAX_REQUEST_CHUNKS: u32 = 64;
/// Longest a `BitfieldRequest` may be held, ms; a longer `wait_ms` is capped.
pub const MAX_BITFIELD_WAIT_MS: u32 = 2_000;
/// Most chunk hashes one `Bitfield` answer carries (about 40 KiB): an asker
/// missing more asks again.
pub const MAX_HASHES_PER_ANSWER: usize = 1024;

/// Why a frame or message was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error("frame body is not a valid {what} message: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error("protocol violation: {0}")]
    Violation(String),
}

/// Encodes `msg` as one frame, refusing to produce one the receiver would refuse.
pub fn encode<M: Message>(msg: &M, limit: usize) -> Result<Vec<u8>, FrameError> {
    let len = msg.encoded_len();
    if len > limit {
        return Err(FrameError::TooLarge { len, limit });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(&mut out).expect("Vec grows as needed");
    Ok(out)
}

/// Reads a frame header; the body length, if within `limit`.
pub fn body_len(header: [u8; HEADER_LEN], limit: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > limit {
        return Err(FrameError::TooLarge { len, limit });
    }
    Ok(len)
}

/// Decodes a complete frame body.
pub fn decode<M: Message + Default>(body: &[u8]) -> Result<M, FrameError> {
    M::decode(body).map_err(|source| FrameError::Decode {
        what: std::any::type_name::<M>()
            .rsplit("::")
            .next()
            .unwrap_or("protobuf"),
        source,
    })
}

/// Takes one whole frame off the front of `buf`: the message and the bytes used,
/// or `None` when more bytes are needed.
pub fn take<M: Message + Default>(
    buf: &[u8],
    limit: usize,
) -> Result<Option<(M, usize)>, FrameError> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = body_len(header.try_into().expect("4 bytes"), limit)?;
    let Some(body) = buf.get(HEADER_LEN..HEADER_LEN + len) else {
        return Ok(None);
    };
    Ok(Some((decode(body)?, HEADER_LEN + len)))
}

/// A request a peer may make on a new stream, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerRequest {
    /// Answer at once, or once more than `wait_above` chunks are held (or
    /// the blob completes or fails) if that comes within `wait_ms`
    /// (at most [`MAX_BITFIELD_WAIT_MS`]).
    Bitfield {
        digest: BlobDigest,
        wait_above: u32,
        wait_ms: u32,
        /// Asked for the hashes of held chunks: the bitfield of chunks whose
        /// hashes the asker knows (empty: none). None: no hashes wanted.
        known: Option<bytes::Bytes>,
    },
    Chunks {
        digest: BlobDigest,
        first: u32,
        count: u32,
    },
}

fn parse_digest(s: &str) -> Result<BlobDigest, FrameError> {
    s.parse()
        .map_err(|e: crate::DigestError| FrameError::Violation(e.to_string()))
}

impl PeerRequest {
    /// Validates the first message of a request stream.
    pub fn from_pb(msg: pb::PeerMessage) -> Result<Self, FrameError> {
        match msg.body {
            Some(Body::BitfieldRequest(r)) => Ok(Self::Bitfield {
                digest: parse_digest(&r.digest)?,
                wait_above: r.wait_above,
                wait_ms: r.wait_ms.min(MAX_BITFIELD_WAIT_MS),
                known: r.with_hashes.then_some(r.known),
            }),
            Some(Body::Request(r)) => {
                if r.count == 0 || r.count > MAX_REQUEST_CHUNKS {
                    return Err(FrameError::Violation(format!(
                        "chunk request for {} chunks (must be 1..={MAX_REQUEST_CHUNKS})",
                        r.count
                    )));
                }
                if r.first.checked_add(r.count).is_none() {
                    return Err(FrameError::Violation(
                        "chunk request range overflows".into(),
                    ));
                }
                Ok(Self::Chunks {
                    digest: parse_digest(&r.digest)?,
                    first: r.first,
                    count: r.count,
                })
            }
            Some(other) => Err(FrameError::Violation(format!(
                "a request stream must start with a bitfield or chunk request, not {}",
                body_name(&other)
            ))),
            None => Err(FrameError::Violation("empty peer message".into())),
        }
    }

    pub fn to_pb(&self) -> pb::PeerMessage {
        let body = match self {
            Self::Bitfield {
                digest,
                wait_above,
                wait_ms,
                known,
            } => Body::BitfieldRequest(pb::BitfieldRequest {
                digest: digest.to_string(),
                wait_above: *wait_above,
                wait_ms: *wait_ms,
                with_hashes: known.is_some(),
                known: known.clone().unwrap_or_default(),
            }),
            Self::Chunks {
                digest,
                first,
                count,
            } => Body::Request(pb::ChunkRequest {
                digest: digest.to_string(),
                first: *first,
                count: *count,
            }),
        };
        pb::PeerMessage { body: Some(body) }
    }
}

/// The name of a peer message kind, for error messages.
pub fn body_name(body: &Body) -> &'static str {
    match body {
        Body::Hello(_) => "hello",
        Body::BitfieldRequest(_) => "bitfield request",
        Body::Bitfield(_) => "bitfield",
        Body::Have(_) => "have",
        Body::Request(_) => "chunk request",
        Body::Piece(_) => "piece header",
        Body::Cancel(_) => "cancel",
        Body::Reject(_) => "reject",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trips_a_request() {
        let req = PeerRequest::Chunks {
            digest: BlobDigest::of(b"x"),
            first: 3,
            count: 2,
        };
        let frame = encode(&req.to_pb(), MAX_PEER_FRAME).unwrap();
        let (msg, used) = take::<pb::PeerMessage>(&frame, MAX_PEER_FRAME)
            .unwrap()
            .unwrap();
        assert_eq!(used, frame.len());
        assert_eq!(PeerRequest::from_pb(msg).unwrap(), req);
        assert!(
            take::<pb::PeerMessage>(&frame[..frame.len() - 1], MAX_PEER_FRAME)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn round_trips_a_long_polled_bitfield_request_and_caps_its_wait() {
        let req = PeerRequest::Bitfield {
            digest: BlobDigest::of(b"x"),
            wait_above: 7,
            wait_ms: 1_000,
            known: None,
        };
        assert_eq!(PeerRequest::from_pb(req.to_pb()).unwrap(), req);
        let req = PeerRequest::Bitfield {
            digest: BlobDigest::of(b"x"),
            wait_above: 7,
            wait_ms: 1_000,
            known: Some(bytes::Bytes::from_static(&[0b1010_0000])),
        };
        assert_eq!(PeerRequest::from_pb(req.to_pb()).unwrap(), req);
        let none_known = PeerRequest::Bitfield {
            digest: BlobDigest::of(b"x"),
            wait_above: 0,
            wait_ms: 0,
            known: Some(bytes::Bytes::new()),
        };
        assert_eq!(
            PeerRequest::from_pb(none_known.to_pb()).unwrap(),
            none_known
        );
        assert_eq!(PeerRequest::from_pb(req.to_pb()).unwrap(), req);
        let greedy = PeerRequest::Bitfield {
            digest: BlobDigest::of(b"x"),
            wait_above: 7,
            wait_ms: u32::MAX,
            known: None,
        };
        assert_eq!(
            PeerRequest::from_pb(greedy.to_pb()).unwrap(),
            PeerRequest::Bitfield {
                digest: BlobDigest::of(b"x"),
                wait_above: 7,
                wait_ms: MAX_BITFIELD_WAIT_MS,
                known: None,
            }
        );
        // What a peer that predates the wait fields sends: a plain, immediate ask.
        let old = pb::PeerMessage {
            body: Some(Body::BitfieldRequest(pb::BitfieldRequest {
                digest: BlobDigest::of(b"x").to_string(),
                ..Default::default()
            })),
        };
        assert_eq!(
            PeerRequest::from_pb(old).unwrap(),
            PeerRequest::Bitfield {
                digest: BlobDigest::of(b"x"),
                wait_above: 0,
                wait_ms: 0,
                known: None,
            }
        );
    }

    #[test]
    fn refuses_oversized_frames_before_reading_the_body() {
        let header = (MAX_PEER_FRAME as u32 + 1).to_be_bytes();
        let err = take::<pb::PeerMessage>(&header, MAX_PEER_FRAME).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "frame of {} bytes exceeds the limit of {MAX_PEER_FRAME} bytes",
                MAX_PEER_FRAME + 1
            )
        );
    }

    #[test]
    fn refuses_requests_outside_limits() {
        let d = BlobDigest::of(b"x").to_string();
        let too_many = pb::PeerMessage {
            body: Some(Body::Request(pb::ChunkRequest {
                digest: d.clone(),
                first: 0,
                count: 65,
            })),
        };
        assert!(PeerRequest::from_pb(too_many).is_err());
        let overflow = pb::PeerMessage {
            body: Some(Body::Request(pb::ChunkRequest {
                digest: d,
                first: u32::MAX,
                count: 2,
            })),
        };
        assert!(PeerRequest::from_pb(overflow).is_err());
        let hello = pb::PeerMessage {
            body: Some(Body::Hello(pb::Hello {
                version: 1,
                peer_id: "a".into(),
            })),
        };
        assert!(
            PeerRequest::from_pb(hello)
                .unwrap_err()
                .to_string()
                .contains("not hello")
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Hostile bytes never panic any decoder and never pass the frame limit.
        #[test]
        fn random_bytes_never_panic_any_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            for limit in [16usize, MAX_PEER_FRAME] {
                if let Ok(Some((msg, used))) = take::<pb::PeerMessage>(&bytes, limit) {
                    prop_assert!(used <= HEADER_LEN + limit);
                    let _ = PeerRequest::from_pb(msg);
                }
                if let Ok(Some((msg, _))) = take::<pb::ChunkMap>(&bytes, limit) {
                    let _ = crate::ChunkMap::from_pb(&msg);
                }
                let _ = take::<pb::TrackerRequest>(&bytes, limit);
                let _ = take::<pb::AnnounceResponse>(&bytes, limit);
            }
            let _ = decode::<pb::PeerMessage>(&bytes);
            let _ = decode::<pb::TrackerRequest>(&bytes);
            if let Ok(m) = decode::<pb::ChunkMap>(&bytes) {
                let _ = crate::ChunkMap::from_pb(&m);
            }
        }

        /// Valid frames with random bodies are decoded or refused with an error.
        #[test]
        fn framed_random_bodies_are_decoded_or_refused(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut frame = (body.len() as u32).to_be_bytes().to_vec();
            frame.extend_from_slice(&body);
            match take::<pb::PeerMessage>(&frame, MAX_PEER_FRAME) {
                Ok(Some((msg, used))) => {
                    prop_assert_eq!(used, frame.len());
                    let _ = PeerRequest::from_pb(msg);
                }
                Ok(None) => prop_assert!(false, "a whole frame must decode or fail"),
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
