//! Garbage collection of the chunk store: a node that pulls for months keeps
//! its disk below a budget and its watermarks, and never drops one of the
//! cluster's last copies of a blob while it has a choice.
//!
//! The limits (`[gc]`): the store may use at most `budget` bytes (if set),
//! and the filesystem it lives on at most its share `high_watermark`; past
//! either, the collector evicts down to `low_watermark`. A blob is opened
//! only if it fits under the budget and under `critical_watermark` of the
//! filesystem after eviction; otherwise it is refused before any disk is
//! reserved, with a message naming the limit.
//!
//! What goes, in order ([`plan`]): partial blobs idle past `partial_ttl`
//! (abandoned pulls, preallocation and all); complete blobs idle past `ttl`;
//! then, under pressure, least recently used, blobs with many holders
//! first. Never a blob in use (an `Arc` of it is held: a mirror stream, an
//! unpack, an upload, a pull) or pinned (`gc.pinned`, and the blobs of the
//! images pinned with `dray pin`, kept in the state directory by
//! [`GcState::pin`]). The tracker tells each node, per
//! blob it holds complete, the cluster's complete copies and this node's
//! rank among them (`dray_protocol::scheduler::CompleteHolders`): a node of
//! rank below `keep_cluster_copies` keeps the blob unless the disk is past
//! `critical_watermark` (then it evicts anyway, logs it and counts it
//! under reason `critical`).
//!
//! The delete order is what makes a `kill -9` harmless (see
//! [`crate::store::ChunkStore::evict`]): the record goes first, the file
//! last, and a store that opens sweeps files without a record.

use crate::error::{Error, Result};
use crate::store::ChunkStore;
use dray_protocol::BlobDigest;
use dray_protocol::settings::duration;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Garbage collection settings (`[gc]`); every key optional.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GcConfig {
    /// The most the store may hold, bytes (preallocated partial blobs
    /// count in full). None: the filesystem's watermarks alone.
    pub budget: Option<u64>,
    /// Share of the budget, and of the store's filesystem, past which the
    /// collector evicts.
    pub high_watermark: f64,
    /// Share it evicts down to.
    pub low_watermark: f64,
    /// Share of the filesystem past which blobs the cluster has too few
    /// copies of are evicted too, and new blobs are refused.
    pub critical_watermark: f64,
    /// Complete blobs unused this long go first, pressure or not.
    #[serde(with = "duration")]
    pub ttl: Duration,
    /// Partial blobs untouched this long are reclaimed.
    #[serde(with = "duration")]
    pub partial_ttl: Duration,
    /// How often the collector looks.
    #[serde(with = "duration")]
    pub period: Duration,
    /// Complete copies the cluster keeps of a blob: a node ranked among
    /// the first this many holders keeps it below the critical watermark.
    /// 0 keeps nothing for the cluster's sake.
    pub keep_cluster_copies: u32,
    /// Blob digests (`sha256:...`) never evicted: an image's layers and config.
    pub pinned: Vec<String>,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self {
            budget: None,
            // Dragonfly's client defaults; the kubelet's DiskPressure
            // threshold (10-15% free) lies above 80%.
            high_watermark: 0.80,
            low_watermark: 0.60,
            critical_watermark: 0.95,
            // Dragonfly's task TTL.
            ttl: Duration::from_secs(6 * 3600),
            partial_ttl: Duration::from_secs(3600),
            period: Duration::from_secs(60),
            keep_cluster_copies: 3,
            pinned: Vec::new(),
        }
    }
}

impl GcConfig {
    /// Refuses watermarks out of order or outside (0, 1].
    pub fn validate(&self) -> Result<()> {
        let (l, h, c) = (
            self.low_watermark,
            self.high_watermark,
            self.critical_watermark,
        );
        if !(0.0 < l && l <= h && h <= c && c <= 1.0) {
            return Err(Error::Config(format!(
                "gc watermarks must satisfy 0 < low_watermark ({l}) <= high_watermark ({h}) <= critical_watermark ({c}) <= 1"
            )));
        }
        if let Some(bad) = self
            .pinned
            .iter()
            .find(|d| d.parse::<BlobDigest>().is_err())
        {
            return Err(Error::Config(format!(
                "gc.pinned entry {bad:?} is not a blob digest (sha256:<64 hex>)"
            )));
        }
        if self.period.is_zero() {
            return Err(Error::Config("gc.period must be more than 0".into()));
        }
        Ok(())
    }
}

