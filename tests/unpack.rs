//! The layer unpacker against containerd 1.6 (its overlayfs snapshotter
//! unpacking the same blobs), against hostile layers, and against broken
//! streams. Needs root (devices, ownership, trusted.* xattrs) and containerd.

mod common;
#[path = "fixtures/hostile.rs"]
mod hostile;

use common::oci_image::{self, Containerd, LayerBlob, chain_ids, write_oci_archive};
use dray_agent::unpack::{
    Compression, MAX_HEADER_BODY, UnpackError, UnpackLimits, memory_cap,
    unpack_gzip_parallel_within, unpack_layer, unpack_layer_within,
};
use dray_testkit::layer_content::{Mix, write_layer_tar};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn check(r: libc::c_int, what: &str) {
    assert!(r == 0, "{what}: {}", std::io::Error::last_os_error());
}

fn set_xattr(p: &Path, key: &str, value: &[u8]) {
    let k = CString::new(key).unwrap();
    // SAFETY: valid C strings and buffer.
    let r = unsafe {
        libc::lsetxattr(
            c(p).as_ptr(),
            k.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(r, &format!("setxattr {key} on {}", p.display()));
}

fn mknod(p: &Path, kind: libc::mode_t, major: u32, minor: u32) {
    // SAFETY: a valid C string.
    let r = unsafe { libc::mknod(c(p).as_ptr(), kind | 0o640, libc::makedev(major, minor)) };
    check(r, &format!("mknod {}", p.display()));
}

/// Sets owner, mode and an mtime with nanoseconds, without following symlinks.
fn meta(p: &Path, uid: u32, gid: u32, mode: Option<u32>, sec: i64, nsec: i64) {
    // SAFETY: valid C strings and timespecs.
    unsafe {
        check(libc::lchown(c(p).as_ptr(), uid, gid), "lchown");
        if let Some(m) = mode {
            check(libc::chmod(c(p).as_ptr(), m), "chmod");
        }
        let t = libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        };
        let r = libc::utimensat(
            libc::AT_FDCWD,
            c(p).as_ptr(),
            [t, t].as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        );
        check(r, "utimensat");
    }
}

fn write(p: &Path, data: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// Layer 1: every entry type, ownership, special modes, xattrs, long names.
fn base_layer(r: &Path) {
    for d in ["etc", "bin", "tmp", "data", "opq/sub", "gone-dir/inner"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    write(&r.join("etc/greeting"), b"hello from layer 1\n");
    write(&r.join("bin/su"), b"#!/bin/sh\n");
    write(&r.join("bin/sg"), b"#!/bin/sh\nsg\n");
    write(&r.join("data/owned"), b"owned by 1000\n");
    write(&r.join("data/remove-me"), b"removed in layer 2\n");
    write(&r.join("data/xattrs"), b"has xattrs\n");
    write(&r.join("opq/a"), b"hidden by the opaque dir\n");
    write(&r.join("opq/sub/b"), b"hidden too\n");
    write(&r.join("gone-dir/inner/f"), b"gone\n");
    let big: Vec<u8> = (0..300_000u32).flat_map(|i| i.to_le_bytes()).collect();
    write(&r.join("data/big.bin"), &big);
    let long = "n".repeat(200);
    write(
        &r.join(format!("data/{long}/{}", "f".repeat(200))),
        b"long path\n",
    );
    std::fs::hard_link(r.join("data/owned"), r.join("data/owned-link")).unwrap();
    std::os::unix::fs::symlink("su", r.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("/etc/greeting", r.join("etc/abs-link")).unwrap();
    std::os::unix::fs::symlink(format!("../data/{long}"), r.join("etc/long-link")).unwrap();
    mknod(&r.join("data/fifo"), libc::S_IFIFO, 0, 0);
    mknod(&r.join("data/null"), libc::S_IFCHR, 1, 3);
    mknod(&r.join("data/loop9"), libc::S_IFBLK, 7, 9);
    set_xattr(&r.join("data/xattrs"), "user.comment", b"a user xattr");
    set_xattr(&r.join("data/xattrs"), "trusted.dray", b"\x00\x01binary");
    set_xattr(&r.join("data/xattrs"), "security.dray", b"security-ish");
    set_xattr(&r.join("data"), "user.dir", b"on a directory");
    set_xattr(&r.join("data/fifo"), "trusted.fifo", b"on a fifo");
    meta(
        &r.join("bin/su"),
        0,
        0,
        Some(0o4755),
        1_700_000_001,
        123_456_789,
    );
    meta(&r.join("bin/sg"), 0, 42, Some(0o2755), 1_700_000_002, 5);
    meta(
        &r.join("data/owned"),
        1000,
        1000,
        Some(0o600),
        1_700_000_003,
        0,
    );
    meta(&r.join("bin/sh"), 7, 8, None, 1_600_000_000, 999_999_999);
    meta(&r.join("data/null"), 0, 5, Some(0o666), 1_600_000_001, 1);
    meta(&r.join("tmp"), 0, 0, Some(0o1777), 1_650_000_000, 42);
    meta(&r.join("etc"), 0, 0, Some(0o755), 1_650_000_001, 777);
}

/// Layer 2: whiteouts of a file and a directory, an opaque directory, changes.
fn upper_layer(r: &Path) {
    for d in ["etc", "data", "opq", "new"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    write(&r.join("etc/greeting"), b"hello from layer 2\n");
    write(&r.join("data/.wh.remove-me"), b"");
    write(&r.join(".wh.gone-dir"), b"");
    write(&r.join("opq/.wh..wh..opq"), b"");
    write(&r.join("opq/c"), b"after the opaque marker\n");
    write(&r.join("new/file"), b"new\n");
    std::fs::hard_link(r.join("new/file"), r.join("new/file-link")).unwrap();
    meta(&r.join("data/.wh.remove-me"), 3, 4, None, 1_700_000_000, 0);
    meta(
        &r.join("new"),
        0,
        0,
        Some(0o750),
        1_680_000_000,
        314_159_265,
    );
    meta(&r.join("opq"), 0, 0, Some(0o755), 1_680_000_001, 0);
}

/// A layer's tar, made by GNU tar from a real tree (PAX: nanosecond mtimes,
/// xattrs, long names), sorted for determinism.
fn tar_tree(tree: &Path, out: &Path) {
    let ok = Command::new("tar")
        .args([
            "--format=pax",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--sort=name",
            "--pax-option=delete=atime,delete=ctime",
            "-C",
        ])
        .arg(tree)
        .arg("-cf")
        .arg(out)
        .arg(".")
        .status()
        .unwrap();
    assert!(ok.success(), "tar of {}", tree.display());
}

fn sha256_file(p: &Path) -> String {
    oci_image::sha256_file(p).unwrap()
}

fn gzip_file(src: &Path, dst: &Path) {
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(dst).unwrap(),
        flate2::Compression::default(),
    );
    std::io::copy(&mut std::fs::File::open(src).unwrap(), &mut enc).unwrap();
    enc.finish().unwrap();
}

fn zstd_file(src: &Path, dst: &Path) {
    let mut enc = zstd::Encoder::new(std::fs::File::create(dst).unwrap(), 3).unwrap();
    std::io::copy(&mut std::fs::File::open(src).unwrap(), &mut enc).unwrap();
    enc.finish().unwrap();
}

fn xattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut names = vec![0u8; 64 << 10];
    // SAFETY: valid C string and buffers.
    let n = unsafe { libc::llistxattr(c(p).as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "listxattr {}", p.display());
    names.truncate(n as usize);
    let mut out = BTreeMap::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let key = CString::new(name).unwrap();
        let mut v = vec![0u8; 64 << 10];
        let n =
            unsafe { libc::lgetxattr(c(p).as_ptr(), key.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(n >= 0, "getxattr {}", p.display());
        v.truncate(n as usize);
        out.insert(String::from_utf8_lossy(name).into_owned(), v);
    }
    out
}

/// Everything about one tree entry that overlayfs or a container can see.
fn describe(root: &Path, rel: &Path) -> String {
    let p = root.join(rel);
    let m = std::fs::symlink_metadata(&p).unwrap();
    let ft = m.file_type();
    let whiteout = ft.is_char_device() && m.rdev() == 0;
    let mut d = format!(
        "mode {:o} uid {} gid {} nlink {}",
        m.mode(),
        m.uid(),
        m.gid(),
        m.nlink()
    );
    // A whiteout's mtime is when it was made; the root's is the snapshot's.
    if !whiteout && !rel.as_os_str().is_empty() {
        d += &format!(" mtime {}.{:09}", m.mtime(), m.mtime_nsec());
    }
    if ft.is_file() {
        d += &format!(" content {}", sha256_file(&p));
    } else if ft.is_symlink() {
        d += &format!(" -> {:?}", std::fs::read_link(&p).unwrap());
    } else if ft.is_char_device() || ft.is_block_device() {
        d += &format!(" rdev {}", m.rdev());
    }
    for (k, v) in xattrs(&p) {
        d += &format!(" xattr {k}={}", String::from_utf8_lossy(&v));
    }
    d
}

fn walk(root: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, String>) {
    out.insert(rel.to_path_buf(), describe(root, rel));
    let p = root.join(rel);
    if std::fs::symlink_metadata(&p).unwrap().is_dir() {
        for e in std::fs::read_dir(&p).unwrap() {
            walk(root, &rel.join(e.unwrap().file_name()), out);
        }
    }
}

/// Compares two trees entry by entry: paths, types and modes, owners, link
/// counts, mtimes (ns), contents, link targets, device numbers and xattrs of
/// every namespace. Returns the first differences, empty if none.
fn tree_differences(expected: &Path, actual: &Path) -> Vec<String> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    walk(expected, Path::new(""), &mut a);
    walk(actual, Path::new(""), &mut b);
    let mut diffs = Vec::new();
    for (path, want) in &a {
        match b.get(path) {
            None => diffs.push(format!("{path:?}: missing ({want})")),
            Some(got) if got != want => {
                diffs.push(format!("{path:?}:\n  expected {want}\n  got      {got}"))
            }
            _ => {}
        }
    }
    for path in b.keys().filter(|p| !a.contains_key(*p)) {
        diffs.push(format!("{path:?}: not expected ({})", b[path]));
    }
    diffs.truncate(20);
    diffs
}

#[test]
fn unpacked_layers_equal_containerds_overlayfs_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let trees = [w.join("tree1"), w.join("tree2")];
    base_layer(&trees[0]);
    upper_layer(&trees[1]);
    // One gzip layer and one zstd layer, so both decoders meet containerd.
    let mut blobs = Vec::new();
    for (i, tree) in trees.iter().enumerate() {
        let tar = w.join(format!("layer{i}.tar"));
        tar_tree(tree, &tar);
        let diff_id = sha256_file(&tar);
        let (path, media_type, compression) = if i == 0 {
            let p = w.join("layer0.tar.gz");
            gzip_file(&tar, &p);
            (
                p,
                "application/vnd.oci.image.layer.v1.tar+gzip",
                Compression::Gzip,
            )
        } else {
            let p = w.join("layer1.tar.zst");
            zstd_file(&tar, &p);
            (
                p,
                "application/vnd.oci.image.layer.v1.tar+zstd",
                Compression::Zstd,
            )
        };
        assert_eq!(
            Compression::from_media_type(media_type).unwrap(),
            compression
        );
        blobs.push((
            LayerBlob {
                path,
                media_type,
                diff_id,
            },
            compression,
        ));
    }
    let archive = w.join("image.tar");
    let layers: Vec<LayerBlob> = blobs
        .iter()
        .map(|(l, _)| LayerBlob {
            path: l.path.clone(),
            media_type: l.media_type,
            diff_id: l.diff_id.clone(),
        })
        .collect();
    write_oci_archive(&layers, "dray.test/unpack:1", &archive).unwrap();
    std::fs::create_dir(w.join("containerd")).unwrap();
    let ctrd = Containerd::start(&w.join("containerd")).unwrap();
    ctrd.ctr_ok(&["images", "import", archive.to_str().unwrap()])
        .unwrap();
    let chains = chain_ids(&layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>());
    for (i, ((layer, compression), chain)) in blobs.iter().zip(&chains).enumerate() {
        let reference = ctrd.snapshot_dir(chain).unwrap();
        let ours = w.join(format!("dray-{i}"));
        let u = unpack_layer(
            std::fs::File::open(&layer.path).unwrap(),
            *compression,
            &ours,
            Some(&layer.diff_id),
        )
        .unwrap();
        assert_eq!(u.diff_id, layer.diff_id);
        assert_eq!(
            u.compressed_bytes,
            std::fs::metadata(&layer.path).unwrap().len()
        );
        let diffs = tree_differences(&reference, &ours);
        assert!(
            diffs.is_empty(),
            "layer {i} differs from containerd's {}:\n{}",
            reference.display(),
            diffs.join("\n")
        );
    }
    // The comparison sees what matters: the opaque marker and a whiteout.
    let top = w.join("dray-1");
    assert_eq!(xattrs(&top.join("opq"))["trusted.overlay.opaque"], b"y");
    let gone = std::fs::symlink_metadata(top.join("gone-dir")).unwrap();
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    let su = std::fs::symlink_metadata(w.join("dray-0/bin/su")).unwrap();
    assert_eq!(su.mode() & 0o7777, 0o4755);
}

// ---- hostile layers ----

/// Appends an entry with raw name and link fields, which `tar::Builder`'s
/// checked setters would refuse (`..`, absolute paths).
fn raw_entry(
    b: &mut tar::Builder<Vec<u8>>,
    name: &str,
    kind: tar::EntryType,
    link: &str,
    data: &[u8],
) {
    let mut h = tar::Header::new_gnu();
    {
        let g = h.as_gnu_mut().unwrap();
        g.name[..name.len()].copy_from_slice(name.as_bytes());
        g.linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    b.append(&h, data).unwrap();
}

use tar::EntryType::{Directory, Link, Regular, Symlink};

/// A sandbox: `target` to unpack into, and a sentinel sibling that no layer
/// may touch.
struct Sandbox {
    _dir: tempfile::TempDir,
    target: PathBuf,
    sentinel: PathBuf,
}

impl Sandbox {
    fn new() -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let sentinel = dir.path().join("sentinel");
        std::fs::create_dir(&sentinel).unwrap();
        std::fs::write(sentinel.join("file"), b"untouched").unwrap();
        Sandbox {
            target: dir.path().join("target"),
            sentinel,
            _dir: dir,
        }
    }

    fn outside(&self) -> BTreeMap<PathBuf, String> {
        let mut m = BTreeMap::new();
        walk(self._dir.path(), Path::new(""), &mut m);
        m.retain(|p, _| !p.starts_with("target") && !p.as_os_str().is_empty());
        m
    }
}

/// Unpacks a hostile tar: it must fail naming `entry`, remove the target, and
/// leave everything beside the target as it was.
fn assert_refused(build: impl FnOnce(&mut tar::Builder<Vec<u8>>, &Path), entry: &str) {
    let sb = Sandbox::new();
    let before = sb.outside();
    let mut b = tar::Builder::new(Vec::new());
    build(&mut b, &sb.sentinel);
    let tar = b.into_inner().unwrap();
    let err = unpack_layer(&tar[..], Compression::None, &sb.target, None)
        .expect_err("a hostile layer must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("{entry:?}")),
        "the error names the entry {entry:?}: {msg}"
    );
    assert!(!sb.target.exists(), "target removed after: {msg}");
    assert_eq!(sb.outside(), before, "nothing outside changed: {msg}");
}

#[test]
fn dot_dot_paths_are_refused() {
    assert_refused(
        |b, _| raw_entry(b, "../sentinel/evil", Regular, "", b"x"),
        "../sentinel/evil",
    );
    assert_refused(
        |b, _| raw_entry(b, "a/../../sentinel/evil", Regular, "", b"x"),
        "a/../../sentinel/evil",
    );
}

#[test]
fn writes_through_symlinks_leading_out_are_refused() {
    // Absolute target: `a -> <sentinel>`, then `a/evil`.
    assert_refused(
        |b, s| {
            raw_entry(b, "a", Symlink, s.to_str().unwrap(), b"");
            raw_entry(b, "a/evil", Regular, "", b"x");
        },
        "a/evil",
    );
    // Relative target climbing out.
    assert_refused(
        |b, _| {
            raw_entry(b, "d/", Directory, "", b"");
            raw_entry(b, "d/a", Symlink, "../../sentinel", b"");
            raw_entry(b, "d/a/evil", Regular, "", b"x");
        },
        "d/a/evil",
    );
    // A chain: a -> b -> c -> <sentinel>.
    assert_refused(
        |b, s| {
            raw_entry(b, "c", Symlink, s.to_str().unwrap(), b"");
            raw_entry(b, "b", Symlink, "c", b"");
            raw_entry(b, "a", Symlink, "b", b"");
            raw_entry(b, "a/file", Regular, "", b"overwritten");
        },
        "a/file",
    );
    // A loop.
    assert_refused(
        |b, _| {
            raw_entry(b, "x", Symlink, "y", b"");
            raw_entry(b, "y", Symlink, "x", b"");
            raw_entry(b, "x/f", Regular, "", b"x");
        },
        "x/f",
    );
}

#[test]
fn hardlinks_leading_out_are_refused() {
    assert_refused(|b, _| raw_entry(b, "h", Link, "../sentinel/file", b""), "h");
    assert_refused(
        |b, s| {
            raw_entry(b, "l", Symlink, s.to_str().unwrap(), b"");
            raw_entry(b, "h", Link, "l/file", b"");
        },
        "h",
    );
    // An absolute target is inside the layer, as containerd reads it: here it
    // does not exist, so the link fails, naming the entry.
    assert_refused(
        |b, s| {
            let abs = format!("{}/file", s.display());
            raw_entry(b, "h", Link, &abs, b"");
        },
        "h",
    );
}

#[test]
fn bad_whiteouts_are_refused() {
    assert_refused(|b, _| raw_entry(b, "d/.wh.", Regular, "", b""), "d/.wh.");
    assert_refused(
        |b, _| raw_entry(b, "../sentinel/.wh.file", Regular, "", b""),
        "../sentinel/.wh.file",
    );
}

#[test]
fn absolute_paths_land_inside_the_target_and_symlinks_are_replaced_not_followed() {
    let sb = Sandbox::new();
    let before = sb.outside();
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, "/abs/file", Regular, "", b"inside");
    raw_entry(
        &mut b,
        "a",
        Symlink,
        sb.sentinel.join("file").to_str().unwrap(),
        b"",
    );
    raw_entry(&mut b, "a", Regular, "", b"replaced the symlink");
    raw_entry(&mut b, "in/", Directory, "", b"");
    raw_entry(&mut b, "rel", Symlink, "in", b"");
    raw_entry(
        &mut b,
        "rel/through",
        Regular,
        "",
        b"via a relative symlink",
    );
    let tar = b.into_inner().unwrap();
    unpack_layer(&tar[..], Compression::None, &sb.target, None).unwrap();
    assert_eq!(
        std::fs::read(sb.target.join("abs/file")).unwrap(),
        b"inside"
    );
    assert!(
        std::fs::symlink_metadata(sb.target.join("a"))
            .unwrap()
            .is_file()
    );
    assert_eq!(
        std::fs::read(sb.target.join("in/through")).unwrap(),
        b"via a relative symlink"
    );
    assert_eq!(sb.outside(), before);
}

// ---- broken streams ----

/// A tar with a few files, the second one large enough to be cut mid-entry.
fn sample_tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, "small", Regular, "", b"small file");
    // Incompressible, so that a cut or a flipped byte lands inside it.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let big: Vec<u8> = (0..2_000_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    raw_entry(&mut b, "big", Regular, "", &big);
    raw_entry(&mut b, "last", Regular, "", b"last");
    b.into_inner().unwrap()
}

