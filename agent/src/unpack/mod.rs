//! The layer unpacker: one OCI/Docker layer blob, streamed, into a directory
//! in overlayfs form, as containerd's overlayfs snapshotter and its applier
//! (`archive.Apply` with `OverlayConvertWhiteout`) would leave it.
//!
//! It reads a byte stream that may block while more verified bytes arrive,
//! decompresses it (gzip through flate2's zlib-rs backend, the fastest measured
//! here; zstd), hashes the uncompressed tar to its diffID, and writes every
//! entry through directory file descriptors (`openat` and friends), never
//! through a path that a symlink in the layer could redirect. It is
//! synchronous and holds no shared state, so several layers unpack in
//! parallel on blocking threads.
//!
//! Departures from containerd, all on hostile input: a path whose `..`
//! climbs above the layer root is refused (containerd clamps it to the root),
//! and so is an entry whose parent path runs through a symlink with an
//! absolute target or one that leaves the layer (containerd resolves it as if
//! the layer were `/`). Relative symlinks that stay inside the layer are
//! followed, as containerd does. As containerd's overlay applier (which
//! writes straight into the upper dir), symlinks of lower layers play no
//! part, `trusted.*` xattrs in the layer are dropped (they could steer
//! overlayfs), and an empty numeric header field reads as 0. A parent
//! directory the tar does not contain is made 0755 root-owned and marked
//! [`IMPLICIT_XATTR`]: the unpacker does not see the lower layers, whose
//! owner, mode and xattrs containerd copies (`mkparent`); the snapshotter
//! shim does that when it commits the layer.
//!
//! Hostile layers are bounded by [`UnpackLimits`] and the caps of [`guard`],
//! which walks the tar stream's header structure ahead of the `tar` crate:
//! GNU long names and links and PAX headers over 1 MiB, too many entries,
//! too many uncompressed bytes (absolute, and per compressed byte), and
//! paths longer than `PATH_MAX` are refused, naming the entry. GNU sparse
//! entries are written sparse; PAX sparse entries are refused (containerd
//! reads them; no image builder writes them).
//!
//! Gzip backends, `MultiGzDecoder` on a 256 MiB tar (224 MiB of /usr, 32 MiB
//! random; `gzip -6`, 162 MB), best of 3, three runs on this 2-core machine
//! under load (load average ~8): miniz_oxide 206–237 MB/s of tar, zlib-rs
//! 253–308, zlib-ng 279–353 (`gzip -d`: 91). zlib-rs is pure Rust and within
//! the noise of zlib-ng, which needs cmake and a C build, so zlib-rs it is.
//!
//! A large gzip layer on a node with enough cores can instead be decoded by
//! [`parallel_gzip`] ([`unpack_gzip_parallel_within`]), which reads the blob
//! positionally; everything after the decoder is the same code.

mod guard;
mod parallel_gzip;

pub use guard::{MAX_HEADER_BODY, RATIO_FLOOR, UnpackLimits};
pub use parallel_gzip::{ParallelGzip, ParallelGzipReader, ReadAt, cores, memory_cap};

use guard::{Guard, SharedFindings, SparseMap, shown};
use sha2::Digest;
use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::io::{self, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// How a layer blob is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression an OCI or Docker layer media type names.
    pub fn from_media_type(media_type: &str) -> Result<Compression, UnpackError> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Ok(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Ok(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Ok(Compression::Zstd),
            other => Err(UnpackError::UnsupportedMediaType(other.to_string())),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Compression::None => "tar",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

/// What unpacking one layer did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unpacked {
    /// `sha256:<hex>` of the uncompressed tar stream, trailer included.
    pub diff_id: String,
    pub compressed_bytes: u64,
    pub uncompressed_bytes: u64,
    /// Tar entries applied, whiteouts included.
    pub entries: u64,
    /// The parallel gzip decoder's route through the stream when it ran
    /// (`MarkerWindow`: decoded in parallel; `Sequential`: it judged the
    /// stream better decoded on one thread).
    pub parallel_gzip_route: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error(
        "unsupported layer media type {0:?}: expected an OCI or Docker tar layer, uncompressed, gzip or zstd"
    )]
    UnsupportedMediaType(String),
    #[error("unpack target {0} exists and is not an empty directory")]
    TargetNotEmpty(PathBuf),
    #[error("creating unpack target {path}: {source}")]
    Target { path: PathBuf, source: io::Error },
    #[error("reading the layer's {compression} stream {position}: {source}")]
    Stream {
        compression: &'static str,
        /// "at the start", "in entry \"<path>\"" or "after entry \"<path>\"".
        position: String,
        source: io::Error,
    },
    #[error("layer entry {entry:?} refused: {reason}")]
    Refused { entry: String, reason: String },
    /// `entry` is quoted, or says where the layer broke the limit.
    #[error("layer entry {entry} refused: {limit}")]
    Limit { entry: String, limit: String },
    #[error("layer entry {entry:?}: {op}: {source}")]
    Entry {
        entry: String,
        op: String,
        source: io::Error,
    },
    #[error("diffID mismatch: expected {expected}, got {got}")]
    DiffIdMismatch { expected: String, got: String },
}

/// [`unpack_layer_within`] the default limits.
pub fn unpack_layer(
    src: impl Read,
    compression: Compression,
    target: &Path,
    expected_diff_id: Option<&str>,
) -> Result<Unpacked, UnpackError> {
    unpack_layer_within(
        src,
        compression,
        target,
        expected_diff_id,
        &UnpackLimits::default(),
    )
}

/// Unpacks one layer from `src` into `target` (created; it must not exist or
/// be empty), checking the uncompressed stream against `expected_diff_id`
/// and the layer against `limits`. On any error `target` is removed entirely.
pub fn unpack_layer_within(
    src: impl Read,
    compression: Compression,
    target: &Path,
    expected_diff_id: Option<&str>,
    limits: &UnpackLimits,
) -> Result<Unpacked, UnpackError> {
    unpack_input(
        Input::Stream(src, compression),
        target,
        expected_diff_id,
        limits,
    )
}

/// [`unpack_layer_within`] for a gzip layer of `len` compressed bytes,
/// decoded by `threads` workers reading `src` where they need it (see
/// [`parallel_gzip`]): the same tree, diffID, limits and errors.
pub fn unpack_gzip_parallel_within(
    src: impl ReadAt + 'static,
    len: u64,
    threads: usize,
    target: &Path,
    expected_diff_id: Option<&str>,
    limits: &UnpackLimits,
) -> Result<Unpacked, UnpackError> {
    unpack_input(
        Input::<io::Empty>::ParallelGzip(Box::new(src), len, threads),
        target,
        expected_diff_id,
        limits,
    )
}

/// A layer's bytes: a stream, or a gzip blob read positionally by the
/// parallel decoder (its source, length and threads).
enum Input<R> {
    Stream(R, Compression),
    ParallelGzip(Box<dyn ReadAt>, u64, usize),
}

impl<R> Input<R> {
    fn compression(&self) -> Compression {
        match self {
            Input::Stream(_, c) => *c,
            Input::ParallelGzip(..) => Compression::Gzip,
        }
    }
}

fn unpack_input(
    input: Input<impl Read>,
    target: &Path,
    expected_diff_id: Option<&str>,
    limits: &UnpackLimits,
) -> Result<Unpacked, UnpackError> {
    match std::fs::create_dir(target) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let empty = std::fs::read_dir(target)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
            if !empty || !target.is_dir() {
                return Err(UnpackError::TargetNotEmpty(target.to_path_buf()));
            }
        }
        Err(source) => {
            return Err(UnpackError::Target {
                path: target.to_path_buf(),
                source,
            });
        }
    }
    let findings = SharedFindings::default();
    let result = unpack_into(input, target, expected_diff_id, limits, &findings)
        // A limit the guard enforced reaches here as whatever read error the tar
        // crate made of it: report the limit.
        .map_err(|e| findings.borrow_mut().breach.take().unwrap_or(e));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(target);
    }
    result
}

