//! The tar stream guard: it sits between the decompressor and the `tar`
//! crate and walks the uncompressed stream's 512-byte header structure as
//! that crate will (header checksums, sizes, a PAX `size` overriding the
//! header's, padding, GNU sparse extension blocks), so that a layer's limits
//! hold before the crate allocates anything.
//!
//! The crate reads GNU long-name and long-link bodies and PAX extension
//! bodies whole into memory, however large (measured on main: a layer whose
//! long name is 2 GiB of one letter, a few MB gzipped, took the agent to
//! 10.4 GB RSS). The guard refuses such a header over 1 MiB as soon as it has
//! read its size, as Go's archive/tar (containerd's) does, and counts the
//! layer's entries and uncompressed bytes against [`UnpackLimits`].
//!
//! It also hands a GNU sparse entry to the crate as a plain file of its
//! stored data, and keeps the sparse map for the writer, which then puts
//! each chunk at its offset and leaves holes. The crate would instead read
//! out every hole as zeros: a sparse entry of a few bytes can describe
//! terabytes.

use super::UnpackError;
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io::{self, Read};
use std::rc::Rc;

/// GNU long names and links and PAX extension headers are refused above
/// this size, as Go's archive/tar (`maxSpecialFileSize`) and so containerd.
/// The blocks of one GNU sparse map are held to it too.
pub const MAX_HEADER_BODY: u64 = 1 << 20;

/// The ratio limit applies once a layer has produced this much: a small
/// layer of a few zeroed files compresses far beyond any sane ratio and
/// costs nothing.
pub const RATIO_FLOOR: u64 = 64 << 20;

const BLOCK: usize = 512;

/// What one layer may ask of the unpacker; every key optional. The defaults
/// sit well above any image seen in practice: a refused layer is a hostile
/// or broken one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnpackLimits {
    /// Tar entries per layer: every header (PAX global ones included) but
    /// GNU long names and links and PAX extended headers, which belong to
    /// the entry after them. Each entry can be an inode on the node's disk.
    pub max_entries: u64,
    /// Uncompressed bytes per layer: the tar stream, padding included.
    pub max_layer_bytes: u64,
    /// Uncompressed bytes per compressed byte read so far, checked once a
    /// layer has produced more than 64 MiB. gzip cannot pass ~1030; zstd
    /// turns a run of zeros into almost nothing.
    pub max_layer_ratio: u64,
    /// Bytes in an entry's path or link target (the kernel's `PATH_MAX`;
    /// containerd's path-based calls fail beyond it).
    pub max_path_bytes: usize,
    /// When a gzip layer is decoded on several cores (`[unpack.parallel_gzip]`).
    pub parallel_gzip: super::ParallelGzip,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        Self {
            max_entries: 4_000_000,
            max_layer_bytes: 256 << 30,
            max_layer_ratio: 2_000,
            max_path_bytes: 4096,
            parallel_gzip: super::ParallelGzip::default(),
        }
    }
}

/// Where a rewritten GNU sparse entry's stored data goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct SparseMap {
    /// `(offset, length)` of each stored chunk, in order, not overlapping.
    pub(super) chunks: Vec<(u64, u64)>,
    /// The file's size, holes included.
    pub(super) real_size: u64,
}

/// What the guard learnt that the writer and the caller need.
#[derive(Default)]
pub(super) struct Findings {
    /// The first limit the stream broke; from then on every read fails, and
    /// the caller reports this rather than what the tar crate made of it.
    pub(super) breach: Option<UnpackError>,
    /// Sparse maps by the position of their entry's header in the stream
    /// the tar crate reads (`Entry::raw_header_position`).
    pub(super) sparse: HashMap<u64, SparseMap>,
}

pub(super) type SharedFindings = Rc<RefCell<Findings>>;

#[derive(Clone, Copy)]
enum State {
    /// At a header block.
    Header,
    /// In an entry's data, then its padding to the next block.
    Body { data: u64, pad: u64 },
    /// Past the end-of-archive block, or at a block the crate will refuse
    /// itself: bytes pass unread.
    Tail,
    /// A limit was broken.
    Failed,
}

/// The body of a header the crate reads whole, kept for the name of the
/// entry it describes.
enum Keep {
    LongName(Vec<u8>),
    Pax(Vec<u8>),
}

