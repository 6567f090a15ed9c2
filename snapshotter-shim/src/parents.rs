//! Parent directories a layer leaves out. A layer tar that adds `tmp/x`
//! with no entry for `tmp` gets `tmp` made 0755 and root-owned by the
//! agent's unpacker, which cannot see the layers below; in the overlay that
//! upper directory would hide the lower `/tmp` (1777), and a non-root
//! container could no longer write there. containerd's applier gives such a
//! directory the owner, mode and xattrs of the same path in the layers below
//! (`mkparent`). The unpacker marks each directory it made that way with
//! [`IMPLICIT_XATTR`]; here, when the layer is committed (the one moment its
//! parents are all known and final, in whatever order the layers were
//! unpacked), each marked directory takes the attributes of the nearest
//! lower layer that has the same path, and loses the mark.
//!
//! The lookup in a lower layer never follows a symlink: a lower layer is
//! a tenant's tar, and its `usr -> /` would otherwise lead the lookup of
//! `usr/x` onto the host and copy a host directory's owner, mode and xattrs
//! into the layer. Each component is looked at with `lstat`; a lower layer
//! whose component is anything but a directory (a symlink, a file, a
//! whiteout) hides that path in the layers below it, as in the overlay, and
//! the marked directory keeps the 0755 root-owned default.

use crate::error::SnapshotError;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The mark the agent's unpacker (`agent/src/unpack`) leaves on directories
/// it created because the layer named something inside them.
pub const IMPLICIT_XATTR: &std::ffi::CStr = c"trusted.dray.implicit";

/// Gives every marked directory under `layer` the owner, mode and xattrs of
/// the same path in `lowers` (nearest first), as containerd does; one left
/// 0755 root-owned where no lower layer has a directory there.
pub fn inherit_implicit_parents(layer: &Path, lowers: &[PathBuf]) -> Result<(), SnapshotError> {
    // Only directories are visited; the caller's usage walk stats every file.
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = layer.join(&rel);
        if take_mark(&dir).map_err(SnapshotError::io("reading the xattrs of", &dir))?
            && let Some(lower) = lower_entry(lowers, &rel)
        {
            copy_dir_attributes(&lower, &dir)
                .map_err(SnapshotError::io("copying the attributes of", &lower))?;
        }
        for entry in std::fs::read_dir(&dir).map_err(SnapshotError::io("listing", &dir))? {
            let entry = entry.map_err(SnapshotError::io("listing", &dir))?;
            if entry
                .file_type()
                .map_err(SnapshotError::io("listing", &dir))?
                .is_dir()
            {
                stack.push(rel.join(entry.file_name()));
            }
        }
    }
    Ok(())
}

/// What one lower layer holds at a relative path, looked up without
/// following any symlink.
enum Lookup {
    /// The entry (of any type) at that path, every component above it a
    /// real directory of the layer.
    Found(PathBuf),
    /// Nothing there: the layers below may have it.
    Missing,
    /// A component above it is not a directory (a symlink, a file, a
    /// whiteout): the path is hidden in this layer and the ones below.
    Hidden,
}

fn lookup_nofollow(lower: &Path, rel: &Path) -> Lookup {
    let mut at = lower.to_path_buf();
    let mut components = rel.components().peekable();
    while let Some(c) = components.next() {
        let std::path::Component::Normal(name) = c else {
            return Lookup::Hidden;
        };
        at.push(name);
        match std::fs::symlink_metadata(&at) {
            Err(_) => return Lookup::Missing,
            Ok(_) if components.peek().is_none() => return Lookup::Found(at),
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => return Lookup::Hidden,
        }
    }
    // The layer's root itself (`rel` empty).
    Lookup::Found(at)
}

/// The nearest lower layer's entry at `rel`, found without following symlinks.
fn lower_entry(lowers: &[PathBuf], rel: &Path) -> Option<PathBuf> {
    for lower in lowers {
        match lookup_nofollow(lower, rel) {
            Lookup::Found(p) => return Some(p),
            Lookup::Missing => continue,
            Lookup::Hidden => return None,
        }
    }
    None
}

