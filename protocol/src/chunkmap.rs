//! Chunk maps: how a blob is cut into fixed-size chunks, the hash of each, and
//! the checks a chunk and a whole blob must pass before they are trusted.
//!
//! A chunk's hash is BLAKE3 of its bytes, independent of every other chunk, so a
//! node that fetched only chunks 40..48 from the registry can publish their hashes.
//! A map may therefore be partial: hashes not yet published are unknown, and a
//! chunk with an unknown hash cannot be accepted from a peer.
//! The blob as a whole is checked against its OCI sha256 digest by [`PrefixHasher`],
//! which hashes the verified chunks in order as the contiguous prefix grows.

use crate::digest::BlobDigest;
use crate::pb;
use sha2::Digest as _;

/// Smallest chunk size accepted from the wire.
pub const MIN_CHUNK_SIZE: u32 = 64 << 10;
/// Largest chunk size accepted from the wire (a chunk is buffered whole while it is checked).
pub const MAX_CHUNK_SIZE: u32 = 64 << 20;
/// Largest blob accepted from the wire: 1 TiB.
pub const MAX_BLOB_SIZE: u64 = 1 << 40;

/// A BLAKE3 chunk hash.
pub type ChunkHash = [u8; 32];

/// The hash a chunk must have.
pub fn chunk_hash(bytes: &[u8]) -> ChunkHash {
    *blake3::hash(bytes).as_bytes()
}

/// Whether bytes hashing to `got` are the chunk whose hash is `want`: the
/// check [`ChunkMap::verify_chunk`] makes of every chunk a peer sends (the
/// simulator, whose chunks carry no bytes, makes it on their hashes).
#[inline]
pub fn hash_matches(want: &ChunkHash, got: &ChunkHash) -> bool {
    want == got || crate::planted::is(crate::planted::Bug::HashUnchecked)
}

/// A validated chunk map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkMap {
    digest: BlobDigest,
    size: u64,
    chunk_size: u32,
    hashes: Vec<Option<ChunkHash>>,
}

/// Why a chunk map, chunk or blob is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("chunk map for {digest}: {reason}")]
    BadMap { digest: String, reason: String },
    #[error("chunk {index} of {digest} is out of range (the blob has {count} chunks)")]
    OutOfRange {
        digest: BlobDigest,
        index: u32,
        count: u32,
    },
    #[error("chunk {index} of {digest} is {got} bytes, expected {want}")]
    ChunkLength {
        digest: BlobDigest,
        index: u32,
        got: usize,
        want: usize,
    },
    #[error("chunk {index} of {digest} does not match its hash in the chunk map")]
    ChunkHash { digest: BlobDigest, index: u32 },
    #[error("chunk {index} of {digest} has no published hash yet")]
    HashUnknown { digest: BlobDigest, index: u32 },
    #[error("chunk {index} of {digest} was published with two different hashes")]
    HashConflict { digest: BlobDigest, index: u32 },
    #[error("blob assembled from verified chunks hashes to {got}, not its digest {digest}")]
    BlobDigest { digest: BlobDigest, got: BlobDigest },
}

impl ChunkMap {
    /// Builds a complete map from chunk hashes, checking that they fit the size.
    pub fn new(
        digest: BlobDigest,
        size: u64,
        chunk_size: u32,
        hashes: Vec<ChunkHash>,
    ) -> Result<Self, VerifyError> {
        Self::partial(
            digest,
            size,
            chunk_size,
            hashes.into_iter().map(Some).collect(),
        )
    }

    /// A map whose hashes are all still unknown. It allocates a slot per
    /// chunk: a size from the wire goes through [`chunk_count`] and the
    /// caller's limit first.
    pub fn unhashed(digest: BlobDigest, size: u64, chunk_size: u32) -> Result<Self, VerifyError> {
        let count = check_geometry(digest, size, chunk_size)?;
        Self::partial(digest, size, chunk_size, vec![None; count as usize])
    }