fn compress(tar: &[u8], c: Compression) -> Vec<u8> {
    match c {
        Compression::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(tar).unwrap();
            e.finish().unwrap()
        }
        Compression::Zstd => zstd::encode_all(tar, 3).unwrap(),
        Compression::None => tar.to_vec(),
    }
}

fn unpack_fails(blob: &[u8], c: Compression, diff_id: Option<&str>) -> UnpackError {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t");
    let err = unpack_layer(blob, c, &target, diff_id).expect_err("must fail");
    assert!(!target.exists(), "target removed after: {err}");
    err
}

#[test]
fn truncated_streams_fail_and_remove_the_target() {
    let tar = sample_tar();
    for c in [Compression::Gzip, Compression::Zstd] {
        let blob = compress(&tar, c);
        let cut = &blob[..blob.len() / 2];
        let err = unpack_fails(cut, c, None);
        let msg = err.to_string();
        assert!(
            matches!(err, UnpackError::Stream { .. }) && msg.contains("in entry \"big\""),
            "{c:?}: {msg}"
        );
        // Cut just before the end: every entry is whole, the trailer is not.
        let err = unpack_fails(&blob[..blob.len() - 4], c, None);
        assert!(matches!(err, UnpackError::Stream { .. }), "{c:?}: {err}");
    }
}