fn c_path(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

/// Removes the mark; whether it was there.
fn take_mark(dir: &Path) -> std::io::Result<bool> {
    let p = c_path(dir)?;
    // SAFETY: valid C strings.
    if unsafe { libc::lremovexattr(p.as_ptr(), IMPLICIT_XATTR.as_ptr()) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(false),
        _ => Err(e),
    }
}

/// As containerd's `copyDirInfo` and `copyUpXAttrs`: owner, then mode (a
/// chown clears setgid), then xattrs. Not overlayfs's own `trusted.overlay.*`:
/// a lower directory's opaque mark would hide what the layers below it add.
fn copy_dir_attributes(lower: &Path, dir: &Path) -> std::io::Result<()> {
    let m = std::fs::symlink_metadata(lower)?;
    if !m.is_dir() {
        return Ok(());
    }
    std::os::unix::fs::lchown(dir, Some(m.uid()), Some(m.gid()))?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(m.mode()))?;
    let (from, to) = (c_path(lower)?, c_path(dir)?);
    for name in list_xattrs(&from)? {
        if name.as_bytes().starts_with(b"trusted.overlay.") {
            continue;
        }
        let value = get_xattr(&from, &name)?;
        // SAFETY: valid C strings and a buffer of the given length.
        let r = unsafe {
            libc::lsetxattr(
                to.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn list_xattrs(p: &CString) -> std::io::Result<Vec<CString>> {
    // SAFETY: a null buffer of length 0 asks for the size.
    let n = unsafe { libc::llistxattr(p.as_ptr(), std::ptr::null_mut(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = vec![0u8; n as usize];
    // SAFETY: buf is writable for its length.
    let n = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| CString::new(s).expect("split at NUL"))
        .collect())
}

fn get_xattr(p: &CString, name: &CString) -> std::io::Result<Vec<u8>> {
    // SAFETY: a null buffer of length 0 asks for the size.
    let n = unsafe { libc::lgetxattr(p.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buf = vec![0u8; n as usize];
    // SAFETY: buf is writable for its length.
    let n = unsafe {
        libc::lgetxattr(
            p.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(p: &Path) {
        let c = c_path(p).unwrap();
        // SAFETY: valid C strings and buffer.
        let r = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                IMPLICIT_XATTR.as_ptr(),
                c"".as_ptr().cast(),
                0,
                0,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn marked_directories_take_the_nearest_lower_layers_owner_mode_and_xattrs() {
        let w = tempfile::tempdir().unwrap();
        let (base, mid, top) = (
            w.path().join("base"),
            w.path().join("mid"),
            w.path().join("top"),
        );
        for d in ["tmp", "home/app", "etc"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
            std::fs::create_dir_all(top.join(d)).unwrap();
        }
        std::fs::create_dir_all(mid.join("home/app")).unwrap();
        std::fs::create_dir_all(top.join("new")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(base.join("tmp"), std::fs::Permissions::from_mode(0o1777))
            .unwrap();
        std::os::unix::fs::lchown(base.join("home/app"), Some(7), Some(7)).unwrap();
        // The nearest lower layer wins.
        std::os::unix::fs::lchown(mid.join("home/app"), Some(1000), Some(1000)).unwrap();
        std::fs::set_permissions(mid.join("home/app"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        let c = c_path(&mid.join("home/app")).unwrap();
        // SAFETY: valid C strings and buffer.
        unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                c"user.origin".as_ptr(),
                b"mid".as_ptr().cast(),
                3,
                0,
            )
        };
        for d in ["tmp", "home", "home/app", "new"] {
            mark(&top.join(d));
        }
        // `etc` is the layer's own (not marked): left alone.
        std::fs::set_permissions(top.join("etc"), std::fs::Permissions::from_mode(0o711)).unwrap();

        inherit_implicit_parents(&top, &[mid.clone(), base.clone()]).unwrap();
        let m = |p: &str| std::fs::symlink_metadata(top.join(p)).unwrap();
        assert_eq!(m("tmp").mode() & 0o7777, 0o1777);
        assert_eq!((m("home/app").uid(), m("home/app").gid()), (1000, 1000));
        assert_eq!(m("home/app").mode() & 0o7777, 0o700);
        assert_eq!(
            get_xattr(
                &c_path(&top.join("home/app")).unwrap(),
                &CString::new("user.origin").unwrap()
            )
            .unwrap(),
            b"mid"
        );
        assert_eq!(m("etc").mode() & 0o7777, 0o711);
        // No lower layer has `new`: it stays as made, 0755 root.
        assert_eq!((m("new").uid(), m("new").mode() & 0o7777), (0, 0o755));
        for d in ["tmp", "home", "home/app", "new"] {
            assert!(!take_mark(&top.join(d)).unwrap(), "{d} still marked");
        }
    }

    #[test]
    fn a_lower_layers_symlinks_are_never_followed_onto_the_host() {
        use std::os::unix::fs::PermissionsExt;
        let w = tempfile::tempdir().unwrap();
        let (host, mid, base, top) = (
            w.path().join("host"),
            w.path().join("mid"),
            w.path().join("base"),
            w.path().join("top"),
        );
        // A host directory the lower layer's symlinks point at: owner,
        // mode and an xattr that must not reach the layer.
        std::fs::create_dir_all(host.join("secret")).unwrap();
        std::os::unix::fs::lchown(host.join("secret"), Some(4242), Some(4242)).unwrap();
        std::fs::set_permissions(host.join("secret"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        let c = c_path(&host.join("secret")).unwrap();
        // SAFETY: valid C strings and buffer.
        unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                c"user.host".as_ptr(),
                b"host".as_ptr().cast(),
                4,
                0,
            )
        };
        std::fs::create_dir_all(&mid).unwrap();
        // An absolute symlink, and a relative one climbing out of the layer.
        std::os::unix::fs::symlink(&host, mid.join("abs")).unwrap();
        std::os::unix::fs::symlink("../host", mid.join("rel")).unwrap();
        // `deep` is a symlink in mid: the real directory below it in base
        // is hidden, as it is in the overlay.
        std::os::unix::fs::symlink(&host, mid.join("deep")).unwrap();
        std::fs::create_dir_all(base.join("deep/secret")).unwrap();
        std::fs::set_permissions(
            base.join("deep/secret"),
            std::fs::Permissions::from_mode(0o750),
        )
        .unwrap();
        // A file in the way is no directory either.
        std::fs::write(mid.join("file"), b"x").unwrap();
        std::fs::create_dir_all(base.join("file/secret")).unwrap();
        std::fs::set_permissions(
            base.join("file/secret"),
            std::fs::Permissions::from_mode(0o711),
        )
        .unwrap();
        for d in ["abs/secret", "rel/secret", "deep/secret", "file/secret"] {
            std::fs::create_dir_all(top.join(d)).unwrap();
            mark(&top.join(d));
        }
        mark(&top.join("abs"));

        inherit_implicit_parents(&top, &[mid.clone(), base.clone()]).unwrap();
        for d in ["abs/secret", "rel/secret", "deep/secret", "file/secret"] {
            let m = std::fs::symlink_metadata(top.join(d)).unwrap();
            assert_eq!(
                (m.uid(), m.gid(), m.mode() & 0o7777),
                (0, 0, 0o755),
                "{d} took attributes from outside its lower layer"
            );
            let xattrs = list_xattrs(&c_path(&top.join(d)).unwrap()).unwrap();
            assert!(
                !xattrs.iter().any(|x| x.as_bytes() == b"user.host"),
                "{d}: {xattrs:?}"
            );
            assert!(!take_mark(&top.join(d)).unwrap(), "{d} still marked");
        }
        // The symlinks themselves are entries of the lower layer: the marked
        // `abs` takes nothing from one (it is no directory).
        assert_eq!(
            std::fs::symlink_metadata(top.join("abs")).unwrap().mode() & 0o7777,
            0o755
        );
    }
}