impl GcConfig {
    /// The pinned digests (entries that do not parse were refused by `validate`).
    pub fn pins(&self) -> HashSet<BlobDigest> {
        self.pinned.iter().filter_map(|d| d.parse().ok()).collect()
    }
}

/// Why a blob was evicted.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A partial blob untouched past `partial_ttl`, or abandoned under pressure.
    Partial,
    /// A complete blob unused past `ttl`.
    Ttl,
    /// Least recently used, above the high watermark or to make room.
    Pressure,
    /// One of the cluster's last copies, past the critical watermark.
    Critical,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Partial => "partial",
            Self::Ttl => "ttl",
            Self::Pressure => "pressure",
            Self::Critical => "critical",
        }
    }
}

impl EncodeLabelValue for Reason {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        std::fmt::Write::write_str(e, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: Reason,
}

/// A watermark's name, as a label value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LevelLabel {
    level: &'static str,
}

/// The collector's metrics, registered with the agent's others.
#[derive(Clone, Debug, Default)]
pub struct GcMetrics {
    store_bytes: Gauge,
    store_blobs: Gauge,
    open_blobs: Gauge,
    evictions: Family<ReasonLabel, Counter>,
    evicted_bytes: Counter,
    refusals: Counter,
    /// Shares (0 to 1).
    use_share: Gauge<f64, AtomicU64>,
    watermarks: Family<LevelLabel, Gauge<f64, AtomicU64>>,
    budget_bytes: Gauge,
    filesystem_bytes: Gauge,
    filesystem_free_bytes: Gauge,
}

impl GcMetrics {
    pub fn register(&self, r: &mut Registry) {
        // At 0 from the start, as the agent's other labelled counters.
        for reason in [
            Reason::Partial,
            Reason::Ttl,
            Reason::Pressure,
            Reason::Critical,
        ] {
            let _ = self.evictions.get_or_create(&ReasonLabel { reason });
        }
        r.register_with_unit(
            "store",
            "Disk the chunk store holds (partial blobs count at their full preallocated size)",
            Unit::Bytes,
            self.store_bytes.clone(),
        );
        r.register(
            "store_blobs",
            "Blobs the chunk store holds, complete or partial",
            self.store_blobs.clone(),
        );
        r.register(
            "store_open_blobs",
            "Blobs the chunk store holds open (one file descriptor each): those in use and at most max_open_idle_blobs idle ones",
            self.open_blobs.clone(),
        );
        r.register(
            "evictions",
            "Blobs the garbage collector deleted, by reason",
            self.evictions.clone(),
        );
        r.register_with_unit(
            "evicted",
            "Bytes the garbage collector freed",
            Unit::Bytes,
            self.evicted_bytes.clone(),
        );
        r.register(
            "space_refusals",
            "Blobs refused at open because they would not fit in the store's budget or the filesystem",
            self.refusals.clone(),
        );
        r.register_with_unit(
            "store_use",
            "Share of its limits the store uses: the greater of the store against gc.budget and the filesystem's use; the watermarks are shares of the same",
            Unit::Other("ratio".into()),
            self.use_share.clone(),
        );
        r.register_with_unit(
            "store_watermark",
            "The collector's watermarks (gc.low_watermark, gc.high_watermark, gc.critical_watermark), by level",
            Unit::Other("ratio".into()),
            self.watermarks.clone(),
        );
        r.register_with_unit(
            "store_budget",
            "gc.budget, the most the store may hold; 0: none (the filesystem's watermarks alone)",
            Unit::Bytes,
            self.budget_bytes.clone(),
        );
        r.register_with_unit(
            "filesystem_size",
            "Size of the filesystem holding the chunk store",
            Unit::Bytes,
            self.filesystem_bytes.clone(),
        );
        r.register_with_unit(
            "filesystem_free",
            "Free bytes of the filesystem holding the chunk store",
            Unit::Bytes,
            self.filesystem_free_bytes.clone(),
        );
    }
}