    /// Builds a map in which some hashes may be unknown.
    pub fn partial(
        digest: BlobDigest,
        size: u64,
        chunk_size: u32,
        hashes: Vec<Option<ChunkHash>>,
    ) -> Result<Self, VerifyError> {
        let want = check_geometry(digest, size, chunk_size)?;
        if hashes.len() as u64 != want {
            return Err(VerifyError::BadMap {
                digest: digest.to_string(),
                reason: format!("{} chunk hashes for {want} chunks", hashes.len()),
            });
        }
        Ok(Self {
            digest,
            size,
            chunk_size,
            hashes,
        })
    }

    /// Hashes a whole blob held in memory (tests, small blobs).
    pub fn of_bytes(bytes: &[u8], chunk_size: u32) -> Result<Self, VerifyError> {
        let hashes = bytes.chunks(chunk_size as usize).map(chunk_hash).collect();
        Self::new(
            BlobDigest::of(bytes),
            bytes.len() as u64,
            chunk_size,
            hashes,
        )
    }

    pub fn digest(&self) -> BlobDigest {
        self.digest
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    pub fn chunk_count(&self) -> u32 {
        self.hashes.len() as u32
    }

    pub fn hashes(&self) -> &[Option<ChunkHash>] {
        &self.hashes
    }

    /// Chunks whose hash is known.
    pub fn known(&self) -> crate::Bitfield {
        let mut b = crate::Bitfield::new(self.chunk_count());
        for (i, h) in self.hashes.iter().enumerate() {
            if h.is_some() {
                b.set(i as u32);
            }
        }
        b
    }

    /// Records chunk `index`'s hash; returns whether it was new. A different
    /// hash for a chunk already hashed is refused.
    pub fn set_hash(&mut self, index: u32, hash: ChunkHash) -> Result<bool, VerifyError> {
        let (digest, count) = (self.digest, self.chunk_count());
        match self.hashes.get_mut(index as usize) {
            None => Err(VerifyError::OutOfRange {
                digest,
                index,
                count,
            }),
            Some(Some(h)) if *h == hash => Ok(false),
            Some(Some(_)) => Err(VerifyError::HashConflict { digest, index }),
            Some(slot) => {
                *slot = Some(hash);
                Ok(true)
            }
        }
    }

    /// Sets chunk `index`'s hash whatever it was; returns the one it replaced
    /// (`None` if it had none or the same).
    pub fn replace_hash(
        &mut self,
        index: u32,
        hash: ChunkHash,
    ) -> Result<Option<ChunkHash>, VerifyError> {
        Ok(self.slot(index)?.replace(hash).filter(|old| *old != hash))
    }

    /// Chunk `index`'s hash slot, or the error naming an index out of range.
    fn slot(&mut self, index: u32) -> Result<&mut Option<ChunkHash>, VerifyError> {
        let (digest, count) = (self.digest, self.chunk_count());
        self.hashes
            .get_mut(index as usize)
            .ok_or(VerifyError::OutOfRange {
                digest,
                index,
                count,
            })
    }

    /// Forgets chunk `index`'s hash (a claim ruled a lie); returns whether
    /// it had one.
    pub fn clear_hash(&mut self, index: u32) -> Result<bool, VerifyError> {
        Ok(self.slot(index)?.take().is_some())
    }

    /// Takes every hash `other` knows that this map lacks; refuses conflicts
    /// and maps of another blob or geometry.
    pub fn merge(&mut self, other: &ChunkMap) -> Result<u32, VerifyError> {
        if (other.digest, other.size, other.chunk_size) != (self.digest, self.size, self.chunk_size)
        {
            return Err(VerifyError::BadMap {
                digest: self.digest.to_string(),
                reason: format!(
                    "cannot merge a map of {} bytes in {}-byte chunks into one of {} bytes in {}-byte chunks",
                    other.size, other.chunk_size, self.size, self.chunk_size
                ),
            });
        }
        let mut added = 0;
        for (i, h) in other.hashes.iter().enumerate() {
            if let Some(h) = h {
                added += u32::from(self.set_hash(i as u32, *h)?);
            }
        }
        Ok(added)
    }

    /// Byte offset of chunk `index`.
    pub fn offset(&self, index: u32) -> u64 {
        u64::from(index) * u64::from(self.chunk_size)
    }

    /// Length of chunk `index` (the last one may be short).
    pub fn chunk_len(&self, index: u32) -> usize {
        let start = self.offset(index);
        (self.size.saturating_sub(start)).min(u64::from(self.chunk_size)) as usize
    }

    /// Checks `bytes` as chunk `index`.
    pub fn verify_chunk(&self, index: u32, bytes: &[u8]) -> Result<(), VerifyError> {
        let Some(want_hash) = self.hashes.get(index as usize) else {
            return Err(VerifyError::OutOfRange {
                digest: self.digest,
                index,
                count: self.chunk_count(),
            });
        };
        let Some(want_hash) = want_hash else {
            return Err(VerifyError::HashUnknown {
                digest: self.digest,
                index,
            });
        };
        let want = self.chunk_len(index);
        if bytes.len() != want {
            return Err(VerifyError::ChunkLength {
                digest: self.digest,
                index,
                got: bytes.len(),
                want,
            });
        }
        if !hash_matches(want_hash, &chunk_hash(bytes)) {
            return Err(VerifyError::ChunkHash {
                digest: self.digest,
                index,
            });
        }
        Ok(())
    }

    pub fn to_pb(&self) -> pb::ChunkMap {
        pb::ChunkMap {
            digest: self.digest.to_string(),
            size: self.size,
            chunk_size: self.chunk_size,
            // An unknown hash travels as empty bytes.
            chunk_hashes: self
                .hashes
                .iter()
                .map(|h| h.map(|h| h.to_vec().into()).unwrap_or_default())
                .collect(),
        }
    }

    /// Validates a map received from the wire.
    pub fn from_pb(m: &pb::ChunkMap) -> Result<Self, VerifyError> {
        let digest: BlobDigest =
            m.digest
                .parse()
                .map_err(|e: crate::DigestError| VerifyError::BadMap {
                    digest: m.digest.chars().take(80).collect(),
                    reason: e.to_string(),
                })?;
        let mut hashes = Vec::with_capacity(m.chunk_hashes.len());
        for (i, h) in m.chunk_hashes.iter().enumerate() {
            if h.is_empty() {
                hashes.push(None);
                continue;
            }
            let h: ChunkHash = h.as_ref().try_into().map_err(|_| VerifyError::BadMap {
                digest: digest.to_string(),
                reason: format!(
                    "chunk hash {i} is {} bytes, not 32 (or 0 when unknown)",
                    h.len()
                ),
            })?;
            hashes.push(Some(h));
        }
        Self::partial(digest, m.size, m.chunk_size, hashes)
    }
}

/// The chunk count of a blob of `size` bytes in `chunk_size`-byte chunks,
/// checked as [`ChunkMap::unhashed`] checks it but allocating nothing, so
/// that a caller can hold it against its own limit first.
pub fn chunk_count(digest: BlobDigest, size: u64, chunk_size: u32) -> Result<u32, VerifyError> {
    let count = check_geometry(digest, size, chunk_size)?;
    // At most 2^40 / 2^16 = 2^24 chunks: always fits.
    Ok(u32::try_from(count).unwrap_or(u32::MAX))
}

/// Checks a blob's size and chunk size; returns the chunk count.
fn check_geometry(digest: BlobDigest, size: u64, chunk_size: u32) -> Result<u64, VerifyError> {
    let bad = |reason: String| VerifyError::BadMap {
        digest: digest.to_string(),
        reason,
    };
    if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) || !chunk_size.is_multiple_of(64) {
        return Err(bad(format!(
            "chunk size {chunk_size} must be a multiple of 64 between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE}"
        )));
    }
    if size > MAX_BLOB_SIZE {
        return Err(bad(format!(
            "size {size} exceeds the limit of {MAX_BLOB_SIZE} bytes"
        )));
    }
    Ok(size.div_ceil(u64::from(chunk_size)))
}