fn unpack_into(
    input: Input<impl Read>,
    target: &Path,
    expected_diff_id: Option<&str>,
    limits: &UnpackLimits,
    findings: &SharedFindings,
) -> Result<Unpacked, UnpackError> {
    let root = open_root(target).map_err(|source| UnpackError::Target {
        path: target.to_path_buf(),
        source,
    })?;
    let compression = input.compression();
    let at_start = |source| UnpackError::Stream {
        compression: compression.name(),
        position: "at the start".into(),
        source,
    };
    let compressed = std::cell::Cell::new(0u64);
    let mut route = None;
    let decoded: Box<dyn Read + '_> = match input {
        Input::Stream(src, compression) => {
            let counted = Counting {
                inner: src,
                n: &compressed,
            };
            match compression {
                Compression::None => Box::new(counted),
                Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(counted)),
                Compression::Zstd => {
                    Box::new(zstd::stream::read::Decoder::new(counted).map_err(at_start)?)
                }
            }
        }
        Input::ParallelGzip(src, len, threads) => {
            let reader = ParallelGzipReader::start(src, len, threads, limits).map_err(at_start)?;
            route = Some(reader.route());
            Box::new(reader.counting(&compressed))
        }
    };
    let hashing = Hashing {
        inner: decoded,
        hasher: sha2::Sha256::new(),
        n: 0,
    };
    let guarded = Guard::new(hashing, limits, &compressed, findings.clone());
    let mut archive = tar::Archive::new(BufReader::with_capacity(256 << 10, guarded));
    let mut writer = TreeWriter::new(root, limits.max_path_bytes, findings.clone());
    let mut last = None::<String>;
    let stream_err = |last: &Option<String>, source| UnpackError::Stream {
        compression: compression.name(),
        position: last
            .as_ref()
            .map_or("at the start".into(), |e| format!("after entry {e:?}")),
        source,
    };
    let entries = archive.entries().map_err(|e| stream_err(&last, e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| stream_err(&last, e))?;
        let name = shown(&entry.path_bytes());
        writer.apply(&mut entry).map_err(|e| match e {
            EntryError::Refused(reason) => UnpackError::Refused {
                entry: name.clone(),
                reason,
            },
            EntryError::Limit(limit) => UnpackError::Limit {
                entry: format!("{name:?}"),
                limit,
            },
            EntryError::Io(_, source) if is_stream_fault(&source) => {
                let inner = source.into_inner().expect("checked by is_stream_fault");
                UnpackError::Stream {
                    compression: compression.name(),
                    position: format!("in entry {name:?}"),
                    source: inner.downcast::<StreamFault>().expect("checked").0,
                }
            }
            EntryError::Io(op, source) => UnpackError::Entry {
                entry: name.clone(),
                op,
                source,
            },
        })?;
        last = Some(name);
    }
    writer.finish().map_err(|(name, e)| match e {
        EntryError::Refused(reason) => UnpackError::Refused {
            entry: name,
            reason,
        },
        EntryError::Limit(limit) => UnpackError::Limit {
            entry: format!("{name:?}"),
            limit,
        },
        EntryError::Io(op, source) => UnpackError::Entry {
            entry: name,
            op,
            source,
        },
    })?;
    // The diffID covers the whole stream: padding and trailer too.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(|e| stream_err(&last, e))?;
    let hashing = rest.into_inner().into_inner();
    let diff_id = format!("sha256:{}", hex::encode(hashing.hasher.finalize()));
    if let Some(expected) = expected_diff_id
        && expected != diff_id
    {
        return Err(UnpackError::DiffIdMismatch {
            expected: expected.to_string(),
            got: diff_id,
        });
    }
    Ok(Unpacked {
        diff_id,
        compressed_bytes: compressed.get(),
        uncompressed_bytes: hashing.n,
        entries: writer.entries,
        parallel_gzip_route: route.map(|r| r()),
    })
}