/// A blob's complete copies in the cluster, as the tracker last said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Holders {
    pub complete: u32,
    /// Complete holders ranked before this node.
    pub rank: u32,
}

/// One blob as the planner sees it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub digest: BlobDigest,
    pub bytes: u64,
    pub complete: bool,
    /// Since it was last opened, read or written.
    pub idle: Duration,
    pub in_use: bool,
    pub pinned: bool,
    /// None: the tracker has not said (or there is none).
    pub holders: Option<Holders>,
}

/// A blob the planner chose, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eviction {
    pub digest: String,
    pub bytes: u64,
    pub reason: Reason,
}

/// How far over its limits the store is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pressure {
    /// Bytes to free to be back at the low watermark (0: below high).
    pub need: u64,
    /// Past the critical watermark: the cluster's last copies may go.
    pub critical: bool,
}

/// What the store and its filesystem use.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Usage {
    pub store_bytes: u64,
    pub store_blobs: usize,
    /// Of them, open now (see `max_open_idle_blobs`).
    #[serde(default)]
    pub open_blobs: usize,
    pub fs_bytes: u64,
    pub fs_free: u64,
}

fn share(total: u64, f: f64) -> u64 {
    (total as f64 * f) as u64
}

/// The share of its limits the store uses, the figure the watermarks are
/// shares of: the greater of the store against `budget` (if set) and the
/// filesystem's use against its size.
pub fn use_share(cfg: &GcConfig, u: &Usage) -> f64 {
    let of = |used: u64, total: u64| used as f64 / total.max(1) as f64;
    let fs = if u.fs_bytes > 0 {
        of(u.fs_bytes.saturating_sub(u.fs_free), u.fs_bytes)
    } else {
        0.0
    };
    cfg.budget
        .map_or(fs, |budget| fs.max(of(u.store_bytes, budget)))
}

/// The most the store could ever hold, with everything else it holds
/// evicted: under a `budget`, its `high_watermark` share (the collector
/// keeps the store below it); on the filesystem, its `critical_watermark`
/// share less what others keep there (past it the store refuses new blobs).
pub fn capacity(cfg: &GcConfig, u: &Usage) -> u64 {
    let fs = if u.fs_bytes > 0 {
        let others = (u.fs_bytes.saturating_sub(u.fs_free)).saturating_sub(u.store_bytes);
        share(u.fs_bytes, cfg.critical_watermark).saturating_sub(others)
    } else {
        u64::MAX
    };
    cfg.budget
        .map_or(fs, |budget| fs.min(share(budget, cfg.high_watermark)))
}

/// How far `usage` is past `cfg`'s watermarks.
pub fn pressure(cfg: &GcConfig, u: &Usage) -> Pressure {
    let fs_used = u.fs_bytes.saturating_sub(u.fs_free);
    let mut p = Pressure::default();
    let mut over = |used: u64, total: u64| {
        if used > share(total, cfg.high_watermark) {
            p.need = p
                .need
                .max(used.saturating_sub(share(total, cfg.low_watermark)));
        }
        p.critical |= used > share(total, cfg.critical_watermark);
    };
    if let Some(budget) = cfg.budget {
        over(u.store_bytes, budget);
    }
    if u.fs_bytes > 0 {
        over(fs_used, u.fs_bytes);
    }
    p
}