/// Builds a chunk map while a blob streams past, in order (for a node that reads
/// the whole blob, e.g. from the registry or a local file).
pub struct ChunkMapBuilder {
    chunk_size: u32,
    size: u64,
    sha: sha2::Sha256,
    chunk: blake3::Hasher,
    in_chunk: u64,
    hashes: Vec<ChunkHash>,
}

impl ChunkMapBuilder {
    pub fn new(chunk_size: u32) -> Self {
        Self {
            chunk_size,
            size: 0,
            sha: sha2::Sha256::new(),
            chunk: blake3::Hasher::new(),
            in_chunk: 0,
            hashes: Vec::new(),
        }
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.sha.update(bytes);
        self.size += bytes.len() as u64;
        while !bytes.is_empty() {
            let room = (u64::from(self.chunk_size) - self.in_chunk) as usize;
            let take = room.min(bytes.len());
            self.chunk.update(&bytes[..take]);
            self.in_chunk += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == u64::from(self.chunk_size) {
                self.hashes.push(*self.chunk.finalize().as_bytes());
                self.chunk.reset();
                self.in_chunk = 0;
            }
        }
    }

    /// Finishes the map. When `expected` is given, the streamed bytes must hash to it.
    pub fn finish(mut self, expected: Option<BlobDigest>) -> Result<ChunkMap, VerifyError> {
        if self.in_chunk > 0 {
            self.hashes.push(*self.chunk.finalize().as_bytes());
        }
        let got = BlobDigest::from_bytes(self.sha.finalize().into());
        if let Some(digest) = expected
            && digest != got
        {
            return Err(VerifyError::BlobDigest { digest, got });
        }
        ChunkMap::new(got, self.size, self.chunk_size, self.hashes)
    }
}

