//! The chunk store: each blob is one file, preallocated to its size, into which
//! verified chunks are written at their offset.
//!
//! Trust rules:
//! - a chunk is checked against its chunk map before its bytes are written;
//! - a chunk is recorded as held in the [`CompletionLog`] only after the file's
//!   data has been synced (group commit: [`ChunkStore::persist`] syncs once for
//!   every chunk written since the last call);
//! - the blob's sha256 digest is checked by hashing the verified in-order prefix
//!   as it grows; a blob is marked complete only when that matches;
//! - on restart a partial blob's chunks are read back and re-verified, so a
//!   half-written chunk is never trusted, and chunks that reached the file but
//!   not the log (a `kill -9` leaves them in the page cache) are recovered.
//!
//! Memory does not grow with blob size: the store holds one bitfield per blob and
//! reads chunks from disk when they are needed.
//!
//! File descriptors do not grow with the number of blobs: a blob is open (an
//! [`Arc<Blob>`] with its file) while anyone outside the store holds it (a
//! pull, a mirror stream, an upload, an unpack), and at most
//! `max_open_idle_blobs` idle ones stay open besides, the least recently used
//! closed first. A closed blob is reopened from its record when it is asked
//! for; what the store holds ([`ChunkStore::holdings`], its usage, the
//! collector's candidates) is read from the records, not from open files.

pub mod gc;

use crate::bounded::BoundedMap;
use crate::error::{Error, Result};
use dray_protocol::chunkmap::{ChunkHash, ChunkMapBuilder, PrefixHasher, chunk_hash};
use dray_protocol::{Bitfield, BlobDigest, ChunkMap, VerifyError, pb};
use prost::Message;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

/// Durable record of what the store holds. Implementations must have made a
/// `save` durable by the time it returns.
pub trait CompletionLog: Send + Sync + 'static {
    fn load(&self, digest: &BlobDigest) -> Result<Option<LogRecord>>;
    fn save(&self, digest: &BlobDigest, record: &LogRecord) -> Result<()>;
    /// Forgets a blob's record and its origins.
    fn remove(&self, digest: &BlobDigest) -> Result<()>;
    /// Every blob with a record.
    fn digests(&self) -> Result<Vec<BlobDigest>>;
    /// The registries (base URLs) the blob's bytes were pulled from.
    fn origins(&self, digest: &BlobDigest) -> Result<Vec<String>>;
    /// Records one more registry the blob's bytes are pulled from, durably.
    fn add_origin(&self, digest: &BlobDigest, origin: &str) -> Result<()>;
}

/// One blob's durable state.
#[derive(Clone, Debug, PartialEq)]
pub struct LogRecord {
    pub map: ChunkMap,
    /// Chunks whose bytes were synced to disk before this record was saved.
    pub held: Bitfield,
    /// The whole blob matched its digest.
    pub complete: bool,
}

/// [`CompletionLog`] on sled: one key per blob, flushed on every save; the
/// origins in a tree of their own, so that records keep their layout.
pub struct SledLog {
    db: sled::Db,
    origins: sled::Tree,
}

/// Origins kept per blob; the oldest is dropped past this. A blob is
/// normally named by one registry, a few when mirrors of it are configured.
const MAX_ORIGINS: usize = 8;

/// Bytes per `pwrite` of a chunk into its blob file. Kernels with large page
/// cache folios size a new folio by the write that creates it, and a large
/// folio can cost far more to fault in on a VM that hands free memory back
/// to its host (free page reporting); on this project's test VM 4 MiB writes
/// cost up to twenty times what 64 KiB writes did (`docs/results.md`).
const WRITE_PIECE: usize = 64 << 10;

/// Writes `bytes` at `offset` of `file` in [`WRITE_PIECE`]s, as the store
/// writes every chunk.
pub fn write_in_pieces(file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    let mut at = offset;
    for piece in bytes.chunks(WRITE_PIECE) {
        file.write_all_at(piece, at)?;
        at += piece.len() as u64;
    }
    Ok(())
}

impl SledLog {
    pub fn open(dir: &Path) -> Result<Self> {
        let db = sled::open(dir)?;
        let origins = db.open_tree("origins")?;
        Ok(Self { db, origins })
    }
}

fn corrupt(digest: &BlobDigest, what: &str) -> Error {
    Error::Db(format!("record of {digest} is corrupt: {what}"))
}

impl CompletionLog for SledLog {
    fn load(&self, digest: &BlobDigest) -> Result<Option<LogRecord>> {
        let Some(raw) = self.db.get(digest.as_bytes())? else {
            return Ok(None);
        };
        let (&flag, rest) = raw.split_first().ok_or_else(|| corrupt(digest, "empty"))?;
        let map_len = rest.get(..4).ok_or_else(|| corrupt(digest, "short"))?;
        let map_len = u32::from_be_bytes(map_len.try_into().expect("4 bytes")) as usize;
        let map_bytes = rest
            .get(4..4 + map_len)
            .ok_or_else(|| corrupt(digest, "short map"))?;
        let map = pb::ChunkMap::decode(map_bytes).map_err(|e| corrupt(digest, &e.to_string()))?;
        let map = ChunkMap::from_pb(&map)?;
        let held = Bitfield::from_bytes(map.chunk_count(), &rest[4 + map_len..])
            .map_err(|e| corrupt(digest, &e.to_string()))?;
        Ok(Some(LogRecord {
            map,
            held,
            complete: flag == 1,
        }))
    }

    fn save(&self, digest: &BlobDigest, record: &LogRecord) -> Result<()> {
        let map = record.map.to_pb().encode_to_vec();
        let mut raw = Vec::with_capacity(5 + map.len() + record.held.as_bytes().len());
        raw.push(u8::from(record.complete));
        raw.extend_from_slice(&(map.len() as u32).to_be_bytes());
        raw.extend_from_slice(&map);
        raw.extend_from_slice(record.held.as_bytes());
        self.db.insert(digest.as_bytes(), raw)?;
        self.db.flush()?;
        Ok(())
    }

    fn remove(&self, digest: &BlobDigest) -> Result<()> {
        self.db.remove(digest.as_bytes())?;
        self.origins.remove(digest.as_bytes())?;
        self.db.flush()?;
        Ok(())
    }

    fn origins(&self, digest: &BlobDigest) -> Result<Vec<String>> {
        let Some(raw) = self.origins.get(digest.as_bytes())? else {
            return Ok(Vec::new());
        };
        let text = std::str::from_utf8(&raw).map_err(|_| corrupt(digest, "origins"))?;
        Ok(text.lines().map(str::to_string).collect())
    }

    fn add_origin(&self, digest: &BlobDigest, origin: &str) -> Result<()> {
        let mut all = self.origins(digest)?;
        if all.iter().any(|o| o == origin) {
            return Ok(());
        }
        all.push(origin.to_string());
        let keep = all.len().saturating_sub(MAX_ORIGINS);
        self.origins
            .insert(digest.as_bytes(), all[keep..].join("\n").into_bytes())?;
        self.db.flush()?;
        Ok(())
    }

    fn digests(&self) -> Result<Vec<BlobDigest>> {
        let mut out = Vec::new();
        for key in self.db.iter().keys() {
            let key = key?;
            let bytes: [u8; 32] = key
                .as_ref()
                .try_into()
                .map_err(|_| Error::Db(format!("stray key of {} bytes", key.len())))?;
            out.push(BlobDigest::from_bytes(bytes));
        }
        Ok(out)
    }
}

/// What happened to a chunk handed to [`Blob::put_chunk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored; the blob still misses chunks.
    Stored,
    /// Already held; nothing written.
    Duplicate,
    /// Stored, and with it the whole blob matched its digest.
    Completed,
}

/// How far a blob has come: its verified in-order prefix (what a streaming
/// reader may read) and how many chunks it holds in all (what a peer waiting
/// for news of this blob follows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Chunks from the start that are verified and on disk.
    pub chunks: u32,
    /// Chunks verified and on disk, in any order, that this node vouches
    /// for ([`Blob::offered`]): what a watching peer follows.
    pub held: u32,
    /// The whole blob matched its digest.
    pub complete: bool,
    /// The blob failed its digest, or a chunk of its in-order prefix was
    /// replaced: readers must stop.
    pub failed: bool,
}

/// A blob in the store.
pub struct Blob {
    digest: BlobDigest,
    /// Grows as chunk hashes are published (see [`Blob::learn`]).
    map: RwLock<ChunkMap>,
    path: PathBuf,
    file: File,
    /// One chunk written at a time: concurrent buffered writes to one file
    /// queue on its inode lock, where the kernel spins (see [`WRITE_PIECE`]).
    writing: Mutex<()>,
    state: Mutex<BlobState>,
    /// Serialises the in-order digest check; never held together with `state`.
    prefix: Mutex<PrefixHasher>,
    progress: tokio::sync::watch::Sender<Progress>,
}

struct BlobState {
    held: Bitfield,
    complete: bool,
    /// What the log says is durable.
    recorded: Bitfield,
    recorded_complete: bool,
    /// How many chunk hashes the log holds.
    recorded_known: u32,
    /// Every chunk was held and the blob failed its digest: the chunks stay
    /// while the swarm rechecks them against the registry.
    failed: bool,
    /// Chunks fetched again from the registry since the blob failed.
    rechecked: Bitfield,
    /// Hashes replaced since the blob was opened, with their chunk: a peer
    /// sending such a chunk has not heard of the replacement yet and is not
    /// lying. At most `MAX_SUPERSEDED`, oldest dropped.
    superseded: Vec<(u32, ChunkHash)>,
    /// Held or hashed chunks whose hash is only a peer's word (a pull
    /// without a tracker: see [`Blob::claim_hash`]). Their bytes reach no
    /// reader, peer, announce or record until the registry or the blob's
    /// digest vouches for them.
    unvouched: Bitfield,
}

/// Replaced hashes remembered per open blob (one per recheck that found a
/// wrong chunk: a handful in a blob's life).
const MAX_SUPERSEDED: usize = 16;

impl Blob {
    /// The chunk map as known now.
    pub fn map(&self) -> ChunkMap {
        self.read_map().clone()
    }

