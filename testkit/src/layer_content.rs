//! Real-looking layer content, generated deterministically from a seed:
//! source trees of small text files, large text files, binary-like files and
//! incompressible files, as a tar. The unpack bench and the unpacker's tests
//! build their layers from it, so that a figure and a test speak of the same
//! bytes.

use std::io::{self, Write};
use std::path::Path;

/// A deterministic generator of layer content.
pub struct Content(pub u64);

impl Content {
    /// The next 64 bits of the xorshift stream.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Incompressible bytes (media, already-compressed archives, models).
    pub fn random(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    /// Text that compresses about as source code and configs do (3–4×).
    pub fn text(&mut self, n: usize) -> Vec<u8> {
        const WORDS: &[&str] = &[
            "the",
            "layer",
            "image",
            "return",
            "static",
            "const",
            "function",
            "value",
            "error",
            "if",
            "else",
            "for",
            "while",
            "import",
            "struct",
            "impl",
            "self",
            "config",
            "path",
            "string",
            "bytes",
            "digest",
            "container",
            "runtime",
            "0x1f",
            "42",
            "true",
            "false",
            "null",
            "{",
            "}",
            "(",
            ");",
            "=",
            "==",
            "//",
            "#include",
            "<stdio.h>",
            "printf",
            "int",
            "char",
            "void",
            "license",
            "Apache",
            "GNU",
            "version",
            "copyright",
        ];
        let mut v = Vec::with_capacity(n + 64);
        while v.len() < n {
            let r = self.next_u64();
            for k in 0..6 {
                let word = WORDS[((r >> (k * 10)) % WORDS.len() as u64) as usize];
                v.extend_from_slice(word.as_bytes());
                v.push(if (r >> (60 - k)) & 7 == 0 {
                    b'\n'
                } else {
                    b' '
                });
            }
            // Identifiers that repeat less often, like real code.
            v.extend_from_slice(format!("x{} ", r % 5000).as_bytes());
        }
        v.truncate(n);
        v
    }

    /// Bytes that compress about as executables and shared libraries do
    /// (about 2-3x): runs of instruction-like words from a small alphabet,
    /// zero padding and embedded strings.
    pub fn binary(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 256);
        while v.len() < n {
            let r = self.next_u64();
            match r % 8 {
                0 => v.extend(std::iter::repeat_n(0u8, (r >> 8) as usize % 64)),
                1 => v.extend_from_slice(&self.text(16 + (r >> 8) as usize % 48)),
                _ => {
                    for k in 0..4 {
                        let op = ((r >> (16 + k * 8)) & 0x3f) as u8;
                        v.extend_from_slice(&[
                            0x48,
                            0x89 ^ (op & 3),
                            op,
                            (r >> (k * 4)) as u8 & 0xf,
                        ]);
                    }
                }
            }
        }
        v.truncate(n);
        v
    }
}

/// What share of a layer each kind of file takes, in percent (the rest of
/// 100 is incompressible).
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    /// Source trees: 0.5-16 KiB text files, 100 per directory.
    pub small_text: u64,
    /// 4-12 MiB text files.
    pub large_text: u64,
    /// 4-12 MiB binary-like files.
    pub binary: u64,
}

/// Writes a layer tar of about `bytes` bytes of file content under `top/`
/// at `path`, with a symlink and a hardlink; returns the number of files.
pub fn write_layer_tar(path: &Path, top: &str, bytes: u64, mix: Mix, seed: u64) -> io::Result<u64> {
    let mut b = tar::Builder::new(io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(path)?,
    ));
    let mut g = Content(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407));
    let add = |b: &mut tar::Builder<_>, name: &str, data: &[u8]| -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data)
    };
    let small_goal = bytes * mix.small_text / 100;
    let large_goals = [
        ("share", "txt", bytes * mix.large_text / 100),
        ("bin", "so", bytes * mix.binary / 100),
    ];
    let random_goal = bytes - small_goal - large_goals.iter().map(|g| g.2).sum::<u64>();
    let (mut small, mut i) = (0u64, 0u64);
    while small < small_goal {
        let n = 512 + (g.next_u64() % (16 << 10)) as usize;
        add(
            &mut b,
            &format!("{top}/src/d{}/f{i}.txt", i / 100),
            &g.text(n),
        )?;
        small += n as u64;
        i += 1;
    }
    let large = large_goals.into_iter().chain([("lib", "bin", random_goal)]);
    for (k, (dir, ext, goal)) in large.enumerate() {
        let mut done = 0;
        while done < goal {
            let n = ((4 << 20) + g.next_u64() % (8 << 20)).min(goal - done) as usize;
            let data = match k {
                0 => g.text(n),
                1 => g.binary(n),
                _ => g.random(n),
            };
            add(&mut b, &format!("{top}/{dir}/f{i}.{ext}"), &data)?;
            done += n as u64;
            i += 1;
        }
    }
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    h.set_uid(0);
    h.set_gid(0);
    b.append_link(&mut h, format!("{top}/current"), "src")?;
    h.set_entry_type(tar::EntryType::Link);
    b.append_link(
        &mut h,
        format!("{top}/first.txt"),
        format!("{top}/src/d0/f0.txt"),
    )?;
    b.into_inner()?.flush()?;
    Ok(i)
}