#[test]
fn corrupt_streams_fail_and_remove_the_target() {
    let tar = sample_tar();
    let diff_id = sha256_bytes(&tar);
    for c in [Compression::Gzip, Compression::Zstd] {
        let mut blob = compress(&tar, c);
        let mid = blob.len() / 3;
        for b in &mut blob[mid..mid + 64] {
            *b ^= 0x5a;
        }
        // gzip's CRC catches it; a zstd frame without a checksum (the
        // default) may decode to other bytes, which the diffID catches.
        let err = unpack_fails(&blob, c, Some(&diff_id));
        assert!(
            matches!(
                (c, &err),
                (_, UnpackError::Stream { .. })
                    | (Compression::Zstd, UnpackError::DiffIdMismatch { .. })
            ),
            "{c:?}: {err}"
        );
    }
    let err = unpack_fails(b"this is not gzip at all", Compression::Gzip, None);
    assert!(err.to_string().contains("gzip"), "{err}");
}

#[test]
fn a_diff_id_mismatch_fails_and_removes_the_target() {
    let tar = sample_tar();
    let blob = compress(&tar, Compression::Gzip);
    let wrong = format!("sha256:{}", "0".repeat(64));
    let err = unpack_fails(&blob, Compression::Gzip, Some(&wrong));
    let right = sha256_bytes(&tar);
    assert_eq!(
        err.to_string(),
        format!("diffID mismatch: expected {wrong}, got {right}")
    );
    // And the right one passes, hashing the whole stream (trailer included).
    let dir = tempfile::tempdir().unwrap();
    let u = unpack_layer(
        &blob[..],
        Compression::Gzip,
        &dir.path().join("t"),
        Some(&right),
    )
    .unwrap();
    assert_eq!(u.uncompressed_bytes, tar.len() as u64);
    assert_eq!(u.compressed_bytes, blob.len() as u64);
    assert_eq!(u.entries, 3);
}