/// The blobs to evict, in order, to free `p.need` bytes (and whatever is
/// past its TTL). `cluster_aware`: a tracker is configured, so a blob
/// without word of its holders is kept as if this node had the last copy.
pub fn plan(
    cands: &[Candidate],
    p: Pressure,
    cfg: &GcConfig,
    cluster_aware: bool,
) -> Vec<Eviction> {
    let keep = cfg.keep_cluster_copies;
    let spare =
        |c: &Candidate| keep == 0 || !cluster_aware || c.holders.is_some_and(|h| h.rank >= keep);
    let mut out = Vec::new();
    let mut chosen = HashSet::new();
    let mut freed = 0u64;
    let mut take = |c: &Candidate, reason: Reason, out: &mut Vec<Eviction>| {
        if chosen.insert(c.digest) {
            freed += c.bytes;
            out.push(Eviction {
                digest: c.digest.to_string(),
                bytes: c.bytes,
                reason,
            });
        }
    };
    let free: Vec<&Candidate> = cands.iter().filter(|c| !c.in_use && !c.pinned).collect();
    for c in &free {
        if !c.complete && c.idle >= cfg.partial_ttl {
            take(c, Reason::Partial, &mut out);
        } else if c.complete && c.idle >= cfg.ttl && spare(c) {
            take(c, Reason::Ttl, &mut out);
        }
    }
    // Under pressure: abandoned partial blobs first (nobody relies on
    // them), then spare complete ones, many holders first, then LRU.
    let mut partial: Vec<&&Candidate> = free.iter().filter(|c| !c.complete).collect();
    partial.sort_by_key(|c| std::cmp::Reverse(c.idle));
    let mut complete: Vec<&&Candidate> = free.iter().filter(|c| c.complete && spare(c)).collect();
    complete.sort_by_key(|c| {
        (
            std::cmp::Reverse(c.holders.map_or(0, |h| h.complete)),
            std::cmp::Reverse(c.idle),
        )
    });
    let mut last: Vec<&&Candidate> = free.iter().filter(|c| c.complete && !spare(c)).collect();
    last.sort_by_key(|c| std::cmp::Reverse(c.idle));
    let mut rounds: Vec<(Vec<&&Candidate>, Reason)> =
        vec![(partial, Reason::Partial), (complete, Reason::Pressure)];
    if p.critical {
        rounds.push((last, Reason::Critical));
    }
    for (list, reason) in rounds {
        for c in list {
            if freed_enough(&out, p.need) {
                return out;
            }
            take(c, reason, &mut out);
        }
    }
    out
}

fn freed_enough(out: &[Eviction], need: u64) -> bool {
    out.iter().map(|e| e.bytes).sum::<u64>() >= need
}

/// The collector's live state, kept by the store: settings, what the
/// tracker said of holders, the images the operator pinned, metrics.
#[derive(Debug, Default)]
pub struct GcState {
    config: RwLock<GcConfig>,
    cluster_aware: AtomicBool,
    holders: Mutex<HashMap<BlobDigest, Holders>>,
    pinned: Mutex<PinnedImages>,
    metrics: RwLock<GcMetrics>,
}

/// Images pinned at run time (`dray pin`): each image reference with the
/// blobs (config and layers) it resolved to, kept in a file of the state
/// directory so that they outlive a restart.
#[derive(Debug, Default)]
struct PinnedImages {
    /// None until the store is opened (a store in memory keeps none).
    file: Option<std::path::PathBuf>,
    images: std::collections::BTreeMap<String, Vec<BlobDigest>>,
}

/// An image pinned with `dray pin`, as `dray pin --list` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedImage {
    pub image: String,
    /// `sha256:...` of its config and layers.
    pub blobs: Vec<String>,
}

impl PinnedImages {
    fn list(&self) -> Vec<PinnedImage> {
        self.images
            .iter()
            .map(|(image, blobs)| PinnedImage {
                image: image.clone(),
                blobs: blobs.iter().map(ToString::to_string).collect(),
            })
            .collect()
    }

    /// Writes the pins to a new file, synced, then renamed over the old one:
    /// a crash leaves the old pins or the new, never half of either.
    fn save(&self) -> Result<()> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let text = serde_json::to_vec_pretty(&self.list()).expect("serializable");
        let tmp = path.with_extension("json.new");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            Error::io(
                format!("writing the pinned images to {}", path.display()),
                e,
            )
        })
    }
}