fn is_stream_fault(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<StreamFault>())
}

/// A read error of the tar stream met while copying a file's contents:
/// reported as a stream error, not as the file's.
#[derive(Debug)]
struct StreamFault(io::Error);

impl std::fmt::Display for StreamFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for StreamFault {}

struct Counting<'a, R> {
    inner: R,
    n: &'a std::cell::Cell<u64>,
}

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n.set(self.n.get() + n as u64);
        Ok(n)
    }
}

struct Hashing<R> {
    inner: R,
    hasher: sha2::Sha256,
    n: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.n += n as u64;
        Ok(n)
    }
}

enum EntryError {
    /// Hostile or impossible input.
    Refused(String),
    /// Input past one of the layer's limits.
    Limit(String),
    /// A system call failed: what was being done, and why it failed.
    Io(String, io::Error),
}

fn io_err(op: impl Into<String>) -> impl FnOnce(io::Error) -> EntryError {
    let op = op.into();
    move |e| EntryError::Io(op, e)
}

fn refused<T>(reason: impl Into<String>) -> Result<T, EntryError> {
    Err(EntryError::Refused(reason.into()))
}

/// The mark on a directory made only because the layer named something
/// inside it. The snapshotter shim (`snapshotter-shim/src/parents.rs`) gives
/// it the attributes of the lower layers' directory when it commits the
/// layer, and removes the mark.
pub const IMPLICIT_XATTR: &std::ffi::CStr = c"trusted.dray.implicit";

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const WHITEOUT_OPAQUE: &[u8] = b".wh..wh..opq";
const MAX_SYMLINK_HOPS: usize = 40;

/// The components of an entry's path inside the layer: a leading `/` and `.`
/// are dropped and `a/../b` is `b` (as Go's `filepath.Clean`); a `..` that
/// climbs above the root is refused.
fn clean_path(path: &[u8]) -> Result<Vec<&OsStr>, String> {
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                if out.pop().is_none() {
                    return Err("its path climbs out of the layer root with `..`".into());
                }
            }
            c => out.push(OsStr::from_bytes(c)),
        }
    }
    Ok(out)
}

/// How a tar entry becomes an overlayfs upper-dir entry.
#[derive(Debug, PartialEq, Eq)]
enum Whiteout<'a> {
    /// Not a whiteout: write it as it is.
    None,
    /// `.wh..wh..opq`: mark the directory opaque.
    Opaque,
    /// `.wh.<name>`: a 0/0 character device named `<name>`.
    Remove(&'a OsStr),
}

fn whiteout(name: &OsStr) -> Result<Whiteout<'_>, String> {
    let b = name.as_bytes();
    if b == WHITEOUT_OPAQUE {
        return Ok(Whiteout::Opaque);
    }
    match b.strip_prefix(WHITEOUT_PREFIX) {
        None => Ok(Whiteout::None),
        Some(b"" | b"." | b"..") => Err("a whiteout must name the entry it removes".into()),
        Some(rest) => Ok(Whiteout::Remove(OsStr::from_bytes(rest))),
    }
}