#[test]
fn a_non_empty_target_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("existing"), b"keep").unwrap();
    let err = unpack_layer(&sample_tar()[..], Compression::None, dir.path(), None).unwrap_err();
    assert!(matches!(err, UnpackError::TargetNotEmpty(_)), "{err}");
    assert!(dir.path().join("existing").exists());
}

fn sha256_bytes(b: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(b)))
}

// ---- the hostile-tar corpus, against the library with limits a test can reach ----

/// Counts the bytes the unpacker pulled from a stream.
struct Metered<R> {
    inner: R,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: std::io::Read> std::io::Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

/// Unpacks `blob` within `limits`, expecting a refusal: the error and how
/// many bytes of `blob` were read. The target must be gone.
fn refused(blob: impl std::io::Read, c: Compression, limits: &UnpackLimits) -> (UnpackError, u64) {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t");
    let read = std::rc::Rc::new(std::cell::Cell::new(0));
    let metered = Metered {
        inner: blob,
        read: read.clone(),
    };
    let err = unpack_layer_within(metered, c, &target, None, limits).expect_err("must be refused");
    assert!(!target.exists(), "target left after: {err}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "something written beside the target"
    );
    (err, read.get())
}

#[test]
fn headers_the_tar_crate_reads_whole_are_refused_past_a_mebibyte_before_their_body() {
    for (kind, what) in [
        (b'L', "GNU long name"),
        (b'K', "GNU long link target"),
        (b'x', "PAX extended header"),
        (b'g', "PAX global header"),
    ] {
        // 2 GiB of body, never produced whole: refused at its header.
        let bomb = hostile::special_header_bomb(kind, 2 << 30);
        let (err, read) = refused(bomb, Compression::None, &UnpackLimits::default());
        let msg = err.to_string();
        assert!(matches!(err, UnpackError::Limit { .. }), "{msg}");
        assert!(
            msg.contains(&format!(
                "its {what} is 2147483648 bytes, over the {MAX_HEADER_BODY}-byte cap"
            )),
            "{msg}"
        );
        assert!(read < 2 << 20, "{what}: read {read} bytes before refusing");
    }
    // At the cap, a long name is read, then refused as a path.
    let (err, _) = refused(
        hostile::special_header_bomb(b'L', MAX_HEADER_BODY),
        Compression::None,
        &UnpackLimits::default(),
    );
    assert!(
        err.to_string().contains("past max_path_bytes = 4096"),
        "{err}"
    );
}

#[test]
fn a_gzipped_2_gib_long_name_bomb_is_refused_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let blob = dir.path().join("bomb.tar.gz");
    hostile::gzip_to(hostile::special_header_bomb(b'L', 2 << 30), &blob);
    let size = std::fs::metadata(&blob).unwrap().len();
    let before = common::peak_rss("self");
    let file = std::fs::File::open(&blob).unwrap();
    let (err, read) = refused(file, Compression::Gzip, &UnpackLimits::default());
    let after = common::peak_rss("self");
    eprintln!(
        "2 GiB long-name bomb, {size} bytes gzipped: {err}; read {read} bytes; peak RSS {} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );
    assert!(
        err.to_string()
            .contains("GNU long name is 2147483648 bytes"),
        "{err}"
    );
    assert!(after < 512 << 20, "peak RSS {after} bytes");
}

#[test]
fn a_layer_with_more_entries_than_max_entries_is_refused_at_the_first_one_past() {
    let limits = UnpackLimits {
        max_entries: 1000,
        ..Default::default()
    };
    let (err, _) = refused(hostile::many_entries(5000), Compression::None, &limits);
    assert_eq!(
        err.to_string(),
        "layer entry \"./\" refused: the layer has more than max_entries = 1000 entries"
    );
    // At the limit, the layer unpacks.
    let dir = tempfile::tempdir().unwrap();
    let u = unpack_layer_within(
        hostile::many_entries(999),
        Compression::None,
        &dir.path().join("t"),
        None,
        &limits,
    )
    .unwrap();
    assert_eq!(u.entries, 1000);
    assert_eq!(
        std::fs::read(dir.path().join("t/after-the-bomb")).unwrap(),
        b"ok\n"
    );
}

#[test]
fn a_layer_past_max_layer_bytes_is_refused_in_the_entry_that_passes_it() {
    let limits = UnpackLimits {
        max_layer_bytes: 8 << 20,
        ..Default::default()
    };
    let (err, read) = refused(hostile::zeros_file(64 << 20), Compression::None, &limits);
    assert_eq!(
        err.to_string(),
        "layer entry \"zeros\" refused: the layer's uncompressed size passed max_layer_bytes = 8388608 bytes"
    );
    assert!(read < 9 << 20, "read {read}");
}

#[test]
fn a_zstd_layer_expanding_past_max_layer_ratio_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let blob = dir.path().join("zeros.tar.zst");
    hostile::zstd_to(hostile::zeros_file(1 << 30), &blob);
    let compressed = std::fs::metadata(&blob).unwrap().len();
    let file = std::fs::File::open(&blob).unwrap();
    let (err, _) = refused(file, Compression::Zstd, &UnpackLimits::default());
    let msg = err.to_string();
    assert!(
        msg.starts_with("layer entry \"zeros\" refused: the layer expanded ")
            && msg.ends_with("past max_layer_ratio = 2000"),
        "{compressed} bytes compressed: {msg}"
    );
    // The same 1 GiB through gzip stays under the ratio: gzip cannot pass ~1030.
    let gz = dir.path().join("zeros.tar.gz");
    hostile::gzip_to(hostile::zeros_file(1 << 30), &gz);
    let target = dir.path().join("t");
    unpack_layer(
        std::fs::File::open(&gz).unwrap(),
        Compression::Gzip,
        &target,
        None,
    )
    .unwrap();
    assert_eq!(
        std::fs::metadata(target.join("zeros")).unwrap().len(),
        1 << 30
    );
}