impl GcState {
    pub fn config(&self) -> GcConfig {
        self.config
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes new settings. `cluster_aware`: a tracker is configured.
    pub fn configure(&self, config: GcConfig, cluster_aware: bool) {
        *self.config.write().unwrap_or_else(|p| p.into_inner()) = config;
        self.cluster_aware.store(cluster_aware, Ordering::Relaxed);
    }

    /// Counts into `metrics` from now on (the agent's registered ones).
    pub fn use_metrics(&self, metrics: GcMetrics) {
        *self.metrics.write().unwrap_or_else(|p| p.into_inner()) = metrics;
    }

    fn metrics(&self) -> GcMetrics {
        self.metrics
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, HashMap<BlobDigest, Holders>> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tracker's latest word on the blobs this node holds complete;
    /// blobs it did not mention keep what it said before.
    pub fn note_holders(&self, said: impl IntoIterator<Item = (BlobDigest, Holders)>) {
        self.holders().extend(said);
    }

    fn pinned(&self) -> std::sync::MutexGuard<'_, PinnedImages> {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the images pinned at run time from `file` (none if it does
    /// not exist), and keeps them there from now on.
    pub(crate) fn load_pins(&self, file: std::path::PathBuf) -> Result<()> {
        let images = match std::fs::read(&file) {
            Ok(text) => {
                let list: Vec<PinnedImage> = serde_json::from_slice(&text).map_err(|e| {
                    Error::Config(format!("the pinned images in {}: {e}", file.display()))
                })?;
                let mut images = std::collections::BTreeMap::new();
                for p in list {
                    let blobs = p
                        .blobs
                        .iter()
                        .map(|d| d.parse())
                        .collect::<std::result::Result<Vec<BlobDigest>, _>>()
                        .map_err(|e| {
                            Error::Config(format!(
                                "the pinned images in {}: image {}: {e}",
                                file.display(),
                                p.image
                            ))
                        })?;
                    images.insert(p.image, blobs);
                }
                images
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Default::default(),
            Err(e) => {
                return Err(Error::io(
                    format!("reading the pinned images in {}", file.display()),
                    e,
                ));
            }
        };
        *self.pinned() = PinnedImages {
            file: Some(file),
            images,
        };
        Ok(())
    }

    /// Pins `image`'s blobs (replacing what it was pinned to before), durably.
    pub fn pin(&self, image: &str, blobs: Vec<BlobDigest>) -> Result<()> {
        let mut pinned = self.pinned();
        let before = pinned.images.insert(image.to_string(), blobs);
        pinned.save().inspect_err(|_| {
            match before {
                Some(b) => pinned.images.insert(image.to_string(), b),
                None => pinned.images.remove(image),
            };
        })
    }

    /// Unpins `image`, durably; false if it was not pinned.
    pub fn unpin(&self, image: &str) -> Result<bool> {
        let mut pinned = self.pinned();
        let Some(before) = pinned.images.remove(image) else {
            return Ok(false);
        };
        pinned.save().inspect_err(|_| {
            pinned.images.insert(image.to_string(), before);
        })?;
        Ok(true)
    }

    /// The images pinned at run time.
    pub fn pinned_images(&self) -> Vec<PinnedImage> {
        self.pinned().list()
    }

    /// Every blob never evicted: `gc.pinned` and the pinned images' blobs.
    pub fn pins(&self) -> HashSet<BlobDigest> {
        let mut pins = self.config().pins();
        pins.extend(self.pinned().images.values().flatten().copied());
        pins
    }

    pub fn holders_of(&self, digest: &BlobDigest) -> Option<Holders> {
        self.holders().get(digest).copied()
    }

    pub(crate) fn forget(&self, digest: &BlobDigest) {
        self.holders().remove(digest);
    }

    pub(crate) fn count_usage(&self, u: &Usage) {
        let m = self.metrics();
        m.store_bytes.set(u.store_bytes as i64);
        m.store_blobs.set(u.store_blobs as i64);
        m.open_blobs.set(u.open_blobs as i64);
        let cfg = self.config();
        m.use_share.set(use_share(&cfg, u));
        for (level, share) in [
            ("low", cfg.low_watermark),
            ("high", cfg.high_watermark),
            ("critical", cfg.critical_watermark),
        ] {
            m.watermarks.get_or_create(&LevelLabel { level }).set(share);
        }
        m.budget_bytes.set(
            cfg.budget
                .map_or(0, |b| i64::try_from(b).unwrap_or(i64::MAX)),
        );
        m.filesystem_bytes
            .set(i64::try_from(u.fs_bytes).unwrap_or(i64::MAX));
        m.filesystem_free_bytes
            .set(i64::try_from(u.fs_free).unwrap_or(i64::MAX));
    }

    fn count_eviction(&self, e: &Eviction) {
        let m = self.metrics();
        m.evictions
            .get_or_create(&ReasonLabel { reason: e.reason })
            .inc();
        m.evicted_bytes.inc_by(e.bytes);
    }

    pub(crate) fn count_refusal(&self) {
        self.metrics().refusals.inc();
    }
}

/// Size and free bytes of the filesystem holding `dir`.
pub fn filesystem(dir: &Path) -> Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::Config(format!("{} has a NUL byte", dir.display())))?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a zeroed struct the call fills.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(Error::io(
            format!("reading the size of the filesystem of {}", dir.display()),
            std::io::Error::last_os_error(),
        ));
    }
    let block = st.f_frsize as u64;
    Ok((st.f_blocks as u64 * block, st.f_bavail as u64 * block))
}

