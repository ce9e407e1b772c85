//! Secrets that callers present (bearer tokens, API keys), kept and compared without leaking
//! them: a plain core shared by every door that checks one.
//!
//! A secret is kept only as its SHA-256 digest. A presented one is hashed and compared with
//! every stored digest in constant time, all of them every time, and the matching entry's
//! permission bits are selected without a branch: the time an answer takes depends only on
//! the number of secrets and the presented secret's own length, so it tells a caller
//! neither how long a secret is, nor how much of it matched, nor which one matched.

use ring::digest::{digest, SHA256};
use std::io::Read;
use std::path::Path;
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

/// The SHA-256 digest of a secret; the secret itself is dropped once hashed. Equality (for
/// duplicates at load time) is plain: it compares configured secrets, not presented ones.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SecretDigest([u8; 32]);

impl SecretDigest {
    pub fn of(secret: &[u8]) -> Self {
        let mut out = [0u8; 32];
        out.copy_from_slice(digest(&SHA256, secret).as_ref());
        Self(out)
    }
}

impl std::fmt::Debug for SecretDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretDigest(***)")
    }
}

/// The permission bits of the stored secret `presented` is, if it is one: every entry is
/// compared in constant time, with no early exit.
pub fn lookup<'a>(
    stored: impl IntoIterator<Item = (&'a SecretDigest, u8)>,
    presented: &[u8],
) -> Option<u8> {
    let d = SecretDigest::of(presented);
    let mut found = Choice::from(0);
    let mut bits = 0u8;
    for (digest, entry_bits) in stored {
        let hit = digest.0.ct_eq(&d.0);
        bits.conditional_assign(&entry_bits, hit);
        found |= hit;
    }
    bool::from(found).then_some(bits)
}

/// The credential of an `Authorization: Bearer CREDENTIAL` header value (the scheme in any
/// case, RFC 9110), if it is one of at most `max_len` bytes.
pub fn bearer(header: &[u8], max_len: usize) -> Option<&[u8]> {
    let space = header.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = header.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let credential = rest.trim_ascii();
    (!credential.is_empty() && credential.len() <= max_len).then_some(credential)
}

/// Why a secrets file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot be read: {0}")]
    Io(#[from] std::io::Error),
    #[error("it is over {max} bytes: is it the right file?")]
    TooLarge { max: usize },
}

/// A secrets file (tokens, keys), read in time and memory bounded by `max` bytes whatever
/// the path names (a device, a huge file).
pub fn read_file(path: &Path, max: usize) -> Result<Vec<u8>, SecretFileError> {
    let mut text = Vec::new();
    std::fs::File::open(path)?
        .take(max as u64 + 1)
        .read_to_end(&mut text)?;
    if text.len() > max {
        return Err(SecretFileError::TooLarge { max });
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matching_entrys_bits_wherever_it_sits() {
        let stored: Vec<(SecretDigest, u8)> = ["first-secret", "second-secret", "third-secret"]
            .iter()
            .zip([0b001, 0b010, 0b100])
            .map(|(s, b)| (SecretDigest::of(s.as_bytes()), b))
            .collect();
        let look = |p: &str| lookup(stored.iter().map(|(d, b)| (d, *b)), p.as_bytes());
        assert_eq!(look("first-secret"), Some(0b001));
        assert_eq!(look("second-secret"), Some(0b010));
        assert_eq!(look("third-secret"), Some(0b100));
        for wrong in ["", "third-secre", "third-secrets", "Third-secret", "x"] {
            assert_eq!(look(wrong), None, "{wrong:?}");
        }
        // No bits at all is still a match.
        let none = [(SecretDigest::of(b"k"), 0u8)];
        assert_eq!(lookup(none.iter().map(|(d, b)| (d, *b)), b"k"), Some(0));
        assert_eq!(lookup([], b"k"), None);
    }

    #[test]
    fn bearer_credentials() {
        assert_eq!(bearer(b"Bearer abc", 8), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bEaReR   abc  ", 8), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Bearer abcdefghi", 8), None);
        for bad in [
            &b"Basic abc"[..],
            b"Bearerabc",
            b"Bearer ",
            b"Bearer    ",
            b"",
            b"abc",
        ] {
            assert_eq!(bearer(bad, 8), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_secrets_file_is_read_up_to_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, "x".repeat(100)).unwrap();
        assert_eq!(read_file(&path, 100).unwrap().len(), 100);
        assert!(matches!(
            read_file(&path, 99),
            Err(SecretFileError::TooLarge { max: 99 })
        ));
        assert!(matches!(
            read_file(&dir.path().join("missing"), 99),
            Err(SecretFileError::Io(_))
        ));
        // A device that never ends is cut at the bound.
        assert!(matches!(
            read_file(Path::new("/dev/zero"), 1 << 20),
            Err(SecretFileError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_digest_never_shows() {
        assert_eq!(
            format!("{:?}", SecretDigest::of(b"hunter2")),
            "SecretDigest(***)"
        );
    }
}