#[test]
fn a_path_past_max_path_bytes_is_refused_and_a_deep_one_within_it_unpacks() {
    let (err, _) = refused(
        &hostile::deep_path(2100)[..],
        Compression::None,
        &UnpackLimits::default(),
    );
    let msg = err.to_string();
    assert!(
        matches!(err, UnpackError::Limit { .. })
            && msg.starts_with("layer entry \"d/d/d/")
            && msg.contains("… (4201 bytes)")
            && msg.ends_with("refused: its path is 4201 bytes, past max_path_bytes = 4096"),
        "{msg}"
    );
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t");
    unpack_layer(
        &hostile::deep_path(2000)[..],
        Compression::None,
        &target,
        None,
    )
    .unwrap();
    // Deeper than PATH_MAX from here: open it relative to a nearer directory.
    let mut p = target.clone();
    for _ in 0..1000 {
        p.push("d");
    }
    let near = std::fs::File::open(&p).unwrap();
    use std::os::fd::AsRawFd;
    let rel = CString::new(format!("{}f", "d/".repeat(1000))).unwrap();
    // SAFETY: a valid fd and C string.
    let fd = unsafe { libc::openat(near.as_raw_fd(), rel.as_ptr(), libc::O_RDONLY) };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
}

#[test]
fn gnu_sparse_files_are_written_with_holes() {
    let real = 1 << 30;
    let chunks = hostile::sparse_chunks(real);
    let tar = hostile::sparse_file("var/log/lastlog", real, &chunks);
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t");
    let u = unpack_layer(
        &tar[..],
        Compression::None,
        &target,
        Some(&sha256_bytes(&tar)),
    )
    .unwrap();
    assert_eq!(u.uncompressed_bytes, tar.len() as u64);
    let path = target.join("var/log/lastlog");
    let m = std::fs::metadata(&path).unwrap();
    assert_eq!(m.len(), real);
    // Six 4 KiB chunks hold 24 KiB; a dense file would hold 1 GiB.
    assert!(m.blocks() * 512 <= 1 << 20, "{} blocks", m.blocks());
    let f = std::fs::File::open(&path).unwrap();
    use std::os::unix::fs::FileExt;
    for (off, data) in &chunks {
        let mut got = vec![0u8; data.len()];
        f.read_exact_at(&mut got, *off).unwrap();
        assert_eq!(got, *data, "chunk at {off}");
        // Just past each chunk: a hole, read as zeros.
        let mut hole = [1u8; 16];
        f.read_exact_at(&mut hole, off + data.len() as u64).unwrap();
        assert_eq!(hole, [0; 16], "after the chunk at {off}");
    }
    let mut tail = [1u8; 16];
    f.read_exact_at(&mut tail, real - 16).unwrap();
    assert_eq!(tail, [0; 16]);
}