/// What a collection did (or, dry, would do).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Collection {
    pub usage: Usage,
    pub need: u64,
    pub critical: bool,
    pub evicted: Vec<Eviction>,
}

/// One pass of the collector: closes the idle blobs past
/// `max_open_idle_blobs` and evicts what [`plan`] chooses (neither when
/// `dry`). Blocking.
pub fn collect(store: &ChunkStore, dry: bool) -> Result<Collection> {
    if !dry {
        store.close_idle();
    }
    let cfg = store.gc().config();
    let usage = store.usage()?;
    let p = pressure(&cfg, &usage);
    let cands = store.candidates(&store.gc().pins());
    let chosen = plan(
        &cands,
        p,
        &cfg,
        store.gc().cluster_aware.load(Ordering::Relaxed),
    );
    let mut done = Collection {
        usage,
        need: p.need,
        critical: p.critical,
        evicted: Vec::new(),
    };
    for e in chosen {
        if dry {
            done.evicted.push(e);
            continue;
        }
        let digest: BlobDigest = e.digest.parse().expect("planned from a digest");
        let holders = store.gc().holders_of(&digest);
        // None: it came into use since it was planned; it stays.
        if store.evict(&digest)?.is_some() {
            store.gc().count_eviction(&e);
            if e.reason == Reason::Critical {
                tracing::warn!(%digest, bytes = e.bytes, ?holders, "disk past the critical watermark: evicting a blob the cluster has too few copies of");
            } else {
                tracing::info!(%digest, bytes = e.bytes, reason = e.reason.as_str(), "evicted");
            }
            done.evicted.push(e);
        }
    }
    if !dry {
        store.gc().count_usage(&store.usage()?);
    }
    Ok(done)
}

/// Plans made by [`make_room`] for one blob at most: each round evicts what
/// did not come into use since it was planned.
const MAKE_ROOM_ROUNDS: usize = 3;