    fn read_map(&self) -> std::sync::RwLockReadGuard<'_, ChunkMap> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_map(&self) -> std::sync::RwLockWriteGuard<'_, ChunkMap> {
        self.map.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn digest(&self) -> BlobDigest {
        self.digest
    }

    /// The chunk size the blob was cut with (fixed when it was made).
    pub fn chunk_size(&self) -> u32 {
        self.read_map().chunk_size()
    }

    /// Follows the blob as it grows: every stored chunk, completion and failure.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// Reads `len` bytes at `offset`, which must lie in the verified prefix.
    pub fn read_range(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        read_exact_uninit_at(&self.file, &mut buf, len, offset).map_err(|e| {
            Error::io(
                format!("reading {len} bytes at {offset} of {}", self.digest),
                e,
            )
        })?;
        Ok(buf)
    }

    /// Chunks whose hashes are known, without copying the map.
    pub fn known(&self) -> Bitfield {
        self.read_map().known()
    }

    /// The blob's geometry with only the known hashes of `chunks`, without
    /// copying the whole map: what a publication to the tracker carries.
    pub fn map_of(&self, chunks: impl IntoIterator<Item = u32>) -> Result<ChunkMap> {
        map_of(&self.read_map(), chunks)
    }

    /// The known hashes of `chunks`, at most `max` of them, read in place
    /// (not copying the map, as a peer's bitfield answer would per poll).
    pub fn hashes_of(
        &self,
        chunks: impl IntoIterator<Item = u32>,
        max: usize,
    ) -> Vec<(u32, dray_protocol::chunkmap::ChunkHash)> {
        let map = self.read_map();
        chunks
            .into_iter()
            .filter_map(|i| Some((i, map.hashes().get(i as usize).copied().flatten()?)))
            .take(max)
            .collect()
    }

    /// Takes the chunk hashes `map` knows that this blob lacks; returns how many.
    pub fn learn(&self, map: &ChunkMap) -> Result<u32> {
        Ok(self.write_map().merge(map)?)
    }

    /// Takes the tracker's hashes: those this map lacks, and those that
    /// differ from one it holds, which replaced it (see [`Blob::supersede`]),
    /// except for chunks rechecked here against the registry. Returns how
    /// many were new and how many held chunks were dropped.
    pub fn adopt(&self, map: &ChunkMap) -> Result<(u32, u32)> {
        if !same_geometry(&self.read_map(), map) {
            return Ok((self.learn(map)?, 0));
        }
        let (mut learned, mut dropped) = (0, 0);
        for (i, h) in map.hashes().iter().enumerate() {
            let (i, Some(h)) = (i as u32, *h) else {
                continue;
            };
            // Read first: the map's read guard must not live into the arms.
            let ours = self.read_map().hashes()[i as usize];
            match ours {
                Some(ours) if ours == h => _ = self.lock().unvouched.clear(i),
                // This node fetched the chunk again from the registry since
                // the blob failed: those bytes win over the tracker's hash
                // until it hears of them (the answer may predate the
                // publication).
                Some(_) if self.lock().rechecked.get(i) => {}
                None => learned += u32::from(self.write_map().set_hash(i, h)?),
                Some(_) => {
                    learned += 1;
                    dropped += u32::from(self.supersede(i, h)?);
                }
            }
        }
        Ok((learned, dropped))
    }

    /// Chunk `index`'s hash is `hash` from now on. A chunk held under
    /// another hash is dropped (its bytes stay on disk until overwritten);
    /// if the in-order digest check had passed it, the check starts over
    /// and streaming readers stop. Returns whether a held chunk was dropped.
    fn supersede(&self, index: u32, hash: ChunkHash) -> Result<bool> {
        let mut prefix = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let Some(old) = self.write_map().replace_hash(index, hash)? else {
            return Ok(false);
        };
        let dropped = {
            let mut st = self.lock();
            if st.superseded.len() >= MAX_SUPERSEDED {
                st.superseded.remove(0);
            }
            st.superseded.push((index, old));
            // The log holds the old hash: the next persist records the map.
            st.recorded_known = u32::MAX;
            st.failed = false;
            st.unvouched.clear(index);
            st.held.clear(index)
        };
        if dropped && prefix.next_chunk() > index {
            *prefix = PrefixHasher::new();
            // Readers stop only if they may have read the chunk; one past
            // the vouched prefix they never saw, and they read on.
            if index < self.progress.borrow().chunks {
                self.progress.send_replace(Progress {
                    failed: true,
                    ..Progress::default()
                });
            }
        }
        Ok(dropped)
    }

    /// Whether the blob held every chunk and failed its digest (the chunks
    /// stay for the swarm's recheck).
    pub fn is_failed(&self) -> bool {
        self.lock().failed
    }

    /// Whether a registry fetch of held chunk `index` is a recheck: the blob
    /// failed its digest and the chunk was not fetched again since. Marks it.
    pub fn take_recheck(&self, index: u32) -> bool {
        let mut st = self.lock();
        st.failed && st.held.get(index) && st.rechecked.set(index)
    }

    /// Recuts a blob that holds nothing yet into `map`'s chunks (the chunk
    /// size its swarm already uses), taking `map`'s hashes. False if the
    /// blob holds chunks: they stay, and so does its geometry.
    pub fn adopt_geometry(&self, map: &ChunkMap) -> Result<bool> {
        let _prefix = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let mut current = self.write_map();
        if same_geometry(&current, map) {
            current.merge(map)?;
            return Ok(true);
        }
        let mut state = self.lock();
        if state.complete || state.held.count() > 0 || map.size() != current.size() {
            return Ok(false);
        }
        *current = map.clone();
        state.held = Bitfield::new(map.chunk_count());
        state.recorded = Bitfield::new(map.chunk_count());
        state.rechecked = Bitfield::new(map.chunk_count());
        state.unvouched = Bitfield::new(map.chunk_count());
        // Not what the log holds: the next persist records the new geometry.
        state.recorded_known = u32::MAX;
        Ok(true)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn held(&self) -> Bitfield {
        self.lock().held.clone()
    }

    /// The held chunks this node vouches for: those whose hash is not only
    /// another member's word. What it offers peers, announces and records.
    pub fn offered(&self) -> Bitfield {
        let st = self.lock();
        vouched_of(&st.held, &st.unvouched)
    }

    /// Chunk `index`'s hash, if known.
    pub fn hash(&self, index: u32) -> Option<ChunkHash> {
        self.read_map()
            .hashes()
            .get(index as usize)
            .copied()
            .flatten()
    }

    /// How many chunks' hashes are only a peer's word.
    pub fn unvouched(&self) -> u32 {
        self.lock().unvouched.count()
    }

    /// Whether chunk `index`'s hash is only a peer's word.
    pub fn is_unvouched(&self, index: u32) -> bool {
        self.lock().unvouched.get(index)
    }

    /// Takes `hash` as chunk `index`'s on a peer's word alone (the caller's
    /// [`dray_protocol::pull::Arbiter`] took the claim): the chunk may be
    /// fetched and verified against it, but its bytes stay unvouched (see
    /// [`BlobState::unvouched`]). Returns whether the hash was new.
    pub fn claim_hash(&self, index: u32, hash: ChunkHash) -> Result<bool> {
        let mut map = self.write_map();
        let new = map.set_hash(index, hash)?;
        if new {
            self.lock().unvouched.set(index);
        }
        Ok(new)
    }

    /// Drops the unvouched hashes of `chunks` (their claimant lied) and the
    /// chunks held under them; returns how many held chunks went. Readers
    /// never saw them, so they read on.
    pub fn drop_claims(&self, chunks: &[u32]) -> Result<u32> {
        let mut prefix = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let mut map = self.write_map();
        let mut st = self.lock();
        let mut dropped = 0;
        let mut first = u32::MAX;
        for &i in chunks {
            if !st.unvouched.clear(i) {
                continue;
            }
            map.clear_hash(i)?;
            if st.held.clear(i) {
                dropped += 1;
                first = first.min(i);
            }
        }
        if dropped > 0 {
            st.failed = false;
            st.recorded_known = u32::MAX;
            if prefix.next_chunk() > first {
                *prefix = PrefixHasher::new();
            }
        }
        Ok(dropped)
    }

    pub fn has(&self, index: u32) -> bool {
        self.lock().held.get(index)
    }

    /// Bytes of the blob held as verified chunks.
    pub fn held_bytes(&self) -> u64 {
        let map = self.read_map();
        let state = self.lock();
        (0..map.chunk_count())
            .filter(|&i| state.held.get(i))
            .map(|i| map.chunk_len(i) as u64)
            .sum()
    }

    pub fn is_complete(&self) -> bool {
        self.lock().complete
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BlobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_at(&self, index: u32) -> Result<Vec<u8>> {
        let (len, offset) = {
            let m = self.read_map();
            (m.chunk_len(index), m.offset(index))
        };
        self.read_range(offset, len)
    }

    /// A held chunk's bytes, read from disk, to serve a peer; `None` if the
    /// chunk is not held or is held on another member's word alone.
    pub fn read_chunk(&self, index: u32) -> Result<Option<Vec<u8>>> {
        let offered = {
            let st = self.lock();
            st.held.get(index) && !st.unvouched.get(index)
        };
        if !offered {
            return Ok(None);
        }
        self.read_at(index).map(Some)
    }

    /// Verifies `bytes` as chunk `index` against the chunk map and writes it.
    /// Blocking (disk I/O and hashing): call from a blocking thread.
    ///
    /// An error for the blob digest means every chunk was verified yet the blob
    /// does not match: the chunk map was wrong. The blob is then emptied.
    ///
    /// A chunk that hashes to one its map replaced is refused as
    /// [`Error::Superseded`]: its sender had not heard of the replacement.
    pub fn put_chunk(&self, index: u32, bytes: &[u8]) -> Result<PutOutcome> {
        let checked = self.read_map().verify_chunk(index, bytes);
        if let Err(VerifyError::ChunkHash { .. }) = checked {
            let hash = chunk_hash(bytes);
            let st = self.lock();
            if st.superseded.contains(&(index, hash)) {
                return Err(Error::Superseded {
                    digest: self.digest,
                    index,
                });
            }
            if st.unvouched.get(index) {
                return Err(Error::Disputed {
                    digest: self.digest,
                    index,
                    hash,
                });
            }
        }
        checked?;
        self.write_verified(index, bytes)
    }

    /// Stores chunk `index` read from the blob's origin (the registry), and
    /// records its hash so that it can be published and checked by others.
    /// The registry's bytes win over a hash learned from the swarm: a held
    /// chunk that differs is replaced (a recheck after a digest failure
    /// finding the wrong chunk). The whole-blob digest check still guards it.
    pub fn put_origin_chunk(&self, index: u32, bytes: &[u8]) -> Result<PutOutcome> {
        let want = self.read_map().chunk_len(index);
        if bytes.len() != want || index >= self.read_map().chunk_count() {
            return Err(VerifyError::ChunkLength {
                digest: self.digest,
                index,
                got: bytes.len(),
                want,
            }
            .into());
        }
        let hash = chunk_hash(bytes);
        if self.read_map().hashes()[index as usize] == Some(hash) && self.has(index) {
            if self.lock().unvouched.clear(index) {
                // Vouched now: readers may take it (and what follows it).
                return self.advance_prefix(None).map(|_| PutOutcome::Duplicate);
            }
            return Ok(PutOutcome::Duplicate);
        }
        if self.supersede(index, hash)? {
            tracing::warn!(digest = %self.digest, index, "the registry sent other bytes for a chunk held here: replacing it");
        }
        self.lock().unvouched.clear(index);
        self.write_verified(index, bytes)
    }

    fn write_verified(&self, index: u32, bytes: &[u8]) -> Result<PutOutcome> {
        if self.has(index) {
            return Ok(PutOutcome::Duplicate);
        }
        let offset = self.read_map().offset(index);
        let writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        write_in_pieces(&self.file, bytes, offset)
            .map_err(|e| Error::io(format!("writing chunk {index} of {}", self.digest()), e))?;
        drop(writing);
        if !self.lock().held.set(index) {
            return Ok(PutOutcome::Duplicate);
        }
        self.advance_prefix(Some((index, bytes)))
    }

    /// Hashes held chunks in order from the prefix cursor; completes the blob
    /// when the last one is in. Every change of [`Progress`] is sent from here,
    /// under the prefix lock, so the last send carries the latest held count.
    fn advance_prefix(&self, fresh: Option<(u32, &[u8])>) -> Result<PutOutcome> {
        let mut prefix = self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        let count = self.read_map().chunk_count();
        while prefix.next_chunk() < count && self.has(prefix.next_chunk()) {
            let i = prefix.next_chunk();
            match fresh {
                Some((j, bytes)) if j == i => prefix.push(bytes),
                _ => prefix.push(&self.read_at(i)?),
            }
        }
        if prefix.next_chunk() < count || self.is_complete() {
            let (held, unvouched) = {
                let st = self.lock();
                // Watching peers follow what this node offers.
                let offered = vouched_of(&st.held, &st.unvouched).count();
                (offered, st.unvouched.ones().next())
            };
            // Readers take the verified prefix up to the first chunk on a
            // peer's word alone; never less than they were told (a prefix
            // check starting over reads chunks they already had).
            let chunks = prefix.next_chunk().min(unvouched.unwrap_or(count));
            self.progress.send_if_modified(|p| {
                let was = *p;
                (p.chunks, p.held) = (chunks.max(p.chunks), held);
                *p != was
            });
            return Ok(PutOutcome::Stored);
        }
        let done = std::mem::take(&mut *prefix);
        let result = done.finish(&self.read_map());
        match result {
            Ok(()) => {
                {
                    let mut st = self.lock();
                    st.complete = true;
                    st.failed = false;
                    // The digest vouches for every chunk.
                    st.unvouched = Bitfield::new(count);
                }
                self.progress.send_replace(Progress {
                    chunks: count,
                    held: count,
                    complete: true,
                    failed: false,
                });
                Ok(PutOutcome::Completed)
            }
            Err(e) => {
                let unvouched = {
                    let mut st = self.lock();
                    st.failed = true;
                    st.rechecked = Bitfield::new(count);
                    st.unvouched.count()
                };
                // Readers were handed only vouched chunks: while some are
                // on a peer's word, those are the suspects, the readers'
                // bytes stand, and they wait for the chunks to be fixed.
                if unvouched == 0 {
                    self.progress.send_replace(Progress {
                        failed: true,
                        ..Progress::default()
                    });
                }
                Err(e.into())
            }
        }
    }
}

/// The store: a directory of blob files and the completion log beside them.
pub struct ChunkStore {
    dir: PathBuf,
    log: Arc<dyn CompletionLog>,
    /// The open blobs: every one in use, and at most `max_open_idle` idle
    /// ones (see [`ChunkStore::trim`]).
    blobs: Mutex<HashMap<BlobDigest, Arc<Blob>>>,
    max_open_idle: AtomicUsize,
    sizes: Mutex<SizeRule>,
    /// Every blob with a record, open or not: what the store accounts for
    /// and announces. Locked after `blobs` when both are.
    entries: Mutex<HashMap<BlobDigest, Entry>>,
    /// Held while a new blob makes room and reserves its file (see
    /// [`ChunkStore::blob`]); taken before `blobs`.
    room: Mutex<()>,
    /// Blobs being opened (a partial one re-read and re-hashed), each with
    /// its own lock: an opener holds it while it reads the blob's file
    /// outside the `blobs` lock, so others asking for that blob wait for
    /// it alone and everything else (opens of other blobs, uploads,
    /// eviction) goes on. Taken before `blobs`; the map's own lock is held
    /// only to look up or drop an entry.
    opening: Mutex<HashMap<BlobDigest, Arc<Mutex<()>>>>,
    gc: crate::store::gc::GcState,
}

/// What the store accounts for one blob: its file is preallocated to `size`.
#[derive(Clone, Debug)]
struct Entry {
    size: u64,
    chunk_size: u32,
    complete: bool,
    /// The recorded chunks of a blob not complete (a complete one holds all).
    partial: Option<Bitfield>,
    last_used: SystemTime,
}

impl Entry {
    fn of(record: &LogRecord, last_used: SystemTime) -> Self {
        Self {
            size: record.map.size(),
            chunk_size: record.map.chunk_size(),
            complete: record.complete,
            partial: (!record.complete).then(|| record.held.clone()),
            last_used,
        }
    }
}

/// What the store holds of one blob, open or not: what an announce and
/// `dray status` report.
#[derive(Clone, Debug)]
pub struct Holding {
    pub digest: BlobDigest,
    pub size: u64,
    pub chunk_size: u32,
    /// Chunks verified and on disk (an open blob's, recorded or not yet).
    pub held: Bitfield,
    pub complete: bool,
    /// Since it was last opened, read or written.
    pub last_used: SystemTime,
}

impl Holding {
    /// Bytes of the blob held as verified chunks.
    pub fn held_bytes(&self) -> u64 {
        let chunk = u64::from(self.chunk_size);
        self.held
            .ones()
            .map(|i| chunk.min(self.size - u64::from(i) * chunk))
            .sum()
    }
}

/// The default `max_open_idle_blobs`: idle blobs kept open (one file
/// descriptor each) besides those in use. Enough for the layers of the
/// images a node starts at once; reopening a complete blob costs a record
/// read and an `open`.
pub const DEFAULT_MAX_OPEN_IDLE_BLOBS: usize = 256;

/// The most blobs an image pulled or preheated whole may list: its config
/// and 500 layers, the deepest stack overlayfs mounts.
pub const MAX_IMAGE_BLOBS: usize = 501;

/// The default `max_blob_size`: 64 GiB. Above the largest layer any public
/// registry accepts (ECR's 52,000 MiB; Docker Hub's and GHCR's 10 GB), so no
/// real layer is refused, and what one lying size can reserve on a node's
/// disk (the file is freed again when its pull fails with nothing verified).
pub const DEFAULT_MAX_BLOB_SIZE: u64 = 64 << 30;

/// The images pinned at run time (`dray pin`), in the state directory.
pub const PINS_FILE: &str = "pinned-images.json";

/// Sizes vouched for by verified manifests, kept at most.
const MAX_VOUCHED: usize = 4096;

/// What a blob may reserve on disk: at most `max`, or past it exactly a
/// size that a manifest verified by digest gave the blob. A size read from
/// a HEAD alone (a `Content-Length` anyone in front of the registry can
/// write) is capped. A vouched size only ever admits itself: it never
/// refuses another size of the blob, since any client can make the mirror
/// read a manifest of its own naming any digest with any size (the blob's
/// digest, not a manifest, decides what its bytes are).
struct SizeRule {
    max: u64,
    vouched: BoundedMap<(BlobDigest, u64), ()>,
}

impl SizeRule {
    fn check(&self, digest: &BlobDigest, size: u64) -> Result<()> {
        if size <= self.max || self.vouched.get(&(*digest, size)).is_some() {
            return Ok(());
        }
        Err(Error::BlobSize {
            digest: *digest,
            detail: format!(
                "{size} bytes is more than max_blob_size ({} bytes) and no verified manifest gives that size",
                self.max
            ),
        })
    }
}

impl ChunkStore {
    /// Opens (or creates) a store under `dir` with a sled completion log.
    pub fn open(dir: &Path) -> Result<Self> {
        let log = SledLog::open(&dir.join("log"))?;
        Self::with_log(dir, Arc::new(log))
    }

    pub fn with_log(dir: &Path, log: Arc<dyn CompletionLog>) -> Result<Self> {
        let blobs_dir = dir.join("blobs");
        std::fs::create_dir_all(&blobs_dir)
            .map_err(|e| Error::io(format!("creating {}", blobs_dir.display()), e))?;
        let store = Self {
            dir: dir.to_path_buf(),
            log,
            blobs: Mutex::new(HashMap::new()),
            max_open_idle: AtomicUsize::new(DEFAULT_MAX_OPEN_IDLE_BLOBS),
            sizes: Mutex::new(SizeRule {
                max: DEFAULT_MAX_BLOB_SIZE,
                vouched: BoundedMap::new(MAX_VOUCHED),
            }),
            entries: Mutex::new(HashMap::new()),
            room: Mutex::new(()),
            opening: Mutex::new(HashMap::new()),
            gc: crate::store::gc::GcState::default(),
        };
        // Nothing is opened here: every blob is announced from its record,
        // and opened (a partial one re-verified) when it is asked for.
        for digest in store.log.digests()? {
            let Some(rec) = store.log.load(&digest)? else {
                continue;
            };
            let path = store.blob_path(&digest);
            let file = std::fs::metadata(&path).ok();
            // A record whose file is gone or cut short (deleted by hand, or
            // a disk that lost it) would serve holes as verified bytes.
            if file.as_ref().is_none_or(|m| m.len() != rec.map.size()) {
                tracing::warn!(%digest, path = %path.display(), "the blob's file is missing or of the wrong size: forgetting the blob");
                store.remove(&digest)?;
                continue;
            }
            let last_used = file
                .and_then(|m| m.modified().ok())
                .unwrap_or_else(SystemTime::now);
            store.entries().insert(digest, Entry::of(&rec, last_used));
        }
        store.sweep()?;
        store.gc.load_pins(dir.join(PINS_FILE))?;
        Ok(store)
    }

    /// Deletes blob files without a record: an eviction or removal cut
    /// short between the two (the record goes first) leaves one.
    fn sweep(&self) -> Result<()> {
        let dir = self.dir.join("blobs");
        let listing = std::fs::read_dir(&dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        for item in listing {
            let item = item.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let name = item.file_name();
            let Some(digest) = name
                .to_str()
                .and_then(|n| format!("sha256:{n}").parse::<BlobDigest>().ok())
            else {
                continue;
            };
            if !self.entries().contains_key(&digest) {
                tracing::info!(%digest, "deleting a blob file without a record");
                std::fs::remove_file(item.path())
                    .map_err(|e| Error::io(format!("removing blob {digest}"), e))?;
            }
        }
        Ok(())
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<BlobDigest, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The garbage collector's settings and state (see [`crate::store::gc`]).
    pub fn gc(&self) -> &crate::store::gc::GcState {
        &self.gc
    }

    fn touch(&self, digest: &BlobDigest) {
        if let Some(e) = self.entries().get_mut(digest) {
            e.last_used = SystemTime::now();
        }
    }

    /// What the store holds and what its filesystem has free.
    pub fn usage(&self) -> Result<crate::store::gc::Usage> {
        let (fs_bytes, fs_free) = crate::store::gc::filesystem(&self.dir)?;
        let open_blobs = self.blobs().len();
        let entries = self.entries();
        Ok(crate::store::gc::Usage {
            store_bytes: entries.values().map(|e| e.size).sum(),
            store_blobs: entries.len(),
            open_blobs,
            fs_bytes,
            fs_free,
        })
    }

    /// Every blob the store holds, complete or partial, open or not: an open
    /// blob as it stands, a closed one as recorded.
    pub fn holdings(&self) -> Vec<Holding> {
        let open: Vec<Arc<Blob>> = self.blobs().values().cloned().collect();
        let mut out: HashMap<BlobDigest, Holding> = self
            .entries()
            .iter()
            .map(|(d, e)| {
                let held = e.partial.clone().unwrap_or_else(|| {
                    Bitfield::full(
                        dray_protocol::chunkmap::chunk_count(*d, e.size, e.chunk_size)
                            .unwrap_or_default(),
                    )
                });
                let holding = Holding {
                    digest: *d,
                    size: e.size,
                    chunk_size: e.chunk_size,
                    held,
                    complete: e.complete,
                    last_used: e.last_used,
                };
                (*d, holding)
            })
            .collect();
        for blob in open {
            if let Some(h) = out.get_mut(&blob.digest()) {
                let map = blob.read_map();
                (h.size, h.chunk_size) = (map.size(), map.chunk_size());
                drop(map);
                h.held = blob.held();
                h.complete = blob.is_complete();
            }
        }
        out.into_values().collect()
    }

    /// How many idle blobs stay open besides those in use (at least 1: the
    /// blob opened last).
    pub fn set_max_open_idle_blobs(&self, max: usize) {
        self.max_open_idle.store(max.max(1), Ordering::Relaxed);
        self.close_idle();
    }

    /// Closes idle blobs past the bound now: blobs opened by a burst of
    /// pulls or uploads stay open once idle until the next open, or this
    /// (the collector calls it every `gc.period`).
    pub(crate) fn close_idle(&self) {
        let mut blobs = self.blobs();
        self.trim(&mut blobs, None);
    }

    /// Closes the least recently used idle blobs (open, and held by nobody
    /// but the store) past `max_open_idle_blobs`, sparing `keep`, the blob
    /// just opened for a caller (it counts as idle when only that caller
    /// holds it: it is, once the caller is done). Complete ones go first:
    /// closing one loses nothing, while reopening a partial one reads its
    /// verified prefix back. Each is persisted before it is closed. Called
    /// with the blobs lock held, so nobody takes one meanwhile.
    fn trim(&self, blobs: &mut HashMap<BlobDigest, Arc<Blob>>, keep: Option<&BlobDigest>) {
        let mut max = self.max_open_idle.load(Ordering::Relaxed);
        if keep
            .and_then(|d| blobs.get(d))
            .is_some_and(|b| Arc::strong_count(b) <= 2)
        {
            max = max.saturating_sub(1);
        }
        let mut idle: Vec<(bool, SystemTime, BlobDigest)> = {
            let entries = self.entries();
            blobs
                .iter()
                .filter(|(d, b)| Arc::strong_count(b) == 1 && Some(*d) != keep)
                .map(|(d, b)| {
                    let used = entries
                        .get(d)
                        .map_or(SystemTime::UNIX_EPOCH, |e| e.last_used);
                    (!b.is_complete(), used, *d)
                })
                .collect()
        };
        if idle.len() <= max {
            return;
        }
        idle.sort_unstable();
        for (_, _, digest) in &idle[..idle.len() - max] {
            let Some(blob) = blobs.get(digest) else {
                continue;
            };
            match self.persist(blob) {
                Ok(()) => {
                    blobs.remove(digest);
                }
                Err(e) => {
                    tracing::warn!(%digest, error = %e, "could not record an idle blob's chunks: it stays open");
                }
            }
        }
    }

    /// Every blob as the collector's planner sees it.
    pub fn candidates(
        &self,
        pinned: &std::collections::HashSet<BlobDigest>,
    ) -> Vec<crate::store::gc::Candidate> {
        let now = SystemTime::now();
        let blobs = self.blobs();
        let entries = self.entries();
        entries
            .iter()
            .map(|(d, e)| {
                let open = blobs.get(d);
                crate::store::gc::Candidate {
                    digest: *d,
                    bytes: e.size,
                    complete: open.map_or(e.complete, |b| b.is_complete()),
                    idle: now.duration_since(e.last_used).unwrap_or_default(),
                    // Held by a reader, a pull or an upload besides the map.
                    in_use: open.is_some_and(|b| Arc::strong_count(b) > 1),
                    pinned: pinned.contains(d),
                    holders: self.gc.holders_of(d),
                }
            })
            .collect()
    }

    /// Deletes a blob nobody uses; returns the bytes freed, or `None` if it
    /// is in use (or gone). The whole deletion holds the blobs lock, so
    /// nobody opens the blob meanwhile. The record goes first: a crash
    /// after it leaves a file without a record, which the next start
    /// deletes, never a record whose file is half gone.
    pub fn evict(&self, digest: &BlobDigest) -> Result<Option<u64>> {
        let mut blobs = self.blobs();
        if blobs.get(digest).is_some_and(|b| Arc::strong_count(b) > 1)
            || lock(&self.opening).contains_key(digest)
        {
            return Ok(None);
        }
        let Some(size) = self.entries().get(digest).map(|e| e.size) else {
            return Ok(None);
        };
        blobs.remove(digest);
        self.log.remove(digest)?;
        self.delete_file(digest)?;
        self.entries().remove(digest);
        self.gc.forget(digest);
        Ok(Some(size))
    }

    fn delete_file(&self, digest: &BlobDigest) -> Result<()> {
        match std::fs::remove_file(self.blob_path(digest)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io(format!("removing blob {digest}"), e))
            }
            _ => Ok(()),
        }
    }

    fn sizes(&self) -> std::sync::MutexGuard<'_, SizeRule> {
        self.sizes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The largest blob opened without a verified manifest's word for its size.
    pub fn set_max_blob_size(&self, max: u64) {
        self.sizes().max = max;
    }

    /// Records a blob's size as a manifest verified by its digest gives it:
    /// the blob may then reserve exactly that much, past `max_blob_size`.
    /// Other sizes of the blob are judged as before (see [`SizeRule`]).
    pub fn vouch_size(&self, digest: BlobDigest, size: u64) {
        self.sizes().vouched.insert((digest, size), ());
    }

    /// Whether a blob of `size` bytes may be opened (see [`Self::vouch_size`]),
    /// and could ever fit in the store's budget; the refusal names the
    /// digest, the size and the limit.
    pub fn check_size(&self, digest: &BlobDigest, size: u64) -> Result<()> {
        self.sizes().check(digest, size)?;
        match self.gc.config().budget {
            Some(budget) if size > budget && !self.entries().contains_key(digest) => {
                self.gc.count_refusal();
                Err(Error::NoRoom {
                    digest: *digest,
                    size,
                    detail: format!("more than the whole gc.budget of {budget} bytes"),
                })
            }
            _ => Ok(()),
        }
    }

    /// Refuses what a pull or preheat of a whole image may not reserve: more
    /// than [`MAX_IMAGE_BLOBS`] blobs, or blobs not held yet that together
    /// could not fit even with everything else evicted
    /// ([`crate::store::gc::capacity`]). Such an image can never be held,
    /// and pulling it would only evict the node's other blobs, the
    /// cluster's last copies among them, for nothing.
    pub fn check_image(&self, blobs: &[(BlobDigest, u64)]) -> Result<()> {
        if blobs.len() > MAX_IMAGE_BLOBS {
            return Err(Error::ImageTooLarge {
                detail: format!(
                    "it lists {} blobs, more than {MAX_IMAGE_BLOBS} (its config and the 500 layers overlayfs can stack)",
                    blobs.len()
                ),
            });
        }
        let new: u64 = {
            let entries = self.entries();
            blobs
                .iter()
                .filter(|(d, _)| !entries.contains_key(d))
                .fold(0u64, |sum, (_, size)| sum.saturating_add(*size))
        };
        let capacity = crate::store::gc::capacity(&self.gc.config(), &self.usage()?);
        if new > capacity {
            self.gc.count_refusal();
            return Err(Error::ImageTooLarge {
                detail: format!(
                    "its blobs not held here take {new} bytes, more than the {capacity} bytes the chunk store could ever hold (gc.high_watermark of gc.budget, gc.critical_watermark of the filesystem less what others keep there)"
                ),
            });
        }
        Ok(())
    }

    /// The registries (base URLs) a blob's bytes were pulled from.
    pub fn origins(&self, digest: &BlobDigest) -> Result<Vec<String>> {
        self.log.origins(digest)
    }

    /// Records that the blob's bytes are being pulled from `origin`.
    pub fn add_origin(&self, digest: &BlobDigest, origin: &str) -> Result<()> {
        self.log.add_origin(digest, origin)
    }

    /// Whether the store holds anything of a blob: open, or recorded on disk.
    pub fn knows(&self, digest: &BlobDigest) -> Result<bool> {
        if self.blobs().contains_key(digest) {
            return Ok(true);
        }
        Ok(self.log.load(digest)?.is_some())
    }

    /// Removes a blob that holds no verified chunk (a pull that failed before
    /// its first one), so that its preallocated file does not keep the disk.
    pub fn discard_if_empty(&self, digest: &BlobDigest) -> Result<bool> {
        let empty = self
            .blobs()
            .get(digest)
            .is_some_and(|b| !b.is_complete() && b.lock().held.count() == 0);
        if empty {
            self.remove(digest)?;
        }
        Ok(empty)
    }

    fn blob_path(&self, digest: &BlobDigest) -> PathBuf {
        self.dir.join("blobs").join(digest.hex())
    }

    fn blobs(&self) -> std::sync::MutexGuard<'_, HashMap<BlobDigest, Arc<Blob>>> {
        self.blobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The chunk hashes this node can vouch for: the whole map of a blob
    /// whose digest it verified, else those of the chunks it holds; read
    /// from the record when the blob is closed, without opening it.
    pub fn vouched_map(&self, digest: &BlobDigest) -> Result<Option<ChunkMap>> {
        let open = self.blobs().get(digest).cloned();
        if let Some(blob) = open {
            return if blob.is_complete() {
                Ok(Some(blob.map()))
            } else {
                blob.map_of(blob.offered().ones()).map(Some)
            };
        }
        match self.log.load(digest)? {
            Some(rec) if rec.complete => Ok(Some(rec.map)),
            Some(rec) => map_of(&rec.map, rec.held.ones()).map(Some),
            None => Ok(None),
        }
    }

    /// The blobs open now: those in use and the most recently used idle ones.
    pub fn open_blobs(&self) -> Vec<Arc<Blob>> {
        self.blobs().values().cloned().collect()
    }

    /// A blob already open or on disk, without a chunk map from outside.
    pub fn get(&self, digest: &BlobDigest) -> Result<Option<Arc<Blob>>> {
        self.touch(digest);
        self.open_once(digest, || match self.log.load(digest)? {
            Some(rec) => self.open_blob(rec.map.clone(), Some(rec)).map(Some),
            None => Ok(None),
        })
    }

    /// The blob if it is open; else what `open` makes of it, run once per
    /// blob at a time (others asking for it meanwhile wait for that open,
    /// then take its result) and outside the `blobs` lock: reopening a
    /// closed partial blob reads and hashes its whole file, which must not
    /// stall every other open, upload and eviction on the node.
    fn open_once(
        &self,
        digest: &BlobDigest,
        open: impl FnOnce() -> Result<Option<Arc<Blob>>>,
    ) -> Result<Option<Arc<Blob>>> {
        let slot = {
            let blobs = self.blobs();
            if let Some(b) = blobs.get(digest) {
                return Ok(Some(b.clone()));
            }
            self.opening_slot(digest)
        };
        let opener = lock(&slot);
        // Bound first: a guard in the `match` would live through `open`.
        let already = self.blobs().get(digest).cloned();
        let opened = match already {
            // Opened by the one this waited for.
            Some(b) => Ok(Some(b)),
            None => open(),
        };
        if let Ok(Some(blob)) = &opened {
            let mut blobs = self.blobs();
            blobs.entry(*digest).or_insert_with(|| blob.clone());
            self.trim(&mut blobs, Some(digest));
        }
        self.opened(digest, &slot);
        drop(opener);
        opened
    }

    /// The lock of a blob's opening, shared by everyone opening it now.
    fn opening_slot(&self, digest: &BlobDigest) -> Arc<Mutex<()>> {
        lock(&self.opening).entry(*digest).or_default().clone()
    }

    /// Ends an opening (its lock still held): later askers find the blob open.
    fn opened(&self, digest: &BlobDigest, slot: &Arc<Mutex<()>>) {
        let mut opening = lock(&self.opening);
        if opening.get(digest).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            opening.remove(digest);
        }
    }

    /// Opens the blob described by `map`, creating its file or resuming what the
    /// store recorded before. Blocking: call from a blocking thread.
    pub fn blob(&self, map: &ChunkMap) -> Result<Arc<Blob>> {
        // Opened once (`open_once`): two openers of one blob would
        // otherwise each reset its file and keep separate state.
        let digest = map.digest();
        let is_new =
            || !self.blobs().contains_key(&digest) && !self.entries().contains_key(&digest);
        // A new blob: checked, and room made for it, before anything is
        // reserved on disk (outside the blobs lock: eviction takes it). One
        // new blob at a time, to its reservation: two at once would each
        // count the same free space and plan to evict the same blobs.
        let _room = if is_new() {
            let room = self.room.lock().unwrap_or_else(|p| p.into_inner());
            if is_new() {
                self.check_size(&digest, map.size())?;
                crate::store::gc::make_room(self, &digest, map.size())?;
            }
            Some(room)
        } else {
            None
        };
        self.touch(&digest);
        let mut fresh = false;
        let blob = self.open_once(&digest, || {
            let rec = self.log.load(&digest)?;
            // Checked before anything is reserved on disk.
            self.check_size(&digest, map.size())?;
            fresh = true;
            self.open_blob(map.clone(), rec).map(Some)
        })?;
        let blob = blob.expect("opening with a map makes the blob");
        // A map of another geometry with nothing to teach (a reader's or a
        // new pull's, cut at today's `swarm.chunk_size`) takes the stored
        // blob as it is: its chunk size was fixed when it was made.
        if !fresh && (same_geometry(&blob.read_map(), map) || map.known().count() > 0) {
            blob.learn(map)?;
        }
        Ok(blob)
    }

    fn open_blob(&self, map: ChunkMap, rec: Option<LogRecord>) -> Result<Arc<Blob>> {
        let digest = map.digest();
        // Each blob keeps the chunk size it was made with: a complete one, or
        // any asked for with no hashes of its own, is opened as recorded
        // (`swarm.chunk_size` changes new blobs only). A partial record of
        // another geometry than a hashed map's is started over.
        let (map, rec) = match rec {
            Some(r) if same_geometry(&r.map, &map) => {
                let mut known = r.map.clone();
                known.merge(&map)?;
                (known, Some(r))
            }
            Some(r) if r.complete || (r.map.size() == map.size() && map.known().count() == 0) => {
                (r.map.clone(), Some(r))
            }
            _ => (map, None),
        };
        let path = self.blob_path(&digest);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        if let Err(e) = reserve(&file, map.size()) {
            // A failed fallocate can leave blocks allocated: a new file goes.
            if rec.is_none() {
                let _ = std::fs::remove_file(&path);
            }
            return Err(Error::io(
                format!("reserving {} bytes on disk for blob {digest}", map.size()),
                e,
            ));
        }
        let count = map.chunk_count();
        let blob = Arc::new(Blob {
            digest,
            path,
            file,
            writing: Mutex::new(()),
            state: Mutex::new(BlobState {
                held: Bitfield::new(count),
                complete: false,
                recorded: Bitfield::new(count),
                recorded_complete: false,
                recorded_known: 0,
                failed: false,
                rechecked: Bitfield::new(count),
                superseded: Vec::new(),
                unvouched: Bitfield::new(count),
            }),
            prefix: Mutex::new(PrefixHasher::new()),
            progress: tokio::sync::watch::Sender::new(Progress::default()),
            map: RwLock::new(map),
        });
        match rec {
            Some(rec) if rec.complete => {
                let mut st = blob.lock();
                st.held = rec.held.clone();
                st.recorded = rec.held;
                st.complete = true;
                st.recorded_complete = true;
                blob.progress.send_replace(Progress {
                    chunks: count,
                    held: count,
                    complete: true,
                    failed: false,
                });
            }
            None => {
                // Nothing recorded: whatever an earlier run left in the file
                // predates its first record and is not worth a read.
                blob.file
                    .set_len(0)
                    .and_then(|()| reserve(&blob.file, blob.read_map().size()))
                    .map_err(|e| {
                        Error::io(format!("resetting blob file {}", blob.path.display()), e)
                    })?;
                // An empty blob is complete (or wrong) before any chunk arrives.
                blob.advance_prefix(None)?;
                self.save(&blob)?;
            }
            Some(_) => {
                // A partial blob, or one recorded under another map: trust only
                // what re-verifies from disk.
                let recovered = recover(&blob)?;
                blob.lock().held = recovered;
                blob.advance_prefix(None)?;
                self.save(&blob)?;
            }
        }
        Ok(blob)
    }

    /// Makes every chunk written so far durable: syncs the blob file, then
    /// records the chunks in the log. Blocking.
    pub fn persist(&self, blob: &Blob) -> Result<()> {
        let known = blob.read_map().known().count();
        {
            let st = blob.lock();
            let known = known - st.unvouched.count();
            if vouched_of(&st.held, &st.unvouched) == st.recorded
                && st.complete == st.recorded_complete
                && st.recorded_known == known
            {
                return Ok(());
            }
        }
        blob.file
            .sync_data()
            .map_err(|e| Error::io(format!("syncing blob {}", blob.digest()), e))?;
        self.save(blob)
    }

    fn save(&self, blob: &Blob) -> Result<()> {
        let (held, complete, unvouched) = {
            let st = blob.lock();
            (
                vouched_of(&st.held, &st.unvouched),
                st.complete,
                st.unvouched.clone(),
            )
        };
        // What is on a peer's word alone is not recorded: after a restart
        // it is fetched again, not taken as verified.
        let mut map = blob.map();
        for i in unvouched.ones() {
            map.clear_hash(i)?;
        }
        let known = map.known().count();
        let record = LogRecord {
            map,
            held: held.clone(),
            complete,
        };
        self.log.save(&blob.digest(), &record)?;
        let mut st = blob.lock();
        st.recorded = held;
        st.recorded_complete = complete;
        st.recorded_known = known;
        drop(st);
        let entry = Entry::of(&record, SystemTime::now());
        self.entries().insert(blob.digest(), entry);
        Ok(())
    }

    /// Copies a local file into the store as a complete blob; returns its map.
    pub fn import(&self, src: &Path, chunk_size: u32) -> Result<ChunkMap> {
        let mut f =
            File::open(src).map_err(|e| Error::io(format!("opening {}", src.display()), e))?;
        let mut builder = ChunkMapBuilder::new(chunk_size);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f
                .read(&mut buf)
                .map_err(|e| Error::io(format!("reading {}", src.display()), e))?;
            if n == 0 {
                break;
            }
            builder.update(&buf[..n]);
        }
        let map = builder.finish(None)?;
        let blob = self.blob(&map)?;
        for i in 0..map.chunk_count() {
            let mut chunk = vec![0u8; map.chunk_len(i)];
            f.read_exact_at(&mut chunk, map.offset(i))
                .map_err(|e| Error::io(format!("reading {}", src.display()), e))?;
            blob.put_chunk(i, &chunk)?;
        }
        self.persist(&blob)?;
        Ok(map)
    }

    /// Forgets a blob and deletes its file, in use or not (its digest
    /// failed); the order is [`Self::evict`]'s.
    pub fn remove(&self, digest: &BlobDigest) -> Result<()> {
        // Not in the middle of an open of the blob, which would record it again.
        let slot = self.opening_slot(digest);
        let opener = lock(&slot);
        let removed = (|| {
            self.blobs().remove(digest);
            self.log.remove(digest)?;
            self.delete_file(digest)?;
            self.entries().remove(digest);
            Ok(())
        })();
        self.opened(digest, &slot);
        drop(opener);
        removed
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `map`'s geometry with only its known hashes of `chunks`.
/// The chunks of `held` not in `unvouched`.
fn vouched_of(held: &Bitfield, unvouched: &Bitfield) -> Bitfield {
    let mut v = held.clone();
    for i in unvouched.ones() {
        v.clear(i);
    }
    v
}

fn map_of(map: &ChunkMap, chunks: impl IntoIterator<Item = u32>) -> Result<ChunkMap> {
    let mut part = ChunkMap::unhashed(map.digest(), map.size(), map.chunk_size())?;
    for i in chunks {
        if let Some(hash) = map.hashes().get(i as usize).copied().flatten() {
            part.set_hash(i, hash)?;
        }
    }
    Ok(part)
}

/// Whether two maps cut a blob of one size into chunks of one size.
fn same_geometry(a: &ChunkMap, b: &ChunkMap) -> bool {
    (a.size(), a.chunk_size()) == (b.size(), b.chunk_size())
}

/// Reads every chunk of a blob file back and keeps those that verify.
fn recover(blob: &Blob) -> Result<Bitfield> {
    let map = blob.map();
    let mut held = Bitfield::new(map.chunk_count());
    for i in 0..map.chunk_count() {
        match map.verify_chunk(i, &blob.read_at(i)?) {
            Ok(()) => {
                held.set(i);
            }
            // Torn or never written; or its hash is not known yet.
            Err(VerifyError::ChunkHash { .. } | VerifyError::HashUnknown { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(held)
}

/// Reads exactly `len` bytes at `offset` into `buf`'s spare capacity, not
/// zeroed first: zeroing each 4 MiB chunk served to a peer was 13% of the
/// sender's CPU in `dray bench peer` (perf).
fn read_exact_uninit_at(
    file: &File,
    buf: &mut Vec<u8>,
    len: usize,
    offset: u64,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    buf.clear();
    buf.reserve_exact(len);
    while buf.len() < len {
        let filled = buf.len();
        let at = offset + filled as u64;
        let spare = &mut buf.spare_capacity_mut()[..len - filled];
        // SAFETY: pread writes at most `spare.len()` bytes into memory `buf` owns.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
                at as libc::off_t,
            )
        };
        match n {
            // SAFETY: pread initialised the `n` bytes past the old length.
            n if n > 0 => unsafe { buf.set_len(filled + n as usize) },
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Allocates the blob's blocks up front, so a full disk fails here with ENOSPC
/// rather than halfway through a transfer.
fn reserve(file: &File, size: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if size == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on a valid open descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
    match rc {
        0 => Ok(()),
        // Filesystems without fallocate support: fall back to a sparse file.
        libc::EOPNOTSUPP => file.set_len(size),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dray_protocol::chunkmap::MIN_CHUNK_SIZE;

    /// A store whose collector never counts the host's filesystem as full
    /// (its watermarks at 1.0): with the defaults, a test here evicted the
    /// blob under test whenever the machine's disk was past 80% used.
    fn open(dir: &Path) -> ChunkStore {
        let store = ChunkStore::open(dir).unwrap();
        store.gc().configure(pinned(), false);
        store
    }

    /// Collector settings that ignore the host's filesystem.
    fn pinned() -> crate::store::gc::GcConfig {
        crate::store::gc::GcConfig {
            high_watermark: 1.0,
            low_watermark: 1.0,
            critical_watermark: 1.0,
            ..Default::default()
        }
    }

    fn data(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
            .collect()
    }

    #[test]
    fn an_image_of_more_blobs_than_overlayfs_stacks_is_refused_and_held_blobs_cost_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let blobs = |n: usize| -> Vec<(BlobDigest, u64)> {
            (0..n)
                .map(|i| (BlobDigest::of(&i.to_le_bytes()), 1))
                .collect()
        };
        store.check_image(&blobs(MAX_IMAGE_BLOBS)).unwrap();
        let e = store
            .check_image(&blobs(MAX_IMAGE_BLOBS + 1))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "image refused: it lists 502 blobs, more than 501 (its config and the 500 layers overlayfs can stack)"
        );
        // A held blob counts nothing against the room; a new one does.
        store.gc().configure(
            crate::store::gc::GcConfig {
                budget: Some(1000),
                ..Default::default()
            },
            false,
        );
        let bytes = data(700, 3);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let digest = map.digest();
        let blob = store.blob(&map).unwrap();
        assert_eq!(blob.put_chunk(0, &bytes).unwrap(), PutOutcome::Completed);
        store.persist(&blob).unwrap();
        store
            .check_image(&[(digest, 700), (BlobDigest::of(b"x"), 800)])
            .unwrap();
        let e = store
            .check_image(&[(digest, 700), (BlobDigest::of(b"x"), 801)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("take 801 bytes, more than the 800 bytes"), "{e}");
    }

    #[test]
    fn stores_verified_chunks_and_completes_on_digest() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let bytes = data(5 * 65536 + 100, 1);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let blob = store.blob(&map).unwrap();
        let chunks: Vec<&[u8]> = bytes.chunks(65536).collect();
        let mut corrupt = chunks[2].to_vec();
        corrupt[0] ^= 0xff;
        assert!(matches!(
            blob.put_chunk(2, &corrupt),
            Err(Error::Verify(VerifyError::ChunkHash { .. }))
        ));
        assert!(!blob.has(2));
        for i in [5, 3, 1, 0, 4] {
            assert_eq!(
                blob.put_chunk(i, chunks[i as usize]).unwrap(),
                PutOutcome::Stored
            );
        }
        assert_eq!(blob.put_chunk(1, chunks[1]).unwrap(), PutOutcome::Duplicate);
        assert_eq!(blob.put_chunk(2, chunks[2]).unwrap(), PutOutcome::Completed);
        store.persist(&blob).unwrap();
        assert_eq!(std::fs::read(blob.path()).unwrap(), bytes);
    }

    #[test]
    fn progress_counts_every_stored_chunk_not_only_the_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let bytes = data(3 * 65536, 8);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let blob = store.blob(&map).unwrap();
        let mut rx = blob.subscribe();
        blob.put_chunk(2, &bytes[2 * 65536..]).unwrap();
        assert!(rx.has_changed().unwrap(), "an out-of-order chunk is news");
        let p = *rx.borrow_and_update();
        assert_eq!((p.chunks, p.held, p.complete), (0, 1, false));
        blob.put_chunk(0, &bytes[..65536]).unwrap();
        assert_eq!((rx.borrow().chunks, rx.borrow().held), (1, 2));
        blob.put_chunk(1, &bytes[65536..2 * 65536]).unwrap();
        let p = *rx.borrow();
        assert_eq!((p.chunks, p.held, p.complete), (3, 3, true));
    }

    #[test]
    fn resumes_recorded_and_unrecorded_chunks_but_not_torn_ones() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = data(4 * 65536, 2);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let chunks: Vec<&[u8]> = bytes.chunks(65536).collect();
        {
            let store = open(dir.path());
            let blob = store.blob(&map).unwrap();
            blob.put_chunk(0, chunks[0]).unwrap();
            store.persist(&blob).unwrap();
            // Written but never recorded (as after kill -9 before the group commit).
            blob.put_chunk(1, chunks[1]).unwrap();
            // A torn write: half of chunk 3 reached the file.
            blob.file
                .write_all_at(&chunks[3][..1000], map.offset(3))
                .unwrap();
        }
        let store = open(dir.path());
        let blob = store.blob(&map).unwrap();
        assert_eq!(blob.held().ones().collect::<Vec<_>>(), vec![0, 1]);
        blob.put_chunk(3, chunks[3]).unwrap();
        assert_eq!(blob.put_chunk(2, chunks[2]).unwrap(), PutOutcome::Completed);
    }

    #[test]
    fn a_wrong_chunk_map_is_caught_by_the_blob_digest_and_the_wrong_chunk_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let bytes = data(2 * 65536, 3);
        let mut forged_bytes = bytes.clone();
        forged_bytes[10] ^= 1;
        let honest = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let forged = ChunkMap::partial(
            honest.digest(),
            honest.size(),
            honest.chunk_size(),
            ChunkMap::of_bytes(&forged_bytes, MIN_CHUNK_SIZE)
                .unwrap()
                .hashes()
                .to_vec(),
        )
        .unwrap();
        let blob = store.blob(&forged).unwrap();
        blob.put_chunk(1, &forged_bytes[65536..]).unwrap();
        let err = blob.put_chunk(0, &forged_bytes[..65536]).unwrap_err();
        assert!(err.to_string().contains("not its digest"), "{err}");
        // The chunks stay for the recheck; readers stop.
        assert_eq!(blob.held().count(), 2);
        assert!(blob.subscribe().borrow().failed);
        assert!(!blob.is_complete() && blob.is_failed());
        // A recheck fetches each chunk once; the same bytes change nothing.
        assert!(blob.take_recheck(1));
        assert!(!blob.take_recheck(1));
        assert_eq!(
            blob.put_origin_chunk(1, &bytes[65536..]).unwrap(),
            PutOutcome::Duplicate
        );
        // Another node's store, told of the replaced hash, drops its chunk
        // and takes a stale peer's copy for what it is, not for a lie.
        let dir2 = tempfile::tempdir().unwrap();
        let other = open(dir2.path()).blob(&forged).unwrap();
        other.put_chunk(0, &forged_bytes[..65536]).unwrap();
        assert_eq!(other.adopt(&honest).unwrap(), (1, 1));
        assert!(!other.has(0));
        assert!(matches!(
            other.put_chunk(0, &forged_bytes[..65536]),
            Err(Error::Superseded { index: 0, .. })
        ));
        // The registry's bytes for the wrong chunk replace it: complete.
        assert!(blob.take_recheck(0));
        assert_eq!(
            blob.put_origin_chunk(0, &bytes[..65536]).unwrap(),
            PutOutcome::Completed
        );
        assert!(blob.is_complete() && !blob.is_failed());
        assert_eq!(blob.map().hashes(), honest.hashes());
        // The tracker's answer, sent before it heard of the recheck, does
        // not undo it.
        assert_eq!(blob.adopt(&forged).unwrap(), (0, 0));
        assert!(blob.is_complete());
        assert_eq!(
            other.put_chunk(0, &bytes[..65536]).unwrap(),
            PutOutcome::Stored
        );
    }

    #[test]
    fn origin_chunks_fill_an_unhashed_map_and_verify_peer_chunks_after_restart() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = data(3 * 65536, 5);
        let full = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let bare = ChunkMap::unhashed(full.digest(), full.size(), full.chunk_size()).unwrap();
        let chunks: Vec<&[u8]> = bytes.chunks(65536).collect();
        {
            let store = open(dir.path());
            let blob = store.blob(&bare).unwrap();
            assert!(matches!(
                blob.put_chunk(0, chunks[0]),
                Err(Error::Verify(VerifyError::HashUnknown { index: 0, .. }))
            ));
            blob.put_origin_chunk(1, chunks[1]).unwrap();
            assert_eq!(blob.map().hashes()[1], full.hashes()[1]);
            store.persist(&blob).unwrap();
        }
        let store = open(dir.path());
        let blob = store.blob(&bare).unwrap();
        assert_eq!(blob.held().ones().collect::<Vec<_>>(), vec![1]);
        assert_eq!(
            blob.map().known().count(),
            1,
            "the learned hash was recorded"
        );
        store.blob(&full).unwrap();
        blob.put_chunk(0, chunks[0]).unwrap();
        assert_eq!(blob.put_chunk(2, chunks[2]).unwrap(), PutOutcome::Completed);
    }

    #[test]
    fn a_reopened_store_opens_nothing_and_reports_its_blobs_from_their_records() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (data(65536, 6), data(2 * 65536, 7));
        {
            let store = open(dir.path());
            let full = ChunkMap::of_bytes(&a, MIN_CHUNK_SIZE).unwrap();
            store.blob(&full).unwrap().put_chunk(0, &a).unwrap();
            store.persist(&store.blob(&full).unwrap()).unwrap();
            let half = ChunkMap::of_bytes(&b, MIN_CHUNK_SIZE).unwrap();
            let blob = store.blob(&half).unwrap();
            blob.put_chunk(1, &b[65536..]).unwrap();
            store.persist(&blob).unwrap();
        }
        let store = open(dir.path());
        assert!(store.open_blobs().is_empty());
        let mut held: Vec<(BlobDigest, Vec<u32>, bool, u64)> = store
            .holdings()
            .into_iter()
            .map(|h| {
                let bytes = h.held_bytes();
                (h.digest, h.held.ones().collect(), h.complete, bytes)
            })
            .collect();
        held.sort_by_key(|h| !h.2);
        assert_eq!(
            held,
            vec![
                (BlobDigest::of(&a), vec![0], true, 65536),
                (BlobDigest::of(&b), vec![1], false, 65536),
            ]
        );
        assert_eq!(store.usage().unwrap().open_blobs, 0);
    }

    /// Imports `n` complete blobs of two chunks each; returns their bytes and maps.
    fn import_many(store: &ChunkStore, dir: &Path, n: u8) -> Vec<(Vec<u8>, ChunkMap)> {
        (0..n)
            .map(|i| {
                let bytes = data(2 * 65536, 100 + i);
                let src = dir.join(format!("src{i}"));
                std::fs::write(&src, &bytes).unwrap();
                let map = store.import(&src, MIN_CHUNK_SIZE).unwrap();
                (bytes, map)
            })
            .collect()
    }

    #[test]
    fn idle_blobs_past_the_bound_are_closed_and_reopen_from_their_records() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("s"));
        store.set_max_open_idle_blobs(4);
        let blobs = import_many(&store, dir.path(), 30);
        assert_eq!(
            store.open_blobs().len(),
            4,
            "only the idle bound stays open"
        );
        // Three in use (a pull, a stream, an upload) stay open past the bound.
        let in_use: Vec<Arc<Blob>> = blobs[..3]
            .iter()
            .map(|(_, m)| store.get(&m.digest()).unwrap().unwrap())
            .collect();
        for (_, m) in &blobs[3..] {
            store.get(&m.digest()).unwrap().unwrap();
            let open = store.open_blobs().len();
            assert!(
                open <= 4 + 3,
                "{open} blobs open, more than 4 idle and 3 in use"
            );
        }
        let open: Vec<BlobDigest> = store.open_blobs().iter().map(|b| b.digest()).collect();
        for (b, (bytes, _)) in in_use.iter().zip(&blobs) {
            assert!(open.contains(&b.digest()), "a blob in use was closed");
            assert_eq!(b.read_chunk(1).unwrap().unwrap(), &bytes[65536..]);
        }
        assert_eq!(store.usage().unwrap().open_blobs, open.len());
        assert_eq!(store.usage().unwrap().store_blobs, 30);
        // A closed blob reopens from its record: complete, every chunk served.
        let (bytes, map) = &blobs[3];
        assert!(
            !open.contains(&map.digest()),
            "the oldest idle blob was closed"
        );
        let again = store.get(&map.digest()).unwrap().unwrap();
        assert!(again.is_complete());
        assert_eq!(again.read_chunk(0).unwrap().unwrap(), &bytes[..65536]);
        assert_eq!(again.read_chunk(1).unwrap().unwrap(), &bytes[65536..]);
        assert_eq!(
            store.vouched_map(&map.digest()).unwrap().as_ref(),
            Some(map)
        );
        assert_eq!(store.holdings().len(), 30);
        // A burst of readers ends: its blobs close at the next open or pass
        // of the collector.
        drop((in_use, again));
        let burst: Vec<Arc<Blob>> = blobs[10..20]
            .iter()
            .map(|(_, m)| store.get(&m.digest()).unwrap().unwrap())
            .collect();
        assert!(store.open_blobs().len() >= 10);
        drop(burst);
        crate::store::gc::collect(&store, false).unwrap();
        assert_eq!(store.open_blobs().len(), 4);
    }