/// The guard itself: a `Read` of the uncompressed tar stream.
pub(super) struct Guard<'a, R> {
    inner: R,
    limits: UnpackLimits,
    /// Compressed bytes the decompressor has read so far.
    compressed: &'a Cell<u64>,
    findings: SharedFindings,
    /// Bytes read from `inner`: the layer's uncompressed size so far.
    read: u64,
    /// Bytes handed out: where the crate sees the next byte.
    written: u64,
    entries: u64,
    state: State,
    /// A header block being handed out.
    block: [u8; BLOCK],
    block_len: usize,
    block_pos: usize,
    keep: Option<Keep>,
    /// The GNU long name and PAX records for the next entry.
    long_name: Option<Vec<u8>>,
    pax: Option<Vec<u8>>,
    /// The entry whose header or data is being read, for errors.
    current: Option<String>,
}

impl<'a, R: Read> Guard<'a, R> {
    pub(super) fn new(
        inner: R,
        limits: &UnpackLimits,
        compressed: &'a Cell<u64>,
        findings: SharedFindings,
    ) -> Self {
        Self {
            inner,
            limits: limits.clone(),
            compressed,
            findings,
            read: 0,
            written: 0,
            entries: 0,
            state: State::Header,
            block: [0; BLOCK],
            block_len: 0,
            block_pos: 0,
            keep: None,
            long_name: None,
            pax: None,
            current: None,
        }
    }

    pub(super) fn into_inner(self) -> R {
        self.inner
    }

    /// Records the first broken limit and fails this and every later read.
    fn breach(&mut self, e: UnpackError) -> io::Error {
        self.state = State::Failed;
        self.findings.borrow_mut().breach.get_or_insert(e);
        io::Error::other("the layer broke an unpack limit")
    }

    /// The entry being read, as an error names it.
    fn here(&self) -> String {
        self.current
            .as_ref()
            .map_or("at the start of the layer".into(), |n| format!("{n:?}"))
    }

    fn limit(&mut self, entry: String, limit: String) -> io::Error {
        self.breach(UnpackError::Limit { entry, limit })
    }

    fn refuse(&mut self, reason: String) -> io::Error {
        let entry = self.current.clone().unwrap_or_default();
        self.breach(UnpackError::Refused { entry, reason })
    }

