//! One gzip layer decoded on several cores: rapidgzip's marker/window method
//! through the `rapidgzip-core` crate, feeding the same tar reader, hasher
//! and guard as the serial path.
//!
//! Why the crate and not our own: the method (find deflate block starts by
//! guessing, decode each chunk with a placeholder window, resolve the
//! placeholders once the previous chunk's last 32 KiB is known) is thousands
//! of lines of subtle code; `rapidgzip-core` is a maintained port of it on
//! zlib-rs (the inflater the serial path uses), checks every member's CRC32
//! and ISIZE itself, bounds its buffers, and offers a process-wide worker
//! pool, which is the thread budget the unpacker needs.
//!
//! Input is positional ([`ReadAt`]): the workers read ahead of the in-order
//! prefix. A source may block in `read_at` until the bytes it asks for are
//! present (the agent's store does, while the blob downloads); its `len` must
//! be the blob's final size from the start.
//!
//! The tar reader above sees the decoder's in-order output, so the diffID, the
//! limits of [`super::guard`] and the tree writer hold unchanged. What differs:
//! the compressed-byte count the ratio limit divides by is the furthest byte
//! the decoder has read, which runs ahead of the serial decoder's by at most
//! the in-flight chunks (so the ratio limit trips up to that much later), and
//! the decoder's own messages name a failure (the variant and the entry it
//! is reported at are the serial path's).
//!
//! Memory per layer is bounded by [`memory_cap`]: decoded chunks in flight and
//! awaiting the reader, plus each worker's input pages and 32 KiB windows.

use super::UnpackLimits;
use rapidgzip_core::{Decoder, DecoderPool, DecoderReader};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

pub use rapidgzip_core::ReadAt;

/// Decoded bytes one worker produces per task (the crate's default).
const CHUNK_BYTES: usize = 4 << 20;
/// Compressed bytes one positional read asks for (the crate's default).
const PAGE_BYTES: usize = 1 << 20;

/// When a gzip layer is decoded in parallel (`[unpack.parallel_gzip]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelGzip {
    /// Decoder threads for one gzip layer: 0 decides from the two keys
    /// below, 1 keeps every layer on the serial path, more forces that many.
    pub threads: usize,
    /// With `threads = 0`: only on nodes with at least this many cores. The
    /// method costs more work per byte than one zlib-rs stream, so it pays
    /// only from a few cores (docs/results.md, "Giant gzip layers").
    pub min_cores: usize,
    /// With `threads = 0`: only for gzip layers of at least this many
    /// compressed bytes; below it the serial path finishes before the
    /// workers have found their block starts.
    pub min_layer_bytes: u64,
}

impl Default for ParallelGzip {
    fn default() -> Self {
        Self {
            threads: 0,
            min_cores: 4,
            min_layer_bytes: 256 << 20,
        }
    }
}

impl ParallelGzip {
    /// Decoder threads for a gzip layer of `compressed` bytes on a node with
    /// `cores` cores; 1 means the serial path.
    pub fn threads_for(&self, compressed: u64, cores: usize) -> usize {
        match self.threads {
            0 if cores >= self.min_cores.max(2) && compressed >= self.min_layer_bytes => cores,
            0 => 1,
            n => n,
        }
    }
}

/// The most memory one parallel decode of `threads` threads holds: decoded
/// chunks in flight or awaiting the reader (`threads + 2` of them, the crate's
/// bound, each with its marker-resolved copy), and each worker's input page
/// and window.
pub fn memory_cap(threads: usize) -> u64 {
    let in_flight = (threads + 2) as u64;
    in_flight * 2 * CHUNK_BYTES as u64 + threads as u64 * (PAGE_BYTES as u64 + (64 << 10))
}

/// The node's cores, shared by every parallel gzip decode in this process:
/// two giant layers unpacking at once split them instead of asking for twice
/// as many.
fn pool() -> &'static DecoderPool {
    static POOL: OnceLock<DecoderPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DecoderPool::builder()
            .workers(cores())
            .build()
            .expect("a pool of at least one worker")
    })
}

/// Cores this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Counts the furthest compressed byte the workers have read.
struct Furthest<R> {
    inner: R,
    len: u64,
    furthest: Arc<AtomicU64>,
}

impl<R: ReadAt> ReadAt for Furthest<R> {
    fn len(&self) -> io::Result<u64> {
        Ok(self.len)
    }

    fn read_at(&self, offset: u64, buffer: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read_at(offset, buffer)?;
        self.furthest
            .fetch_max(offset + n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// The decoded tar stream of one gzip layer, in order, and how far into the
/// compressed blob the decoder has read.
pub struct ParallelGzipReader {
    reader: DecoderReader,
    furthest: Arc<AtomicU64>,
}

impl ParallelGzipReader {
    /// Starts `threads` workers (drawn from the process's pool) on the first
    /// `len` bytes of `src`. Decoding past `limits.max_layer_bytes` fails
    /// before the excess is handed over.
    pub fn start(
        src: impl ReadAt + 'static,
        len: u64,
        threads: usize,
        limits: &UnpackLimits,
    ) -> io::Result<Self> {
        let furthest = Arc::new(AtomicU64::new(0));
        let mut builder = Decoder::builder()
            .decoder_threads(threads)
            .decoded_chunk_size(CHUNK_BYTES)
            .input_page_size(PAGE_BYTES)
            .output_limit(Some(limits.max_layer_bytes));
        // More threads than cores is asked for on purpose (the bench counts
        // the work of 16 threads on 2 cores): that decode stays out of the
        // node's budget.
        if threads <= cores() {
            builder = builder.decoder_pool(pool().clone());
        }
        let decoder = builder.build().map_err(io::Error::other)?;
        let reader = decoder
            .reader(Furthest {
                inner: src,
                len,
                furthest: furthest.clone(),
            })
            .map_err(io::Error::other)?;
        // The crate grows its workers only while it measures a gain; asked
        // for a width, it starts there.
        reader.request_workers(threads).map_err(io::Error::other)?;
        Ok(Self { reader, furthest })
    }

    /// The decoder's telemetry and controls (the bench reads its threads'
    /// CPU time from it).
    pub fn handle(&self) -> rapidgzip_core::DecoderHandle {
        self.reader.handle()
    }

    /// Reports the decoder's route through the stream, also after this
    /// reader is gone.
    pub(super) fn route(&self) -> impl Fn() -> String + use<> {
        let handle = self.reader.handle();
        move || format!("{:?}", handle.stats().path)
    }

    /// This reader, keeping `compressed` at the compressed bytes read so far
    /// (what the guard's ratio limit divides by).
    pub(super) fn counting(self, compressed: &Cell<u64>) -> Counted<'_> {
        Counted {
            inner: self,
            compressed,
        }
    }
}

pub(super) struct Counted<'a> {
    inner: ParallelGzipReader,
    compressed: &'a Cell<u64>,
}

impl Read for ParallelGzipReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // The crate reports a cancelled decode as `Interrupted`, which
        // `read_exact` would retry for ever.
        self.reader.read(buf).map_err(|e| match e.kind() {
            io::ErrorKind::Interrupted => io::Error::other(e),
            _ => e,
        })
    }
}

impl Read for Counted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.compressed
            .set(self.inner.furthest.load(Ordering::Relaxed));
        Ok(n)
    }
}
