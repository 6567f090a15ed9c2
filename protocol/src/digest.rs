//! OCI blob digests (`sha256:<64 lowercase hex>`), parsed once at the edge so
//! the rest of the code handles a checked value.

use std::fmt;
use std::str::FromStr;

/// A parsed `sha256:` OCI digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobDigest([u8; 32]);

/// Why a string is not a digest dray accepts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("digest {0:?} does not use the sha256 algorithm (only sha256 is supported)")]
    Algorithm(String),
    #[error("digest {0:?} must have exactly 64 lowercase hex characters after \"sha256:\"")]
    Encoding(String),
}

impl BlobDigest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        use sha2::Digest;
        Self(sha2::Sha256::digest(bytes).into())
    }

    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 hex characters, as used in file names.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl FromStr for BlobDigest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some(hex_part) = s.strip_prefix("sha256:") else {
            return Err(DigestError::Algorithm(truncate(s)));
        };
        let valid = hex_part.len() == 64
            && hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !valid {
            return Err(DigestError::Encoding(truncate(s)));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut out).map_err(|_| DigestError::Encoding(truncate(s)))?;
        Ok(Self(out))
    }
}

/// Hostile input can be long; keep error messages short.
fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

impl fmt::Display for BlobDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for BlobDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_malformed_digests() {
        let d = BlobDigest::of(b"hello");
        assert_eq!(d.to_string().parse::<BlobDigest>(), Ok(d));
        assert!(matches!(
            "md5:abc".parse::<BlobDigest>(),
            Err(DigestError::Algorithm(_))
        ));
        assert!(matches!(
            "sha256:ABC".parse::<BlobDigest>(),
            Err(DigestError::Encoding(_))
        ));
        let upper = format!("sha256:{}", d.hex().to_uppercase());
        assert!(upper.parse::<BlobDigest>().is_err());
    }
}