    #[test]
    fn a_closed_partial_blob_keeps_its_chunks_and_completes_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("s"));
        store.set_max_open_idle_blobs(1);
        let bytes = data(3 * 65536, 50);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let blob = store.blob(&map).unwrap();
        blob.put_chunk(2, &bytes[2 * 65536..]).unwrap();
        // Written but not yet recorded: closing records it.
        drop(blob);
        let other = import_many(&store, dir.path(), 1);
        let open: Vec<BlobDigest> = store.open_blobs().iter().map(|b| b.digest()).collect();
        assert_eq!(
            open,
            vec![other[0].1.digest()],
            "the idle partial blob was closed"
        );
        let held = store
            .holdings()
            .into_iter()
            .find(|h| h.digest == map.digest())
            .unwrap();
        assert_eq!(
            (held.held.ones().collect::<Vec<_>>(), held.complete),
            (vec![2], false)
        );
        let partial = store.vouched_map(&map.digest()).unwrap().unwrap();
        assert_eq!(partial.known().ones().collect::<Vec<_>>(), vec![2]);
        let blob = store.blob(&map).unwrap();
        assert_eq!(blob.held().ones().collect::<Vec<_>>(), vec![2]);
        assert_eq!(blob.read_chunk(2).unwrap().unwrap(), &bytes[2 * 65536..]);
        blob.put_chunk(0, &bytes[..65536]).unwrap();
        assert_eq!(
            blob.put_chunk(1, &bytes[65536..2 * 65536]).unwrap(),
            PutOutcome::Completed
        );
    }

    /// A completion log that holds the first `save` of one blob until
    /// released: a stand-in for a long re-read and re-hash, which a
    /// reopened partial blob does just before that save.
    struct HeldLog {
        inner: SledLog,
        gate: Mutex<Option<Gate>>,
    }

    struct Gate {
        digest: BlobDigest,
        entered: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    }

    impl CompletionLog for HeldLog {
        fn load(&self, digest: &BlobDigest) -> Result<Option<LogRecord>> {
            self.inner.load(digest)
        }
        fn save(&self, digest: &BlobDigest, record: &LogRecord) -> Result<()> {
            let gate = {
                let mut g = lock(&self.gate);
                match g.as_ref() {
                    Some(gate) if gate.digest == *digest => g.take(),
                    _ => None,
                }
            };
            if let Some(gate) = gate {
                gate.entered.send(()).unwrap();
                let _ = gate.release.recv();
            }
            self.inner.save(digest, record)
        }
        fn remove(&self, digest: &BlobDigest) -> Result<()> {
            self.inner.remove(digest)
        }
        fn digests(&self) -> Result<Vec<BlobDigest>> {
            self.inner.digests()
        }
        fn origins(&self, digest: &BlobDigest) -> Result<Vec<String>> {
            self.inner.origins(digest)
        }
        fn add_origin(&self, digest: &BlobDigest, origin: &str) -> Result<()> {
            self.inner.add_origin(digest, origin)
        }
    }

    #[test]
    fn reopening_a_partial_blob_blocks_neither_other_blobs_nor_eviction() {
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(HeldLog {
            inner: SledLog::open(&dir.path().join("log")).unwrap(),
            gate: Mutex::new(None),
        });
        let store = Arc::new(ChunkStore::with_log(&dir.path().join("s"), log.clone()).unwrap());
        // Never evicting on its own, whatever this disk holds.
        store.gc().configure(
            crate::store::gc::GcConfig {
                low_watermark: 1.0,
                high_watermark: 1.0,
                critical_watermark: 1.0,
                ..Default::default()
            },
            false,
        );
        store.set_max_open_idle_blobs(1);
        let bytes = data(3 * 65536, 70);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let partial = store.blob(&map).unwrap();
        partial.put_chunk(1, &bytes[65536..2 * 65536]).unwrap();
        drop(partial);
        // Three complete blobs close the partial one, and all but the last.
        let others = import_many(&store, dir.path(), 3);
        let open: Vec<BlobDigest> = store.open_blobs().iter().map(|b| b.digest()).collect();
        assert_eq!(open, vec![others[2].1.digest()]);

        // The partial blob is reopened; its re-hash is held.
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel();
        *lock(&log.gate) = Some(Gate {
            digest: map.digest(),
            entered: entered_tx,
            release: release_rx,
        });
        let reopening = {
            let (store, digest) = (store.clone(), map.digest());
            std::thread::spawn(move || store.get(&digest).unwrap().unwrap())
        };
        entered
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the partial blob is being reopened");

        // Meanwhile another blob opens and serves a chunk (an upload), an
        // idle one is evicted, and the blob being opened is not.
        let (done_tx, done) = std::sync::mpsc::channel();
        {
            let (store, digest) = (store.clone(), map.digest());
            let (closed, evicted) = (others[0].1.digest(), others[1].1.digest());
            std::thread::spawn(move || {
                let blob = store.get(&closed).unwrap().unwrap();
                let chunk = blob.read_chunk(0).unwrap().unwrap();
                drop(blob);
                let freed = store.evict(&evicted).unwrap();
                let spared = store.evict(&digest).unwrap();
                done_tx.send((chunk, freed, spared)).unwrap();
            });
        }
        let waited = done.recv_timeout(std::time::Duration::from_secs(5));
        release.send(()).unwrap();
        let reopened = reopening.join().unwrap();
        let (chunk, freed, spared) =
            waited.expect("an open, an upload and an eviction waited for another blob's re-hash");
        assert_eq!(chunk, &others[0].0[..65536]);
        assert_eq!(freed, Some(2 * 65536));
        assert_eq!(spared, None, "a blob being opened is in use");
        // The reopened blob kept its chunk, and is the one the store holds.
        assert_eq!(reopened.held().ones().collect::<Vec<_>>(), vec![1]);
        assert!(Arc::ptr_eq(
            &reopened,
            &store.get(&map.digest()).unwrap().unwrap()
        ));
    }

    #[test]
    fn a_complete_idle_blob_is_closed_before_a_partial_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir.path().join("s"));
        store.set_max_open_idle_blobs(2);
        let bytes = data(2 * 65536, 60);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        store
            .blob(&map)
            .unwrap()
            .put_chunk(0, &bytes[..65536])
            .unwrap();
        let newer = import_many(&store, dir.path(), 2);
        let mut open: Vec<BlobDigest> = store.open_blobs().iter().map(|b| b.digest()).collect();
        open.sort();
        let mut want = vec![map.digest(), newer[1].1.digest()];
        want.sort();
        assert_eq!(
            open, want,
            "the older complete blob went, the partial one stays"
        );
        assert!(
            store
                .get(&newer[0].1.digest())
                .unwrap()
                .unwrap()
                .is_complete()
        );
    }

    #[test]
    fn a_blob_keeps_its_chunk_size_when_the_setting_changes() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = data(4 * 65536, 9);
        let digest = {
            let store = open(dir.path());
            let src = dir.path().join("src");
            std::fs::write(&src, &bytes).unwrap();
            store.import(&src, MIN_CHUNK_SIZE).unwrap().digest()
        };
        let store = open(dir.path());
        // A reader cutting it at today's (larger) chunk size.
        let asked = ChunkMap::unhashed(digest, bytes.len() as u64, 2 * MIN_CHUNK_SIZE).unwrap();
        let blob = store.blob(&asked).unwrap();
        assert!(blob.is_complete());
        assert_eq!(blob.chunk_size(), MIN_CHUNK_SIZE);
        assert_eq!(blob.read_chunk(3).unwrap().unwrap(), &bytes[3 * 65536..]);
    }

    #[test]
    fn an_empty_blob_takes_its_swarms_chunk_size_but_a_started_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let bytes = data(4 * 65536, 10);
        let swarm = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let ours = ChunkMap::unhashed(swarm.digest(), swarm.size(), 2 * MIN_CHUNK_SIZE).unwrap();
        let blob = store.blob(&ours).unwrap();
        assert!(blob.adopt_geometry(&swarm).unwrap());
        assert_eq!(blob.chunk_size(), MIN_CHUNK_SIZE);
        for i in 0..4 {
            blob.put_chunk(i, &bytes[i as usize * 65536..][..65536])
                .unwrap();
        }
        assert!(blob.is_complete());
        store.persist(&blob).unwrap();
        let other = ChunkMap::of_bytes(&bytes, 2 * MIN_CHUNK_SIZE).unwrap();
        assert!(!blob.adopt_geometry(&other).unwrap());
        drop((blob, store));
        let store = open(dir.path());
        assert_eq!(
            store.get(&swarm.digest()).unwrap().unwrap().chunk_size(),
            MIN_CHUNK_SIZE
        );
    }

    #[test]
    fn eviction_spares_blobs_in_use_and_a_crash_after_the_record_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (data(2 * 65536, 11), data(3 * 65536, 12));
        let store = open(dir.path());
        let mut digests = Vec::new();
        for (n, bytes) in [&a, &b].into_iter().enumerate() {
            let src = dir.path().join(format!("src{n}"));
            std::fs::write(&src, bytes).unwrap();
            digests.push(store.import(&src, MIN_CHUNK_SIZE).unwrap().digest());
        }
        assert_eq!(store.usage().unwrap().store_bytes, 5 * 65536);
        let reader = store.get(&digests[0]).unwrap().unwrap();
        assert_eq!(store.evict(&digests[0]).unwrap(), None, "a reader holds it");
        drop(reader);
        assert_eq!(store.evict(&digests[0]).unwrap(), Some(2 * 65536));
        assert!(!store.blob_path(&digests[0]).exists());
        // A crash between the record's removal and the file's.
        store.log.remove(&digests[1]).unwrap();
        drop(store);
        let store = open(dir.path());
        assert!(!store.blob_path(&digests[1]).exists(), "swept at open");
        assert_eq!(store.usage().unwrap().store_blobs, 0);
        assert_eq!(
            std::fs::read_dir(dir.path().join("blobs")).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_vouched_size_admits_only_itself_and_never_fails_another_size() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        store.set_max_blob_size(3 * 65536);
        let bytes = data(2 * 65536, 17);
        let map = ChunkMap::of_bytes(&bytes, MIN_CHUNK_SIZE).unwrap();
        let digest = map.digest();
        // Any client's manifest may name the digest with sizes of its choosing.
        store.vouch_size(digest, 10 * 65536);
        store.vouch_size(digest, 65536);
        store.check_size(&digest, map.size()).unwrap();
        let blob = store.blob(&map).unwrap();
        blob.put_chunk(0, &bytes[..65536]).unwrap();
        assert_eq!(
            blob.put_chunk(1, &bytes[65536..]).unwrap(),
            PutOutcome::Completed
        );
        // Past the cap only the very size vouched for passes.
        store.check_size(&digest, 10 * 65536).unwrap();
        let e = store
            .check_size(&digest, 11 * 65536)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("720896 bytes is more than max_blob_size (196608 bytes)"),
            "{e}"
        );
    }

    #[test]
    fn a_blob_larger_than_the_budget_is_refused_before_any_disk_is_reserved() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        store.gc().configure(
            crate::store::gc::GcConfig {
                budget: Some(100_000),
                ..Default::default()
            },
            false,
        );
        let map = ChunkMap::of_bytes(&data(2 * 65536, 13), MIN_CHUNK_SIZE).unwrap();
        let e = store.blob(&map).err().unwrap().to_string();
        assert!(
            e.contains("more than the whole gc.budget of 100000 bytes"),
            "{e}"
        );
        assert!(!store.blob_path(&map.digest()).exists());
    }

    #[test]
    fn new_blobs_opened_at_once_each_make_room_and_the_budget_holds() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(&dir.path().join("s")));
        // Ten idle blobs of 128 KiB fill the budget; eight threads then open
        // a new blob of that size each, at once. Each must make room for
        // itself: two counting the same free space, or both planning to
        // evict the same blob, would refuse one or overrun the budget.
        let budget = 10 * 2 * 65536;
        let old = import_many(&store, dir.path(), 10);
        store.gc().configure(
            crate::store::gc::GcConfig {
                budget: Some(budget),
                high_watermark: 1.0,
                low_watermark: 1.0,
                ..Default::default()
            },
            false,
        );
        for round in 0..4u8 {
            let start = Arc::new(std::sync::Barrier::new(8));
            let threads: Vec<_> = (0..8u8)
                .map(|i| {
                    let (store, start) = (store.clone(), start.clone());
                    std::thread::spawn(move || {
                        let map = ChunkMap::of_bytes(
                            &data(2 * 65536, 200 - round * 8 - i),
                            MIN_CHUNK_SIZE,
                        )
                        .unwrap();
                        start.wait();
                        store.blob(&map).map(|b| b.digest())
                    })
                })
                .collect();
            for t in threads {
                if let Err(e) = t.join().unwrap() {
                    panic!("round {round}: a new blob was refused: {e}");
                }
            }
            let used = store.usage().unwrap().store_bytes;
            assert!(
                used <= budget,
                "round {round}: {used} bytes held, budget {budget}"
            );
        }
        assert!(
            old.iter()
                .any(|(_, m)| !store.blob_path(&m.digest()).exists()),
            "the idle blobs made the room"
        );
    }

    #[test]
    fn write_in_pieces_lands_every_byte_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = File::create(&path).unwrap();
        let bytes: Vec<u8> = (0..3 * WRITE_PIECE + 5).map(|i| (i % 251) as u8).collect();
        write_in_pieces(&file, &bytes, 7).unwrap();
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), 7 + bytes.len());
        assert_eq!(&back[7..], &bytes[..]);
    }

    #[test]
    fn import_then_reopen_trusts_the_completed_record() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let bytes = data(3 * 65536 + 7, 4);
        std::fs::write(&src, &bytes).unwrap();
        let map = ChunkStore::open(&dir.path().join("s"))
            .unwrap()
            .import(&src, MIN_CHUNK_SIZE)
            .unwrap();
        assert_eq!(map.digest(), BlobDigest::of(&bytes));
        let store = open(&dir.path().join("s"));
        let blob = store.get(&map.digest()).unwrap().unwrap();
        assert!(blob.is_complete());
        assert_eq!(blob.read_chunk(3).unwrap().unwrap(), &bytes[3 * 65536..]);
    }
}