    /// Reads from the stream, counting against the layer's byte limits.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = loop {
            match self.inner.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        self.read += n as u64;
        if self.read > self.limits.max_layer_bytes {
            let limit = format!(
                "the layer's uncompressed size passed max_layer_bytes = {} bytes",
                self.limits.max_layer_bytes
            );
            return Err(self.limit(self.here(), limit));
        }
        let compressed = self.compressed.get().max(1);
        if self.read > RATIO_FLOOR && self.read / compressed > self.limits.max_layer_ratio {
            let limit = format!(
                "the layer expanded {} compressed bytes into {} bytes, past max_layer_ratio = {}",
                compressed, self.read, self.limits.max_layer_ratio
            );
            return Err(self.limit(self.here(), limit));
        }
        Ok(n)
    }

    /// Reads as much of `buf` as the stream holds; less only at its end.
    fn fill_all(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match self.fill(&mut buf[got..])? {
                0 => break,
                n => got += n,
            }
        }
        Ok(got)
    }

    /// Reads the next header block and decides what follows it.
    fn next_header(&mut self) -> io::Result<()> {
        let mut block = [0u8; BLOCK];
        let n = self.fill_all(&mut block)?;
        self.block = block;
        self.block_len = n;
        self.block_pos = 0;
        // A short block, a zero block (the crate's end of archive) or a bad
        // checksum (the crate's error): nothing more to follow.
        self.state = State::Tail;
        if n < BLOCK || block.iter().all(|&b| b == 0) {
            return Ok(());
        }
        let header = tar::Header::from_byte_slice(&block);
        let sum = block[..148]
            .iter()
            .chain(&block[156..])
            .map(|&b| u32::from(b))
            .sum::<u32>()
            + 8 * 32;
        if header.cksum().ok() != Some(sum) {
            return Ok(());
        }
        let kind = header.entry_type();
        let Ok(mut size) = header.entry_size() else {
            return Ok(());
        };
        let recognized = header.as_gnu().is_some() || header.as_ustar().is_some();
        let folded = recognized
            && (kind.is_gnu_longname() || kind.is_gnu_longlink() || kind.is_pax_local_extensions());
        if folded {
            // The crate reads this body whole, then applies it to the next entry.
            if size > MAX_HEADER_BODY {
                let what = match kind {
                    tar::EntryType::GNULongName => "GNU long name",
                    tar::EntryType::GNULongLink => "GNU long link target",
                    _ => "PAX extended header",
                };
                let entry = match &self.current {
                    Some(previous) => format!("following {previous:?}"),
                    None => "at the start of the layer".into(),
                };
                let limit = format!(
                    "its {what} is {size} bytes, over the {MAX_HEADER_BODY}-byte cap on such headers"
                );
                return Err(self.limit(entry, limit));
            }
            self.keep = match kind {
                tar::EntryType::GNULongName => Some(Keep::LongName(Vec::new())),
                tar::EntryType::XHeader => Some(Keep::Pax(Vec::new())),
                _ => None,
            };
        } else {
            // An entry the crate hands on (a PAX global header too); the
            // pending long name and PAX records are its own.
            self.current = Some(shown(&self.entry_path(header)));
            self.long_name = None;
            let pax = self.pax.take();
            if !kind.is_pax_global_extensions()
                && let Some(pax_size) = pax.as_deref().and_then(pax_size)
            {
                size = pax_size;
            }
            self.entries += 1;
            if self.entries > self.limits.max_entries {
                let limit = format!(
                    "the layer has more than max_entries = {} entries",
                    self.limits.max_entries
                );
                return Err(self.limit(self.here(), limit));
            }
            if kind.is_pax_global_extensions() && size > MAX_HEADER_BODY {
                let limit = format!(
                    "its PAX global header is {size} bytes, over the {MAX_HEADER_BODY}-byte cap on such headers"
                );
                return Err(self.limit(self.here(), limit));
            }
            if pax
                .as_deref()
                .is_some_and(|p| pax_records(p).any(|(k, _)| k.starts_with(b"GNU.sparse.")))
            {
                return Err(self.refuse(
                    "PAX sparse files (GNU.sparse.* records) are not supported; GNU sparse entries are"
                        .into(),
                ));
            }
            if kind.is_gnu_sparse()
                && let Some(gnu) = header.as_gnu()
            {
                let map = self.sparse_map(gnu, size)?;
                let at = self.written;
                self.findings.borrow_mut().sparse.insert(at, map);
                // The crate now sees a plain file of the stored chunks.
                let mut plain = tar::Header::new_old();
                plain.as_mut_bytes().copy_from_slice(&self.block);
                plain.set_entry_type(tar::EntryType::Regular);
                plain.set_cksum();
                self.block.copy_from_slice(plain.as_bytes());
            }
        }
        let pad = (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64;
        self.state = State::Body { data: size, pad };
        Ok(())
    }

    /// The entry's path as the crate will give it: the GNU long name, else
    /// the PAX `path`, else the header's.
    fn entry_path(&self, header: &tar::Header) -> Vec<u8> {
        if let Some(name) = &self.long_name {
            return name.strip_suffix(&[0]).unwrap_or(name).to_vec();
        }
        if let Some(path) = self
            .pax
            .as_deref()
            .and_then(|p| pax_records(p).find(|(k, _)| *k == b"path"))
        {
            return path.1.to_vec();
        }
        header.path_bytes().into_owned()
    }

    /// Reads a GNU sparse entry's map: the header's four slots and any
    /// extension blocks after it (which the crate then never sees).
    fn sparse_map(&mut self, gnu: &tar::GnuHeader, stored: u64) -> io::Result<SparseMap> {
        let mut map = SparseMap {
            chunks: Vec::new(),
            real_size: 0,
        };
        let mut slots = sparse_slots(&gnu.sparse);
        let mut extended = gnu.is_extended();
        let mut ext_bytes = 0u64;
        let mut used = 0u64;
        loop {
            for slot in slots.drain(..) {
                let Some((offset, len)) = slot else {
                    return Err(self.refuse("its sparse map has a bad number".into()));
                };
                // As the crate checks: stored chunks are block-aligned in the
                // stream, in order, and add up to the entry's size.
                if len != 0 && !used.is_multiple_of(BLOCK as u64) {
                    return Err(self.refuse(
                        "its sparse map has a stored chunk not aligned to 512 bytes".into(),
                    ));
                }
                if offset < map.real_size {
                    return Err(
                        self.refuse("its sparse map has out of order or overlapping chunks".into())
                    );
                }
                let (Some(end), Some(total)) = (offset.checked_add(len), used.checked_add(len))
                else {
                    return Err(self.refuse("its sparse map overflows 64 bits".into()));
                };
                if total > stored {
                    return Err(self.refuse(format!(
                        "its sparse map lists more than the {stored} bytes it stores"
                    )));
                }
                map.chunks.push((offset, len));
                map.real_size = end;
                used = total;
            }
            if !extended {
                break;
            }
            ext_bytes += BLOCK as u64;
            if ext_bytes > MAX_HEADER_BODY {
                let limit = format!(
                    "its GNU sparse map passed the {MAX_HEADER_BODY}-byte cap on such headers"
                );
                return Err(self.limit(self.here(), limit));
            }
            let mut ext = tar::GnuExtSparseHeader::new();
            if self.fill_all(ext.as_mut_bytes())? < BLOCK {
                return Err(self.refuse("the layer ends inside its sparse map".into()));
            }
            slots = sparse_slots(ext.sparse());
            extended = ext.is_extended();
        }
        if used != stored {
            return Err(self.refuse(format!(
                "its sparse map lists {used} stored bytes, its header {stored}"
            )));
        }
        // A file may end in a hole with no chunk marking its end, as Go's
        // archive/tar reads it.
        match gnu.real_size() {
            Ok(real) if real >= map.real_size => map.real_size = real,
            _ => {
                return Err(self.refuse("its sparse map runs past the file's real size".into()));
            }
        }
        Ok(map)
    }
}