/// Hashes a blob's verified chunks in order, so that the whole blob is checked
/// against its digest as soon as its last chunk arrives, with no second pass.
pub struct PrefixHasher {
    sha: sha2::Sha256,
    next: u32,
}

impl Default for PrefixHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixHasher {
    pub fn new() -> Self {
        Self {
            sha: sha2::Sha256::new(),
            next: 0,
        }
    }

    /// The index of the next chunk this hasher needs.
    pub fn next_chunk(&self) -> u32 {
        self.next
    }

    /// Feeds chunk `self.next_chunk()`.
    pub fn push(&mut self, bytes: &[u8]) {
        self.sha.update(bytes);
        self.next += 1;
    }

    /// After every chunk was pushed: does the blob match its digest?
    pub fn finish(self, map: &ChunkMap) -> Result<(), VerifyError> {
        debug_assert_eq!(self.next, map.chunk_count());
        let got = BlobDigest::from_bytes(self.sha.finalize().into());
        if got != map.digest() {
            return Err(VerifyError::BlobDigest {
                digest: map.digest(),
                got,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_count_is_checked_without_allocating_a_slot_per_chunk() {
        let d = BlobDigest::of(b"x");
        assert_eq!(chunk_count(d, MAX_BLOB_SIZE, MIN_CHUNK_SIZE), Ok(1 << 24));
        assert_eq!(chunk_count(d, 0, MIN_CHUNK_SIZE), Ok(0));
        let err = chunk_count(d, MAX_BLOB_SIZE + 1, MIN_CHUNK_SIZE).unwrap_err();
        assert!(
            err.to_string()
                .contains("exceeds the limit of 1099511627776 bytes"),
            "{err}"
        );
    }

    fn blob(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn builder_matches_in_memory_map_and_digest() {
        let data = blob(300_000);
        let whole = ChunkMap::of_bytes(&data, MIN_CHUNK_SIZE).unwrap();
        let mut b = ChunkMapBuilder::new(MIN_CHUNK_SIZE);
        for piece in data.chunks(777) {
            b.update(piece);
        }
        let streamed = b.finish(Some(BlobDigest::of(&data))).unwrap();
        assert_eq!(whole, streamed);
        assert_eq!(whole.chunk_count(), 5);
        assert_eq!(whole.chunk_len(4), 300_000 - 4 * 65536);
    }

    #[test]
    fn verifies_chunks_and_rejects_tampering() {
        let data = blob(200_000);
        let map = ChunkMap::of_bytes(&data, MIN_CHUNK_SIZE).unwrap();
        let c1 = &data[65536..131072];
        map.verify_chunk(1, c1).unwrap();
        let mut bad = c1.to_vec();
        bad[5] ^= 1;
        assert!(matches!(
            map.verify_chunk(1, &bad),
            Err(VerifyError::ChunkHash { index: 1, .. })
        ));
        assert!(matches!(
            map.verify_chunk(0, c1).unwrap_err(),
            VerifyError::ChunkHash { .. }
        ));
        assert!(matches!(
            map.verify_chunk(3, &[]),
            Err(VerifyError::ChunkLength { .. } | VerifyError::OutOfRange { .. })
        ));
        assert!(matches!(
            map.verify_chunk(9, c1),
            Err(VerifyError::OutOfRange { .. })
        ));
    }

    #[test]
    fn prefix_hasher_checks_the_blob_digest() {
        let data = blob(200_000);
        let map = ChunkMap::of_bytes(&data, MIN_CHUNK_SIZE).unwrap();
        let mut ok = PrefixHasher::new();
        let mut bad = PrefixHasher::new();
        for (i, c) in data.chunks(65536).enumerate() {
            ok.push(c);
            bad.push(if i == 2 { &c[..1] } else { c });
        }
        ok.finish(&map).unwrap();
        assert!(matches!(
            bad.finish(&map),
            Err(VerifyError::BlobDigest { .. })
        ));
    }

    #[test]
    fn partial_maps_learn_hashes_and_refuse_conflicts() {
        let data = blob(200_000);
        let full = ChunkMap::of_bytes(&data, MIN_CHUNK_SIZE).unwrap();
        let mut m = ChunkMap::unhashed(full.digest(), full.size(), full.chunk_size()).unwrap();
        assert_eq!(m.chunk_count(), 4);
        assert_eq!(m.known().count(), 0);
        assert!(m.set_hash(2, full.hashes()[2].unwrap()).unwrap());
        assert!(!m.set_hash(2, full.hashes()[2].unwrap()).unwrap());
        assert!(matches!(
            m.set_hash(2, [0; 32]),
            Err(VerifyError::HashConflict { index: 2, .. })
        ));
        assert_eq!(m.merge(&full).unwrap(), 3);
        assert_eq!(m, full);
        let other = ChunkMap::unhashed(full.digest(), full.size() + 1, full.chunk_size()).unwrap();
        assert!(m.merge(&other).is_err());
    }

    #[test]
    fn refuses_maps_that_do_not_fit() {
        let data = blob(200_000);
        let map = ChunkMap::of_bytes(&data, MIN_CHUNK_SIZE).unwrap();
        let mut pb = map.to_pb();
        assert_eq!(ChunkMap::from_pb(&pb).unwrap(), map);
        pb.chunk_hashes.pop();
        assert!(
            ChunkMap::from_pb(&pb)
                .unwrap_err()
                .to_string()
                .contains("3 chunk hashes for 4 chunks")
        );
        let mut pb = map.to_pb();
        pb.chunk_size = 65537;
        assert!(ChunkMap::from_pb(&pb).is_err());
        let mut pb = map.to_pb();
        pb.chunk_hashes[0] = vec![1, 2].into();
        assert!(
            ChunkMap::from_pb(&pb)
                .unwrap_err()
                .to_string()
                .contains("not 32")
        );
        let mut pb = map.to_pb();
        pb.size = u64::MAX;
        assert!(ChunkMap::from_pb(&pb).is_err());
    }
}