#[test]
fn a_sparse_map_over_a_mebibyte_or_past_its_stored_bytes_is_refused() {
    // 50,000 chunks: 2,381 extension blocks, 1.2 MB of map.
    let chunks: Vec<(u64, Vec<u8>)> = (0..50_000u64).map(|i| (i * 1024, vec![1; 512])).collect();
    let tar = hostile::sparse_file("many", 50_000 * 1024, &chunks);
    let (err, _) = refused(&tar[..], Compression::None, &UnpackLimits::default());
    assert!(
        err.to_string()
            .ends_with("its GNU sparse map passed the 1048576-byte cap on such headers"),
        "{err}"
    );
    // A map whose chunks overlap.
    let tar = hostile::sparse_file("overlap", 8192, &[(0, vec![1; 1024]), (512, vec![2; 512])]);
    let (err, _) = refused(&tar[..], Compression::None, &UnpackLimits::default());
    assert!(err.to_string().contains("overlapping"), "{err}");
}

// ---- one gzip layer on several cores ----

/// A gzip layer of real-looking content (`layer_content`, about `mib` MiB of
/// tar) compressed by `gzip -6` and by `pigz`: the tar and the two blobs.
fn giant_ish_layer(dir: &Path, mib: u64) -> (PathBuf, [(&'static str, PathBuf); 2]) {
    let tar = dir.join("giant.tar");
    let mix = Mix {
        small_text: 25,
        large_text: 30,
        binary: 20,
    };
    write_layer_tar(&tar, "giant", mib << 20, mix, 38).unwrap();
    let blobs = [("gzip -6", "gzip"), ("pigz", "pigz")].map(|(name, tool)| {
        let out = dir.join(format!("giant.{tool}.gz"));
        let mut cmd = Command::new(tool);
        if tool == "gzip" {
            cmd.arg("-6");
        }
        let ok = cmd
            .arg("-c")
            .arg(&tar)
            .stdout(std::fs::File::create(&out).unwrap())
            .status()
            .unwrap_or_else(|e| panic!("{tool}: {e}"));
        assert!(ok.success(), "{tool}");
        (name, out)
    });
    (tar, blobs)
}

/// Unpacks a gzip blob with the parallel decoder at `threads` threads.
fn unpack_parallel(
    blob: &[u8],
    threads: usize,
    target: &Path,
    diff_id: Option<&str>,
) -> Result<dray_agent::unpack::Unpacked, UnpackError> {
    unpack_gzip_parallel_within(
        blob.to_vec(),
        blob.len() as u64,
        threads,
        target,
        diff_id,
        &UnpackLimits::default(),
    )
}

#[test]
fn a_giant_gzip_layer_unpacked_in_parallel_equals_the_serial_tree() {
    let dir = tempfile::tempdir().unwrap();
    let (tar, blobs) = giant_ish_layer(dir.path(), 96);
    let diff_id = sha256_file(&tar);
    for (name, blob) in blobs {
        let serial = dir.path().join(format!("{name}.serial"));
        let s = unpack_layer(
            std::fs::File::open(&blob).unwrap(),
            Compression::Gzip,
            &serial,
            Some(&diff_id),
        )
        .unwrap();
        let bytes = std::fs::read(&blob).unwrap();
        for threads in [2, 4] {
            let parallel = dir.path().join(format!("{name}.{threads}"));
            let before = common::peak_rss("self");
            let p = unpack_parallel(&bytes, threads, &parallel, Some(&diff_id)).unwrap();
            let after = common::peak_rss("self");
            eprintln!(
                "{name}, {threads} threads: {p:?}; peak RSS {} -> {} MiB, cap {} MiB",
                before >> 20,
                after >> 20,
                memory_cap(threads) >> 20
            );
            // The crate screens each stream and may judge it better decoded
            // on one thread (it caps its workers at the machine's cores, and
            // on 2 loaded cores it often does): either route must give the
            // same tree.
            assert!(
                matches!(
                    p.parallel_gzip_route.as_deref(),
                    Some("MarkerWindow" | "Sequential")
                ),
                "{name}: {:?}",
                p.parallel_gzip_route
            );
            assert_eq!((&p.diff_id, p.entries), (&s.diff_id, s.entries), "{name}");
            assert_eq!(p.uncompressed_bytes, s.uncompressed_bytes, "{name}");
            // The generated tar has no directory entries: its directories
            // are implicit, made when the unpack ran (their mtime is now).
            let diffs: Vec<_> = tree_differences(&serial, &parallel)
                .into_iter()
                .filter(|d| !d.contains("trusted.dray.implicit"))
                .collect();
            assert!(
                diffs.is_empty(),
                "{name}, {threads} threads:\n{}",
                diffs.join("\n")
            );
            std::fs::remove_dir_all(&parallel).unwrap();
        }
    }
}

/// The error `blob` gives on the serial path and on the parallel one, both
/// leaving no target: the same variant, reported at the same entry.
fn fails_alike(blob: &[u8], diff_id: Option<&str>) -> (UnpackError, UnpackError) {
    let serial = unpack_fails(blob, Compression::Gzip, diff_id);
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t");
    let parallel = unpack_parallel(blob, 4, &target, diff_id).expect_err("must fail");
    assert!(!target.exists(), "target left after: {parallel}");
    let position = |e: &UnpackError| match e {
        UnpackError::Stream { position, .. } => format!("stream error {position}"),
        other => format!("{other}"),
    };
    assert_eq!(
        position(&parallel),
        position(&serial),
        "serial: {serial}\nparallel: {parallel}"
    );
    (serial, parallel)
}

/// One way to break a compressed layer, in place.
type Breakage = dyn Fn(&mut Vec<u8>);

#[test]
fn broken_giant_gzip_layers_fail_in_parallel_as_on_the_serial_path() {
    let dir = tempfile::tempdir().unwrap();
    let (tar, [(_, blob), _]) = giant_ish_layer(dir.path(), 64);
    let diff_id = sha256_file(&tar);
    let good = std::fs::read(&blob).unwrap();
    let n = good.len();
    let cases: [(&str, Box<Breakage>); 5] = [
        (
            "truncated mid-stream",
            Box::new(|b| b.truncate(b.len() / 2)),
        ),
        (
            "truncated in the trailer",
            Box::new(|b| b.truncate(b.len() - 4)),
        ),
        (
            "64 bytes flipped two thirds in",
            Box::new(|b| {
                let at = b.len() * 2 / 3;
                b[at..at + 64].iter_mut().for_each(|x| *x ^= 0x5a);
            }),
        ),
        ("a wrong CRC32", Box::new(move |b| b[n - 8] ^= 1)),
        ("a wrong ISIZE", Box::new(move |b| b[n - 4] ^= 1)),
    ];
    for (what, break_it) in cases {
        let mut blob = good.clone();
        break_it(&mut blob);
        let (serial, parallel) = fails_alike(&blob, Some(&diff_id));
        eprintln!("{what}:\n  serial:   {serial}\n  parallel: {parallel}");
        assert!(
            matches!(parallel, UnpackError::Stream { .. }),
            "{what}: {parallel}"
        );
    }
    // Not gzip at all; and a whole stream whose tar is not the one named.
    fails_alike(b"this is not gzip at all", None);
    let wrong = format!("sha256:{}", "0".repeat(64));
    let (_, parallel) = fails_alike(&good, Some(&wrong));
    assert!(
        matches!(parallel, UnpackError::DiffIdMismatch { .. }),
        "{parallel}"
    );
}