/// Makes room for a new blob of `size` bytes before its file is reserved:
/// evicts what must go, or refuses with the limit it would break. (A blob
/// larger than the whole budget was refused by `ChunkStore::check_size`.)
pub fn make_room(store: &ChunkStore, digest: &BlobDigest, size: u64) -> Result<()> {
    let cfg = store.gc().config();
    let room = |u: &Usage| -> (u64, Option<String>) {
        let mut need = 0;
        let mut limit = None;
        if let Some(budget) = cfg.budget
            && u.store_bytes + size > budget
        {
            need = u.store_bytes + size - budget;
            limit = Some(format!(
                "the store holds {} of its gc.budget of {budget} bytes",
                u.store_bytes
            ));
        }
        let ceiling = share(u.fs_bytes, cfg.critical_watermark);
        let fs_used = u.fs_bytes.saturating_sub(u.fs_free);
        if u.fs_bytes > 0 && fs_used + size > ceiling {
            need = need.max(fs_used + size - ceiling);
            limit = Some(format!(
                "its filesystem has {fs_used} of {} bytes in use and gc.critical_watermark is {}",
                u.fs_bytes, cfg.critical_watermark
            ));
        }
        (need, limit)
    };
    // Planned on what the store holds now; a blob that came into use (or
    // went) since is skipped, so the plan is made again while evictions
    // still free something.
    for _ in 0..MAKE_ROOM_ROUNDS {
        let usage = store.usage()?;
        store.gc().count_usage(&usage);
        let (need, _) = room(&usage);
        // Past the high watermark with the new blob: down to the low one
        // now, as the collector would at its next pass (pulls fill a store
        // faster than one gc.period), but refused only past the budget or
        // critical.
        let with_blob = Usage {
            store_bytes: usage.store_bytes + size,
            fs_free: usage.fs_free.saturating_sub(size),
            ..usage
        };
        let after = pressure(&cfg, &with_blob);
        let need = need.max(after.need);
        if need == 0 {
            return Ok(());
        }
        let cands = store.candidates(&store.gc().pins());
        // A blob that would take the disk past the critical watermark may
        // cost the cluster's last copies, as the collector's pass would: the
        // alternative is a refused pull (and the registry again) for sure.
        let p = Pressure {
            need,
            critical: after.critical,
        };
        let mut freed = false;
        for e in plan(
            &cands,
            p,
            &cfg,
            store.gc().cluster_aware.load(Ordering::Relaxed),
        ) {
            let d: BlobDigest = e.digest.parse().expect("planned from a digest");
            if store.evict(&d)?.is_some() {
                freed = true;
                if e.reason == Reason::Critical {
                    tracing::warn!(digest = %d, bytes = e.bytes, "a new blob would take the disk past the critical watermark: evicting a blob the cluster has too few copies of");
                } else {
                    tracing::info!(digest = %d, bytes = e.bytes, reason = e.reason.as_str(), "evicted to make room");
                }
                store.gc().count_eviction(&e);
            }
        }
        if !freed {
            break;
        }
    }
    let usage = store.usage()?;
    store.gc().count_usage(&usage);
    match room(&usage) {
        (0, _) => Ok(()),
        (_, limit) => {
            store.gc().count_refusal();
            let cands = store.candidates(&store.gc().pins());
            let held = |f: fn(&Candidate) -> bool| -> u64 {
                cands.iter().filter(|c| f(c)).map(|c| c.bytes).sum()
            };
            Err(Error::NoRoom {
                digest: *digest,
                size,
                detail: format!(
                    "{}, and what is left is in use ({} bytes: reads, pulls, uploads), pinned ({} bytes) or among the cluster's last copies",
                    limit.unwrap_or_default(),
                    held(|c| c.in_use),
                    held(|c| c.pinned && !c.in_use),
                ),
            })
        }
    }
}