fn cstr(s: &OsStr) -> Result<CString, EntryError> {
    CString::new(s.as_bytes()).or_else(|_| refused("its name contains a NUL byte"))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn open_root(path: &Path) -> io::Result<OwnedFd> {
    let p = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid C string; the fd is owned on success.
    let fd = cvt(unsafe {
        libc::open(
            p.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dir_at(dir: RawFd, name: &CString) -> io::Result<OwnedFd> {
    // O_NOFOLLOW: a component swapped for a symlink fails rather than leads out.
    // SAFETY: a valid C string; the fd is owned on success.
    let fd = cvt(unsafe {
        libc::openat(
            dir,
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })?;
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `lstat` of `name` in `dir`; `None` if it does not exist.
fn stat_at(dir: RawFd, name: &CString) -> io::Result<Option<libc::stat>> {
    // SAFETY: stat is plain data, filled by the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    match cvt(unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) }) {
        Ok(_) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_link_at(dir: RawFd, name: &CString) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: buf is writable for its length.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

fn is_type(st: &libc::stat, kind: libc::mode_t) -> bool {
    st.st_mode & libc::S_IFMT == kind
}

/// `/proc/self/fd/<dir>/<name>`: a path to `name` that no symlink can redirect
/// (only the final component could be one, and the callers do not follow it).
fn proc_path(dir: RawFd, name: &CString) -> CString {
    let mut p = format!("/proc/self/fd/{dir}/").into_bytes();
    p.extend_from_slice(name.as_bytes());
    CString::new(p).expect("no NUL in a fd path or a checked name")
}

/// Entry metadata as containerd applies it.
struct Meta {
    uid: u32,
    gid: u32,
    /// Permission bits with setuid, setgid and sticky.
    mode: u32,
    mtime: libc::timespec,
    xattrs: Vec<(CString, Vec<u8>)>,
}

fn entry_meta<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<Meta, EntryError> {
    let h = entry.header();
    let old = h.as_old();
    let bad = |field: &str, e: io::Error| EntryError::Refused(format!("bad {field} field: {e}"));
    // An empty numeric field reads as 0, as in Go's archive/tar.
    let num = |field: &str, raw: &[u8], v: io::Result<u64>| match v {
        Err(_) if raw.iter().all(|&b| b == 0 || b == b' ') => Ok(0),
        v => v.map_err(|e| bad(field, e)),
    };
    let uid = num("uid", &old.uid, h.uid())?;
    let gid = num("gid", &old.gid, h.gid())?;
    let mode = num("mode", &old.mode, h.mode().map(u64::from))? as u32 & 0o7777;
    let mut mtime = libc::timespec {
        tv_sec: num("mtime", &old.mtime, h.mtime())? as libc::time_t,
        tv_nsec: 0,
    };
    let (Ok(uid), Ok(gid)) = (u32::try_from(uid), u32::try_from(gid)) else {
        return refused(format!("uid {uid} or gid {gid} does not fit in 32 bits"));
    };
    let mut xattrs = Vec::new();
    if let Some(pax) = entry
        .pax_extensions()
        .map_err(|e| bad("PAX extensions", e))?
    {
        for ext in pax {
            let ext = ext.map_err(|e| bad("PAX record", e))?;
            let key = ext.key_bytes();
            if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                if name.starts_with(b"trusted.") {
                    // As containerd: a layer must not set admin attributes,
                    // such as overlayfs's own trusted.overlay.* (redirects).
                    continue;
                }
                let Ok(name) = CString::new(name) else {
                    return refused("an xattr name contains a NUL byte");
                };
                xattrs.push((name, ext.value_bytes().to_vec()));
            } else if key == b"mtime" {
                mtime = parse_pax_time(ext.value_bytes())
                    .ok_or_else(|| EntryError::Refused("bad PAX mtime record".into()))?;
            }
        }
    }
    Ok(Meta {
        uid,
        gid,
        mode,
        mtime,
        xattrs,
    })
}

/// A PAX time such as `1700000000.123456789` or `-1.5`.
fn parse_pax_time(v: &[u8]) -> Option<libc::timespec> {
    let s = std::str::from_utf8(v).ok()?;
    let (neg, s) = s.strip_prefix('-').map_or((false, s), |r| (true, r));
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
    let nanos: i64 = digits.parse().ok()?;
    let (sec, nsec) = match (neg, nanos) {
        (false, n) => (secs, n),
        (true, 0) => (-secs, 0),
        (true, n) => (-secs - 1, 1_000_000_000 - n),
    };
    Some(libc::timespec {
        tv_sec: sec as libc::time_t,
        tv_nsec: nsec as _,
    })
}

/// Writes a layer's entries below one root directory, by file descriptor.
struct TreeWriter {
    root: OwnedFd,
    /// The last parent directory opened, to spare the walk for its siblings.
    /// Dropped whenever anything is removed, since that may have been it.
    cached: Option<(Vec<OsString>, OwnedFd)>,
    /// Directories whose mtime is set once their contents are written; a
    /// directory listed again takes its last mtime, as in containerd, and
    /// costs no more memory.
    dirs: HashMap<Vec<OsString>, libc::timespec>,
    buf: Vec<u8>,
    entries: u64,
    max_path_bytes: usize,
    /// The sparse maps of the entries the guard rewrote.
    findings: SharedFindings,
}

impl TreeWriter {
    fn new(root: OwnedFd, max_path_bytes: usize, findings: SharedFindings) -> TreeWriter {
        TreeWriter {
            root,
            cached: None,
            dirs: HashMap::new(),
            buf: vec![0; 256 << 10],
            entries: 0,
            max_path_bytes,
            findings,
        }
    }

    /// Opens the directory at `comps` below the root, creating missing ones
    /// (0755, as containerd's `mkparent`) if `create`. Relative symlinks on
    /// the way are followed while they stay inside the root; any other
    /// symlink is refused.
    fn open_dir(&mut self, comps: &[&OsStr], create: bool) -> Result<OwnedFd, EntryError> {
        if comps.is_empty() {
            return dup(self.root.as_raw_fd());
        }
        if let Some((path, fd)) = &self.cached
            && path
                .iter()
                .map(OsString::as_os_str)
                .eq(comps.iter().copied())
        {
            return dup(fd.as_raw_fd());
        }
        let mut stack: Vec<OwnedFd> = Vec::new();
        let mut pending: std::collections::VecDeque<OsString> =
            comps.iter().map(|c| c.to_os_string()).collect();
        let mut hops = 0;
        while let Some(c) = pending.pop_front() {
            match c.as_bytes() {
                b"" | b"." => continue,
                b".." => {
                    if stack.pop().is_none() {
                        return refused(
                            "a symlink in its path climbs out of the layer root with `..`",
                        );
                    }
                    continue;
                }
                _ => {}
            }
            let cur = stack
                .last()
                .map_or(self.root.as_raw_fd(), |f| f.as_raw_fd());
            let name = cstr(&c)?;
            let shown = c.to_string_lossy();
            match stat_at(cur, &name).map_err(io_err(format!("lstat of {shown:?}")))? {
                Some(st) if is_type(&st, libc::S_IFDIR) => stack.push(
                    open_dir_at(cur, &name)
                        .map_err(io_err(format!("opening directory {shown:?}")))?,
                ),
                Some(st) if is_type(&st, libc::S_IFLNK) => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return refused("too many symlinks in its path");
                    }
                    let target = read_link_at(cur, &name)
                        .map_err(io_err(format!("reading symlink {shown:?}")))?;
                    if target.starts_with(b"/") {
                        return refused(format!(
                            "its path runs through symlink {shown:?} to the absolute path {:?}",
                            String::from_utf8_lossy(&target)
                        ));
                    }
                    for t in target.split(|&b| b == b'/').rev() {
                        pending.push_front(OsStr::from_bytes(t).to_os_string());
                    }
                }
                Some(_) => {
                    return Err(EntryError::Io(
                        format!("opening {shown:?} as a directory"),
                        io::Error::from_raw_os_error(libc::ENOTDIR),
                    ));
                }
                None if create => {
                    // SAFETY: a valid C string.
                    cvt(unsafe { libc::mkdirat(cur, name.as_ptr(), 0o755) })
                        .map_err(io_err(format!("creating directory {shown:?}")))?;
                    let fd = open_dir_at(cur, &name)
                        .map_err(io_err(format!("opening directory {shown:?}")))?;
                    // Whoever knows the lower layers gives it their attributes.
                    set_xattr(fd.as_raw_fd(), None, IMPLICIT_XATTR, b"")
                        .map_err(io_err(format!("marking directory {shown:?} implicit")))?;
                    stack.push(fd);
                }
                None => {
                    return Err(EntryError::Io(
                        format!("opening directory {shown:?}"),
                        io::Error::from_raw_os_error(libc::ENOENT),
                    ));
                }
            }
        }
        let Some(fd) = stack.pop() else {
            return dup(self.root.as_raw_fd());
        };
        let copy = dup(fd.as_raw_fd())?;
        self.cached = Some((comps.iter().map(|c| c.to_os_string()).collect(), fd));
        Ok(copy)
    }

    fn apply<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), EntryError> {
        // Taken first, so that a map is never left behind by an entry that
        // returns early.
        let sparse = self
            .findings
            .borrow_mut()
            .sparse
            .remove(&entry.raw_header_position());
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        self.entries += 1;
        let path = entry.path_bytes().into_owned();
        let link_len = entry.link_name_bytes().map_or(0, |l| l.len());
        if path.len().max(link_len) > self.max_path_bytes {
            let what = if path.len() >= link_len {
                "path"
            } else {
                "link target"
            };
            return Err(EntryError::Limit(format!(
                "its {what} is {} bytes, past max_path_bytes = {}",
                path.len().max(link_len),
                self.max_path_bytes
            )));
        }
        let comps = clean_path(&path).map_err(EntryError::Refused)?;
        let Some((name, parent)) = comps.split_last() else {
            // containerd ignores entries that resolve to the root.
            return Ok(());
        };
        let dir_fd = self.open_dir(parent, true)?;
        let dir = dir_fd.as_raw_fd();
        match whiteout(name).map_err(EntryError::Refused)? {
            Whiteout::Opaque => {
                return set_xattr(dir, None, c"trusted.overlay.opaque", b"y")
                    .map_err(io_err("setting trusted.overlay.opaque"));
            }
            Whiteout::Remove(target) => {
                let target = cstr(target)?;
                let meta = entry_meta(entry)?;
                // SAFETY: a valid C string.
                cvt(unsafe { libc::mknodat(dir, target.as_ptr(), libc::S_IFCHR, 0) })
                    .map_err(io_err("creating the whiteout device"))?;
                // SAFETY: a valid C string.
                return cvt(unsafe {
                    libc::fchownat(
                        dir,
                        target.as_ptr(),
                        meta.uid,
                        meta.gid,
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                })
                .map(drop)
                .map_err(io_err("chown of the whiteout device"));
            }
            Whiteout::None => {}
        }
        let meta = entry_meta(entry)?;
        let link = entry.link_name_bytes().map(|l| l.into_owned());
        let cname = cstr(name)?;
        let is_dir = kind.is_dir();
        let existing = stat_at(dir, &cname).map_err(io_err("lstat"))?;
        if let Some(st) = &existing
            && !(is_dir && is_type(st, libc::S_IFDIR))
        {
            // Later paths through what is removed must be walked afresh.
            self.cached = None;
            remove_at(dir, &cname, is_type(st, libc::S_IFDIR))
                .map_err(io_err("removing what the entry replaces"))?;
        }
        let mut is_symlink = false;
        match kind {
            tar::EntryType::Directory => {
                if existing.is_none_or(|st| !is_type(&st, libc::S_IFDIR)) {
                    // SAFETY: a valid C string.
                    cvt(unsafe { libc::mkdirat(dir, cname.as_ptr(), 0o700) })
                        .map_err(io_err("mkdir"))?;
                } else {
                    // Named after all: no longer implicit.
                    let path = proc_path(dir, &cname);
                    // SAFETY: valid C strings.
                    if unsafe { libc::lremovexattr(path.as_ptr(), IMPLICIT_XATTR.as_ptr()) } != 0 {
                        let e = io::Error::last_os_error();
                        if !matches!(e.raw_os_error(), Some(libc::ENODATA | libc::ENOTSUP)) {
                            return Err(EntryError::Io("removing its implicit mark".into(), e));
                        }
                    }
                }
                self.dirs
                    .insert(comps.iter().map(|c| c.to_os_string()).collect(), meta.mtime);
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                self.write_file(dir, &cname, entry, sparse)?
            }
            tar::EntryType::Symlink => {
                let Some(target) = link else {
                    return refused("a symlink without a target");
                };
                let target = CString::new(target)
                    .or_else(|_| refused("its symlink target contains a NUL byte"))?;
                // SAFETY: valid C strings.
                cvt(unsafe { libc::symlinkat(target.as_ptr(), dir, cname.as_ptr()) })
                    .map_err(io_err("symlink"))?;
                is_symlink = true;
            }
            tar::EntryType::Link => {
                let Some(target) = link else {
                    return refused("a hardlink without a target");
                };
                let shown = String::from_utf8_lossy(&target).into_owned();
                let tcomps = clean_path(&target).map_err(|_| {
                    EntryError::Refused(format!(
                        "its hardlink target {shown:?} climbs out of the layer root"
                    ))
                })?;
                let Some((tname, tparent)) = tcomps.split_last() else {
                    return refused("its hardlink target is the layer root");
                };
                let tname = cstr(tname)?;
                let tdir = self.open_dir(tparent, false)?;
                // No AT_SYMLINK_FOLLOW: a link to a symlink links the symlink, as os.Link.
                // SAFETY: valid C strings.
                cvt(unsafe {
                    libc::linkat(tdir.as_raw_fd(), tname.as_ptr(), dir, cname.as_ptr(), 0)
                })
                .map_err(io_err(format!("hardlink to {shown:?}")))?;
                is_symlink = stat_at(dir, &cname)
                    .map_err(io_err("lstat"))?
                    .is_some_and(|st| is_type(&st, libc::S_IFLNK));
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let h = entry.header();
                let dev = match (h.device_major(), h.device_minor()) {
                    (Ok(Some(major)), Ok(Some(minor))) => libc::makedev(major, minor),
                    _ => 0,
                };
                let ftype = match kind {
                    tar::EntryType::Char => libc::S_IFCHR,
                    tar::EntryType::Block => libc::S_IFBLK,
                    _ => libc::S_IFIFO,
                };
                // SAFETY: a valid C string.
                cvt(unsafe { libc::mknodat(dir, cname.as_ptr(), ftype | 0o600, dev) })
                    .map_err(io_err("mknod"))?;
            }
            other => return refused(format!("unsupported tar entry type {other:?}")),
        }
        apply_meta(dir, &cname, &meta, is_symlink, !is_dir)
    }

    /// Writes the entry's data; a sparse one's chunks at their offsets, the
    /// holes left unwritten.
    fn write_file<R: Read>(
        &mut self,
        dir: RawFd,
        name: &CString,
        entry: &mut tar::Entry<'_, R>,
        sparse: Option<SparseMap>,
    ) -> Result<(), EntryError> {
        // SAFETY: a valid C string; the fd is owned on success.
        let fd = cvt(unsafe {
            libc::openat(
                dir,
                name.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600,
            )
        })
        .map_err(io_err("creating the file"))?;
        let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let Some(map) = sparse else {
            return self.copy_data(entry, &mut file, u64::MAX);
        };
        for (offset, len) in map.chunks {
            io::Seek::seek(&mut file, io::SeekFrom::Start(offset))
                .map_err(io_err("seeking to a sparse chunk"))?;
            self.copy_data(entry, &mut file, len)?;
        }
        file.set_len(map.real_size).map_err(io_err(format!(
            "setting the sparse file's size to {}",
            map.real_size
        )))
    }

    /// Copies up to `len` bytes of the entry's data into `file`.
    fn copy_data<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        file: &mut std::fs::File,
        mut len: u64,
    ) -> Result<(), EntryError> {
        while len > 0 {
            let want = len.min(self.buf.len() as u64) as usize;
            let n = match entry.read(&mut self.buf[..want]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(EntryError::Io(
                        "reading its contents".into(),
                        io::Error::new(e.kind(), StreamFault(e)),
                    ));
                }
            };
            io::Write::write_all(file, &self.buf[..n]).map_err(io_err("writing the file"))?;
            len -= n as u64;
        }
        Ok(())
    }

    /// Sets directory mtimes last, as containerd does, so that writing their
    /// contents does not change them.
    fn finish(&mut self) -> Result<(), (String, EntryError)> {
        for (comps, mtime) in std::mem::take(&mut self.dirs) {
            let name = comps.join(OsStr::new("/")).to_string_lossy().into_owned();
            let comps: Vec<&OsStr> = comps.iter().map(OsString::as_os_str).collect();
            let fd = self
                .open_dir(&comps, false)
                .map_err(|e| (name.clone(), e))?;
            let fd = fd.as_raw_fd();
            let times = [mtime, mtime];
            // SAFETY: times holds two timespecs.
            cvt(unsafe { libc::futimens(fd, times.as_ptr()) })
                .map_err(|e| (name, EntryError::Io("setting the mtime".into(), e)))?;
        }
        Ok(())
    }
}

fn dup(fd: RawFd) -> Result<OwnedFd, EntryError> {
    // SAFETY: fcntl on a valid fd; owned on success.
    let new = cvt(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })
        .map_err(io_err("duplicating a directory descriptor"))?;
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

fn remove_at(dir: RawFd, name: &CString, is_dir: bool) -> io::Result<()> {
    if is_dir {
        // std's remove_dir_all does not follow symlinks inside the tree.
        let path = proc_path(dir, name);
        std::fs::remove_dir_all(OsStr::from_bytes(path.as_bytes()))
    } else {
        // SAFETY: a valid C string.
        cvt(unsafe { libc::unlinkat(dir, name.as_ptr(), 0) }).map(drop)
    }
}

fn set_xattr(
    dir: RawFd,
    name: Option<&CString>,
    key: &std::ffi::CStr,
    value: &[u8],
) -> io::Result<()> {
    let r = match name {
        // SAFETY: valid C strings and a value buffer of the given length.
        None => unsafe {
            libc::fsetxattr(dir, key.as_ptr(), value.as_ptr().cast(), value.len(), 0)
        },
        Some(name) => {
            let path = proc_path(dir, name);
            unsafe {
                libc::lsetxattr(
                    path.as_ptr(),
                    key.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                )
            }
        }
    };
    cvt(r).map(drop)
}

/// Owner, xattrs, mode (after chown, which clears setuid) and, unless it is a
/// directory (done in `finish`), the mtime.
fn apply_meta(
    dir: RawFd,
    name: &CString,
    meta: &Meta,
    is_symlink: bool,
    set_mtime: bool,
) -> Result<(), EntryError> {
    // SAFETY: a valid C string.
    cvt(unsafe {
        libc::fchownat(
            dir,
            name.as_ptr(),
            meta.uid,
            meta.gid,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map_err(io_err(format!("chown to {}:{}", meta.uid, meta.gid)))?;
    for (key, value) in &meta.xattrs {
        if let Err(e) = set_xattr(dir, Some(name), key, value) {
            // As containerd: user.* xattrs cannot be set on symlinks or
            // devices, and a filesystem may not support xattrs at all.
            let skip = e.raw_os_error() == Some(libc::ENOTSUP)
                || (e.raw_os_error() == Some(libc::EPERM)
                    && key.as_bytes().starts_with(b"user.")
                    && !is_regular_or_dir(dir, name));
            if !skip {
                return Err(EntryError::Io(
                    format!("setting xattr {}", key.to_string_lossy()),
                    e,
                ));
            }
        }
    }
    if !is_symlink {
        // SAFETY: a valid C string.
        cvt(unsafe { libc::fchmodat(dir, name.as_ptr(), meta.mode, 0) })
            .map_err(io_err(format!("chmod to {:o}", meta.mode)))?;
    }
    if set_mtime {
        let times = [meta.mtime, meta.mtime];
        // SAFETY: a valid C string; times holds two timespecs.
        cvt(unsafe {
            libc::utimensat(
                dir,
                name.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })
        .map_err(io_err("setting the mtime"))?;
    }
    Ok(())
}

fn is_regular_or_dir(dir: RawFd, name: &CString) -> bool {
    stat_at(dir, name)
        .ok()
        .flatten()
        .is_some_and(|st| is_type(&st, libc::S_IFREG) || is_type(&st, libc::S_IFDIR))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn comps(p: &str) -> Result<Vec<String>, String> {
        clean_path(p.as_bytes()).map(|v| v.iter().map(|c| c.to_string_lossy().into()).collect())
    }

    #[test]
    fn paths_are_cleaned_like_go_filepath_clean_inside_the_root() {
        assert_eq!(comps("/etc/passwd").unwrap(), ["etc", "passwd"]);
        assert_eq!(comps("./a//b/./c/").unwrap(), ["a", "b", "c"]);
        assert_eq!(comps("a/../b").unwrap(), ["b"]);
        assert!(comps("./").unwrap().is_empty());
    }

    #[test]
    fn paths_climbing_above_the_root_are_refused() {
        assert!(comps("../etc/passwd").is_err());
        assert!(comps("a/../../etc").is_err());
        assert!(comps("/../x").is_err());
    }

    #[test]
    fn whiteout_names_map_to_overlay_forms() {
        assert_eq!(whiteout(OsStr::new("file")).unwrap(), Whiteout::None);
        assert_eq!(
            whiteout(OsStr::new(".wh..wh..opq")).unwrap(),
            Whiteout::Opaque
        );
        assert_eq!(
            whiteout(OsStr::new(".wh.gone")).unwrap(),
            Whiteout::Remove(OsStr::new("gone"))
        );
        assert!(whiteout(OsStr::new(".wh.")).is_err());
        assert!(whiteout(OsStr::new(".wh...")).is_err());
    }

    #[test]
    fn pax_times_keep_nanoseconds() {
        let t = parse_pax_time(b"1700000000.123456789").unwrap();
        assert_eq!((t.tv_sec, t.tv_nsec), (1_700_000_000, 123_456_789));
        let t = parse_pax_time(b"12.5").unwrap();
        assert_eq!((t.tv_sec, t.tv_nsec), (12, 500_000_000));
        let t = parse_pax_time(b"-1.25").unwrap();
        assert_eq!((t.tv_sec, t.tv_nsec), (-2, 750_000_000));
        assert!(parse_pax_time(b"1.2x").is_none());
    }

    #[test]
    fn media_types_name_their_compression() {
        use Compression::*;
        for (t, c) in [
            ("application/vnd.oci.image.layer.v1.tar", None),
            ("application/vnd.oci.image.layer.v1.tar+gzip", Gzip),
            (
                "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
                Zstd,
            ),
            ("application/vnd.docker.image.rootfs.diff.tar.gzip", Gzip),
        ] {
            assert_eq!(Compression::from_media_type(t).unwrap(), c, "{t}");
        }
        let e = Compression::from_media_type("application/json").unwrap_err();
        assert!(e.to_string().contains("application/json"), "{e}");
    }

    fn header(path: &str, kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o755);
        h.set_mtime(1_600_000_000);
        h.set_cksum();
        h
    }

    /// A PAX extended header holding `records` (key, value).
    fn pax(records: &[(&str, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = format!(" {k}={v}\n");
            let mut len = rest.len() + 1;
            while format!("{len}").len() + rest.len() > len {
                len += 1;
            }
            body.extend_from_slice(format!("{len}{rest}").as_bytes());
        }
        let mut out = header("PaxHeader", tar::EntryType::XHeader, body.len() as u64)
            .as_bytes()
            .to_vec();
        out.extend_from_slice(&body);
        out.resize(out.len().next_multiple_of(512), 0);
        out
    }

    #[test]
    fn the_guard_follows_a_pax_size_as_the_tar_crate_does() {
        // The header says 1024 bytes of data, a PAX record 0: the tar crate
        // reads the next header where the data would start. There sits a
        // 2 GiB long name; the guard must see it as a header too.
        let mut tar = pax(&[("size", "0")]);
        tar.extend_from_slice(header("f", tar::EntryType::Regular, 1024).as_bytes());
        tar.extend_from_slice(
            header("././@LongLink", tar::EntryType::GNULongName, 2 << 30).as_bytes(),
        );
        let bomb = io::Cursor::new(tar).chain(io::repeat(b'a'));
        let dir = tempfile::tempdir().unwrap();
        let e = unpack_layer(bomb, Compression::None, &dir.path().join("t"), None).unwrap_err();
        assert!(
            matches!(&e, UnpackError::Limit { entry, .. } if entry == "following \"f\""),
            "{e}"
        );
        assert!(
            e.to_string().contains("GNU long name is 2147483648 bytes"),
            "{e}"
        );

        // The other way round: a header of size 0 with a PAX size of 1024,
        // whose data looks like a long-name header: it is data.
        let mut tar = pax(&[("size", "1024")]);
        tar.extend_from_slice(header("g", tar::EntryType::Regular, 0).as_bytes());
        let data = header("././@LongLink", tar::EntryType::GNULongName, 2 << 30);
        tar.extend_from_slice(data.as_bytes());
        tar.extend_from_slice(&[b'x'; 512]);
        tar.extend_from_slice(&[0; 1024]);
        let target = dir.path().join("u");
        unpack_layer(&tar[..], Compression::None, &target, None).unwrap();
        let written = std::fs::read(target.join("g")).unwrap();
        assert_eq!(&written[..512], data.as_bytes());
    }

    #[test]
    fn pax_sparse_entries_are_refused_by_name() {
        let mut tar = pax(&[("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0")]);
        tar.extend_from_slice(header("GNUSparseFile.0/big", tar::EntryType::Regular, 0).as_bytes());
        tar.extend_from_slice(&[0; 1024]);
        let dir = tempfile::tempdir().unwrap();
        let e = unpack_layer(&tar[..], Compression::None, &dir.path().join("t"), None).unwrap_err();
        assert!(
            matches!(&e, UnpackError::Refused { entry, reason }
                if entry == "GNUSparseFile.0/big" && reason.contains("PAX sparse")),
            "{e}"
        );
        assert!(!dir.path().join("t").exists());
    }

    fn marked(p: &Path) -> bool {
        let p = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid C strings; a null buffer asks only whether it is there.
        unsafe {
            libc::lgetxattr(p.as_ptr(), IMPLICIT_XATTR.as_ptr(), std::ptr::null_mut(), 0) >= 0
        }
    }

    #[test]
    fn directories_made_only_for_their_contents_are_marked_until_the_layer_names_them() {
        let mut b = tar::Builder::new(Vec::new());
        b.append(&header("a/b/f", tar::EntryType::Regular, 2), &b"hi"[..])
            .unwrap();
        b.append(&header("a/", tar::EntryType::Directory, 0), &[][..])
            .unwrap();
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("layer");
        unpack_layer(&tar[..], Compression::None, &target, None).unwrap();
        assert!(marked(&target.join("a/b")));
        assert!(!marked(&target.join("a")));
        assert!(!marked(&target.join("a/b/f")));
    }

    #[test]
    fn whiteouts_become_devices_and_opaque_markers_become_xattrs() {
        let mut b = tar::Builder::new(Vec::new());
        b.append(&header("dir/", tar::EntryType::Directory, 0), &[][..])
            .unwrap();
        b.append(
            &header("dir/.wh..wh..opq", tar::EntryType::Regular, 0),
            &[][..],
        )
        .unwrap();
        b.append(&header("dir/.wh.gone", tar::EntryType::Regular, 0), &[][..])
            .unwrap();
        b.append(&header("dir/kept", tar::EntryType::Regular, 2), &b"hi"[..])
            .unwrap();
        let tar = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("layer");
        let u = unpack_layer(&tar[..], Compression::None, &target, None).unwrap();
        assert_eq!(u.entries, 4);
        assert_eq!(u.uncompressed_bytes, tar.len() as u64);
        let gone = std::fs::symlink_metadata(target.join("dir/gone")).unwrap();
        assert!(gone.file_type().is_char_device());
        assert_eq!(gone.rdev(), 0);
        assert!(!target.join("dir/.wh.gone").exists());
        assert!(!target.join("dir/.wh..wh..opq").exists());
        let mut v = [0u8; 4];
        let p = CString::new(target.join("dir").as_os_str().as_bytes()).unwrap();
        // SAFETY: valid C strings and buffer.
        let n = unsafe {
            libc::lgetxattr(
                p.as_ptr(),
                c"trusted.overlay.opaque".as_ptr(),
                v.as_mut_ptr().cast(),
                v.len(),
            )
        };
        assert_eq!(&v[..n.max(0) as usize], b"y");
        assert_eq!(std::fs::read(target.join("dir/kept")).unwrap(), b"hi");
        // Directory mtimes are set after their contents.
        let m = std::fs::metadata(target.join("dir")).unwrap();
        assert_eq!(m.mtime(), 1_600_000_000);
    }
}