impl<R: Read> Read for Guard<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.block_pos < self.block_len {
                let n = (self.block_len - self.block_pos).min(buf.len());
                buf[..n].copy_from_slice(&self.block[self.block_pos..self.block_pos + n]);
                self.block_pos += n;
                self.written += n as u64;
                return Ok(n);
            }
            match self.state {
                State::Failed => return Err(io::Error::other("the layer broke an unpack limit")),
                State::Header => self.next_header()?,
                State::Tail => {
                    let n = self.fill(buf)?;
                    self.written += n as u64;
                    return Ok(n);
                }
                State::Body { data: 0, pad: 0 } => {
                    match self.keep.take() {
                        Some(Keep::LongName(b)) => self.long_name = Some(b),
                        Some(Keep::Pax(b)) => self.pax = Some(b),
                        None => {}
                    }
                    self.state = State::Header;
                }
                State::Body { data, pad } => {
                    let left = if data > 0 { data } else { pad };
                    let want = left.min(buf.len() as u64) as usize;
                    let n = self.fill(&mut buf[..want])?;
                    if n == 0 {
                        // Truncated: the crate reports it.
                        return Ok(0);
                    }
                    if data > 0 {
                        if let Some(Keep::LongName(b) | Keep::Pax(b)) = &mut self.keep {
                            b.extend_from_slice(&buf[..n]);
                        }
                        self.state = State::Body {
                            data: data - n as u64,
                            pad,
                        };
                    } else {
                        self.state = State::Body {
                            data,
                            pad: pad - n as u64,
                        };
                    }
                    self.written += n as u64;
                    return Ok(n);
                }
            }
        }
    }
}

/// The used slots of a sparse map block: `(offset, length)`, `None` where a
/// number does not parse.
fn sparse_slots(slots: &[tar::GnuSparseHeader]) -> Vec<Option<(u64, u64)>> {
    slots
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| Some((s.offset().ok()?, s.length().ok()?)))
        .collect()
}

/// PAX records as the crate parses them, malformed ones skipped.
fn pax_records(pax: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    tar::PaxExtensions::new(pax)
        .filter_map(Result::ok)
        .map(|r| (r.key_bytes(), r.value_bytes()))
}

/// The PAX `size` the crate applies: the first `size` record, unless a
/// malformed record comes before it or its value is not a number.
fn pax_size(pax: &[u8]) -> Option<u64> {
    for record in tar::PaxExtensions::new(pax) {
        let record = record.ok()?;
        if record.key_bytes() == b"size" {
            return record.value().ok()?.parse().ok();
        }
    }
    None
}

/// An entry path for an error message, cut to 256 bytes.
pub(super) fn shown(path: &[u8]) -> String {
    const SHOWN: usize = 256;
    if path.len() <= SHOWN {
        String::from_utf8_lossy(path).into_owned()
    } else {
        format!(
            "{}… ({} bytes)",
            String::from_utf8_lossy(&path[..SHOWN]),
            path.len()
        )
    }
}