/// Runs [`collect`] every `gc.period` until the task is dropped.
pub fn spawn(store: Arc<ChunkStore>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(store.gc().config().period).await;
            let s = store.clone();
            match tokio::task::spawn_blocking(move || collect(&s, false)).await {
                Ok(Ok(c)) if !c.evicted.is_empty() => {
                    tracing::info!(
                        evicted = c.evicted.len(),
                        bytes = c.evicted.iter().map(|e| e.bytes).sum::<u64>(),
                        store_bytes = c.usage.store_bytes,
                        "garbage collected"
                    );
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "garbage collection failed"),
                Err(e) => tracing::error!(error = %e, "garbage collection task"),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_watermarks_share_less_what_others_keep_on_the_filesystem() {
        // 100 bytes of filesystem, 30 used, 10 of them the store's: others
        // keep 20, so the store may hold 95 - 20 = 75 before it refuses.
        let u = Usage {
            store_bytes: 10,
            store_blobs: 1,
            open_blobs: 0,
            fs_bytes: 100,
            fs_free: 70,
        };
        let cfg = GcConfig::default();
        assert_eq!(capacity(&cfg, &u), 75);
        // A budget of 50 is kept below 40 by the collector.
        let budgeted = GcConfig {
            budget: Some(50),
            ..cfg.clone()
        };
        assert_eq!(capacity(&budgeted, &u), 40);
        // Others past the critical watermark leave the store nothing.
        let full = Usage {
            store_bytes: 0,
            fs_free: 3,
            ..u
        };
        assert_eq!(capacity(&cfg, &full), 0);
    }

    fn cand(n: u8, bytes: u64, complete: bool, idle_s: u64) -> Candidate {
        Candidate {
            digest: BlobDigest::of(&[n]),
            bytes,
            complete,
            idle: Duration::from_secs(idle_s),
            in_use: false,
            pinned: false,
            holders: None,
        }
    }

    fn names(out: &[Eviction], cands: &[Candidate]) -> Vec<(usize, Reason)> {
        out.iter()
            .map(|e| {
                let i = cands
                    .iter()
                    .position(|c| c.digest.to_string() == e.digest)
                    .unwrap();
                (i, e.reason)
            })
            .collect()
    }

    #[test]
    fn pressure_is_measured_against_the_budget_and_the_filesystem() {
        let cfg = GcConfig {
            budget: Some(1000),
            ..GcConfig::default()
        };
        let u = |store: u64, used: u64| Usage {
            store_bytes: store,
            store_blobs: 1,
            open_blobs: 0,
            fs_bytes: 10_000,
            fs_free: 10_000 - used,
        };
        assert_eq!(pressure(&cfg, &u(800, 5000)), Pressure::default());
        assert_eq!(pressure(&cfg, &u(900, 5000)).need, 300);
        assert_eq!(pressure(&cfg, &u(100, 8500)).need, 2500);
        assert!(pressure(&cfg, &u(960, 5000)).critical);
        assert!(pressure(&cfg, &u(100, 9600)).critical);
    }

    #[test]
    fn idle_blobs_go_first_then_partial_then_the_least_recently_used() {
        let cfg = GcConfig {
            ttl: Duration::from_secs(100),
            partial_ttl: Duration::from_secs(50),
            ..GcConfig::default()
        };
        let cands = vec![
            cand(0, 10, true, 10),
            cand(1, 10, true, 200),
            cand(2, 10, false, 60),
            cand(3, 10, true, 30),
            cand(4, 10, false, 5),
        ];
        let none = plan(&cands, Pressure::default(), &cfg, false);
        assert_eq!(
            names(&none, &cands),
            vec![(1, Reason::Ttl), (2, Reason::Partial)]
        );
        let p = Pressure {
            need: 35,
            critical: false,
        };
        assert_eq!(
            names(&plan(&cands, p, &cfg, false), &cands),
            vec![
                (1, Reason::Ttl),
                (2, Reason::Partial),
                (4, Reason::Partial),
                (3, Reason::Pressure)
            ]
        );
    }

    #[test]
    fn blobs_in_use_or_pinned_are_never_chosen() {
        let cfg = GcConfig::default();
        let mut cands = vec![cand(0, 10, true, 1 << 30), cand(1, 10, false, 1 << 30)];
        cands[0].in_use = true;
        cands[1].pinned = true;
        let p = Pressure {
            need: 100,
            critical: true,
        };
        assert!(plan(&cands, p, &cfg, false).is_empty());
    }

    #[test]
    fn the_first_keep_cluster_copies_holders_keep_a_blob_until_critical() {
        let cfg = GcConfig {
            keep_cluster_copies: 2,
            ..GcConfig::default()
        };
        let mut cands = vec![
            cand(0, 10, true, 5),
            cand(1, 10, true, 5),
            cand(2, 10, true, 9),
            cand(3, 10, true, 9),
        ];
        cands[0].holders = Some(Holders {
            complete: 5,
            rank: 3,
        });
        cands[1].holders = Some(Holders {
            complete: 3,
            rank: 2,
        });
        cands[2].holders = Some(Holders {
            complete: 4,
            rank: 1,
        });
        // Never heard of: kept as if this node had the last copy.
        let mut p = Pressure {
            need: 100,
            critical: false,
        };
        assert_eq!(
            names(&plan(&cands, p, &cfg, true), &cands),
            vec![(0, Reason::Pressure), (1, Reason::Pressure)],
            "many holders first"
        );
        p.critical = true;
        assert_eq!(
            names(&plan(&cands, p, &cfg, true), &cands)[2..],
            [(2, Reason::Critical), (3, Reason::Critical)]
        );
        assert_eq!(
            plan(&cands, p, &cfg, false).len(),
            4,
            "no tracker, no cluster to keep for"
        );
    }

    #[test]
    fn watermarks_out_of_order_are_refused() {
        let cfg = GcConfig {
            low_watermark: 0.9,
            ..GcConfig::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("low_watermark (0.9) <= high_watermark (0.8)"),
            "{e}"
        );
    }
}
