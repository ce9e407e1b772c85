//! Who may call the frontend and what each caller may use: API keys and the operator's
//! grants. A plain core (no I/O): the keys file parsed, a presented key checked.
//!
//! Keys are kept and compared as `kvrouter_admin::secret` keeps every secret: SHA-256
//! digests only, a presented key compared with all of them in constant time, so neither the
//! time an answer takes nor its content tells a caller how long a key is, how much of it
//! matched, or which key matched.

use kvrouter_admin::secret::{self, SecretDigest};
use std::fmt;
use std::sync::Arc;

/// Shorter keys are refused: they can be guessed.
pub const MIN_KEY_BYTES: usize = 16;
/// Longer keys are refused: nothing needs them, and a header that long is a mistake.
pub const MAX_KEY_BYTES: usize = 1024;
/// A keys file larger than this is refused (the wrong file, most likely).
pub const MAX_KEYS_FILE_BYTES: usize = 1 << 20;

/// What a caller may use beyond plain OpenAI requests. Off unless the operator grants it,
/// per key (the keys file) or to every caller (`--grant-*`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Grants {
    /// The `kvrouter` request extension: pin, allowed workers, priority jump, cost settings.
    pub routing_extension: bool,
    /// The `x-kvrouter-*` answer headers: the worker and replica that served, and the
    /// cached prefix found (which tells whether another tenant's prompt is cached).
    pub overlap_header: bool,
}

impl Grants {
    pub const ROUTING_EXTENSION: &'static str = "routing-extension";
    pub const OVERLAP_HEADER: &'static str = "overlap-header";
    pub const NAMES: &'static [&'static str] = &[Self::ROUTING_EXTENSION, Self::OVERLAP_HEADER];

    pub fn union(self, other: Self) -> Self {
        Self {
            routing_extension: self.routing_extension || other.routing_extension,
            overlap_header: self.overlap_header || other.overlap_header,
        }
    }

    pub fn is_none(self) -> bool {
        self == Self::default()
    }

    /// `routing-extension,overlap-header` (either, both, in any order).
    fn parse_list(s: &str) -> Result<Self, String> {
        let mut g = Self::default();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                Self::ROUTING_EXTENSION => g.routing_extension = true,
                Self::OVERLAP_HEADER => g.overlap_header = true,
                other => return Err(other.chars().take(64).collect()),
            }
        }
        Ok(g)
    }

    fn bits(self) -> u8 {
        u8::from(self.routing_extension) | (u8::from(self.overlap_header) << 1)
    }

    fn from_bits(b: u8) -> Self {
        Self {
            routing_extension: b & 1 != 0,
            overlap_header: b & 2 != 0,
        }
    }
}

impl fmt::Display for Grants {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let names: Vec<&str> = [
            (self.routing_extension, Self::ROUTING_EXTENSION),
            (self.overlap_header, Self::OVERLAP_HEADER),
        ]
        .into_iter()
        .filter_map(|(on, n)| on.then_some(n))
        .collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

/// Why a key is refused. Never holds the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "the API key is empty; an empty key is refused rather than read as \"no \
         authentication\" (give a key of at least {MIN_KEY_BYTES} bytes, or no key option \
         at all for a frontend open to every caller)"
    )]
    Empty,
    #[error(
        "the API key is {bytes} bytes; at least {MIN_KEY_BYTES} are required, since a shorter \
         key can be guessed"
    )]
    TooShort { bytes: usize },
    #[error("the API key is {bytes} bytes, over the limit of {MAX_KEY_BYTES}")]
    TooLong { bytes: usize },
    #[error(
        "the API key has a space, control or non-ASCII character at byte {at}; keys travel \
         in an HTTP header, so only visible ASCII is accepted"
    )]
    NotVisibleAscii { at: usize },
    #[error(
        "the API key reads as a list of grants ({names}); is the key itself missing?",
        names = Grants::NAMES.join(", ")
    )]
    LooksLikeGrants,
}

/// Why the API keys are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error(transparent)]
    Flag(KeyError),
    #[error("line {line}: {source}")]
    Line { line: usize, source: KeyError },
    #[error(
        "line {line}: unknown grant {name:?} (known: {known})",
        known = Grants::NAMES.join(", ")
    )]
    UnknownGrant { line: usize, name: String },
    #[error("line {line}: more than a key and its grants (write KEY [GRANT,GRANT] [# comment])")]
    Extra { line: usize },
    #[error(
        "line {line} starts with whitespace: write the key at the start of the line (is the \
         key missing?)"
    )]
    Indented { line: usize },
    #[error("line {line} repeats the key of line {first}")]
    Duplicate { line: usize, first: usize },
    #[error("the --api-key key is also in the keys file (line {line}); give it once")]
    FlagInFile { line: usize },
    #[error(
        "no keys in it (only comments and blank lines); a keys file with no keys is refused \
         rather than read as \"no authentication\""
    )]
    NoKeys,
    #[error("it is {bytes} bytes, over the limit of {MAX_KEYS_FILE_BYTES}: is it the right file?")]
    TooLarge { bytes: usize },
    #[error("it is not UTF-8 text")]
    NotUtf8,
}

/// A key's digest and what it grants; the key itself is dropped once hashed.
#[derive(Clone)]
struct StoredKey {
    digest: SecretDigest,
    grants: Grants,
    /// Where it came from, for error messages: 0 for `--api-key`, else the file's line.
    line: usize,
}

fn check_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if let Some(at) = key.bytes().position(|b| !b.is_ascii_graphic()) {
        return Err(KeyError::NotVisibleAscii { at });
    }
    if key.len() < MIN_KEY_BYTES {
        return Err(KeyError::TooShort { bytes: key.len() });
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong { bytes: key.len() });
    }
    if key
        .split(',')
        .all(|n| n.is_empty() || Grants::NAMES.contains(&n))
    {
        return Err(KeyError::LooksLikeGrants);
    }
    Ok(())
}

/// The API keys a frontend accepts: at least one (an empty set is not representable, so it
/// can never mean "open").
#[derive(Clone)]
pub struct ApiKeys {
    keys: Vec<StoredKey>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("ApiKeys")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl ApiKeys {
    /// One key with no grants of its own (`--api-key`); surrounding whitespace (a
    /// trailing newline from a secret file) is not part of it.
    pub fn from_flag(key: &str) -> Result<Self, KeysError> {
        let key = key.trim();
        check_key(key).map_err(KeysError::Flag)?;
        Ok(Self {
            keys: vec![StoredKey {
                digest: SecretDigest::of(key.as_bytes()),
                grants: Grants::default(),
                line: 0,
            }],
        })
    }

    /// A keys file: one key a line, optionally followed by its grants (comma-separated)
    /// after whitespace; `#` starts a comment (a whole line, or after the key and grants);
    /// blank lines are skipped.
    pub fn from_file(text: &[u8]) -> Result<Self, KeysError> {
        if text.len() > MAX_KEYS_FILE_BYTES {
            return Err(KeysError::TooLarge { bytes: text.len() });
        }
        let text = std::str::from_utf8(text).map_err(|_| KeysError::NotUtf8)?;
        let mut keys: Vec<StoredKey> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            if raw.starts_with(char::is_whitespace) {
                return Err(KeysError::Indented { line });
            }
            let mut words = trimmed
                .split_whitespace()
                .take_while(|w| !w.starts_with('#'));
            let key = words.next().unwrap_or_default();
            let grants = match words.next() {
                None => Grants::default(),
                Some(list) => Grants::parse_list(list)
                    .map_err(|name| KeysError::UnknownGrant { line, name })?,
            };
            if words.next().is_some() {
                return Err(KeysError::Extra { line });
            }
            check_key(key).map_err(|source| KeysError::Line { line, source })?;
            let digest = SecretDigest::of(key.as_bytes());
            if let Some(first) = keys.iter().find(|k| k.digest == digest) {
                return Err(KeysError::Duplicate {
                    line,
                    first: first.line,
                });
            }
            keys.push(StoredKey {
                digest,
                grants,
                line,
            });
        }
        if keys.is_empty() {
            return Err(KeysError::NoKeys);
        }
        Ok(Self { keys })
    }

    /// Both sets; a key in both is refused (which grants would it have?).
    pub fn merge(mut self, other: Self) -> Result<Self, KeysError> {
        for k in &other.keys {
            if let Some(same) = self.keys.iter().find(|s| s.digest == k.digest) {
                return Err(KeysError::FlagInFile {
                    line: same.line.max(k.line),
                });
            }
        }
        self.keys.extend(other.keys);
        Ok(self)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Keys granted anything of their own.
    pub fn with_grants(&self) -> usize {
        self.keys.iter().filter(|k| !k.grants.is_none()).count()
    }

    /// The grants of the key presented, if it is one of these (every key compared, in
    /// constant time).
    fn verify(&self, presented: &[u8]) -> Option<Grants> {
        let keys = self.keys.iter().map(|k| (&k.digest, k.grants.bits()));
        secret::lookup(keys, presented).map(Grants::from_bits)
    }
}

/// Why a call was refused, as the `reason` label of `kvrouter_frontend_auth_refused_total`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer KEY`.
    MissingKey,
    /// A key that is none of the frontend's.
    WrongKey,
    /// The `kvrouter` extension without the routing-extension grant.
    RoutingExtension,
}

impl Refusal {
    pub const ALL: [Refusal; 3] = [Self::MissingKey, Self::WrongKey, Self::RoutingExtension];

    pub fn reason(self) -> &'static str {
        match self {
            Self::MissingKey => "missing_key",
            Self::WrongKey => "wrong_key",
            Self::RoutingExtension => "routing_extension",
        }
    }
}

/// Who may call and what they may use: the API keys (none: every caller is served) and the
/// grants every caller has.
#[derive(Clone, Default)]
pub struct Access {
    keys: Option<Arc<ApiKeys>>,
    everyone: Grants,
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("Access")
            .field("keys", &self.keys.as_ref().map_or(0, |k| k.len()))
            .field("granted_to_every_caller", &self.everyone)
            .finish()
    }
}

impl Access {
    pub fn new(keys: Option<ApiKeys>, everyone: Grants) -> Self {
        Self {
            keys: keys.map(Arc::new),
            everyone,
        }
    }

    pub fn keys(&self) -> Option<&ApiKeys> {
        self.keys.as_deref()
    }

    pub fn granted_to_every_caller(&self) -> Grants {
        self.everyone
    }

    /// What the caller presenting this `Authorization` header value may use, or why it is
    /// refused.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<Grants, Refusal> {
        let Some(keys) = &self.keys else {
            return Ok(self.everyone);
        };
        // Any length is hashed and refused as a wrong key: the header limit bounds it.
        let presented = authorization
            .and_then(|h| secret::bearer(h, usize::MAX))
            .ok_or(Refusal::MissingKey)?;
        keys.verify(presented)
            .map(|g| g.union(self.everyone))
            .ok_or(Refusal::WrongKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "sk-aaaaaaaaaaaaaaaaaaaa";
    const B: &str = "sk-bbbbbbbbbbbbbbbbbbbb";
    const C: &str = "sk-cccccccccccccccccccc";

    fn file(text: &str) -> Result<ApiKeys, KeysError> {
        ApiKeys::from_file(text.as_bytes())
    }

    fn header(key: &str) -> Vec<u8> {
        format!("Bearer {key}").into_bytes()
    }

    fn keyed(keys: ApiKeys, everyone: Grants) -> Access {
        Access::new(Some(keys), everyone)
    }

    const BOTH: Grants = Grants {
        routing_extension: true,
        overlap_header: true,
    };
    const EXT: Grants = Grants {
        routing_extension: true,
        overlap_header: false,
    };
    const HEADER: Grants = Grants {
        routing_extension: false,
        overlap_header: true,
    };

    #[test]
    fn a_keys_file_with_comments_blank_lines_and_grants() {
        let keys = file(&format!(
            "# tenants\n\n{A}\n{B} routing-extension,overlap-header   # the operator's tool\n\
             {C}\toverlap-header\n   \n# end\n"
        ))
        .unwrap();
        assert_eq!((keys.len(), keys.with_grants()), (3, 2));
        let access = keyed(keys, Grants::default());
        assert_eq!(access.check(Some(&header(A))), Ok(Grants::default()));
        assert_eq!(access.check(Some(&header(B))), Ok(BOTH));
        assert_eq!(access.check(Some(&header(C))), Ok(HEADER));
        // CRLF line ends are lines too.
        let crlf = file(&format!("{A} routing-extension\r\n{B}\r\n")).unwrap();
        let access = keyed(crlf, Grants::default());
        assert_eq!(access.check(Some(&header(A))), Ok(EXT));
        assert_eq!(access.check(Some(&header(B))), Ok(Grants::default()));
    }

    #[test]
    fn keys_file_errors_name_the_line_and_never_the_key() {
        let cases: Vec<(String, KeysError)> = vec![
            (String::new(), KeysError::NoKeys),
            ("# only a comment\n\n   \n".into(), KeysError::NoKeys),
            (
                format!("{A}\nsk-short\n"),
                KeysError::Line {
                    line: 2,
                    source: KeyError::TooShort { bytes: 8 },
                },
            ),
            (
                format!("{A} routing-extension,admin\n"),
                KeysError::UnknownGrant {
                    line: 1,
                    name: "admin".into(),
                },
            ),
            (
                format!("{A} overlap-header extra\n"),
                KeysError::Extra { line: 1 },
            ),
            (
                // A templated line whose key came out empty.
                " routing-extension,overlap-header\n".into(),
                KeysError::Indented { line: 1 },
            ),
            (
                "routing-extension,overlap-header\n".into(),
                KeysError::Line {
                    line: 1,
                    source: KeyError::LooksLikeGrants,
                },
            ),
            (
                format!("{A}\n#\n{B}\n{A} overlap-header\n"),
                KeysError::Duplicate { line: 4, first: 1 },
            ),
            (
                format!("{}\n", "k".repeat(MAX_KEY_BYTES + 1)),
                KeysError::Line {
                    line: 1,
                    source: KeyError::TooLong {
                        bytes: MAX_KEY_BYTES + 1,
                    },
                },
            ),
            (
                "sk-\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\n".into(),
                KeysError::Line {
                    line: 1,
                    source: KeyError::NotVisibleAscii { at: 3 },
                },
            ),
        ];
        for (text, want) in cases {
            let got = file(&text).unwrap_err();
            assert_eq!(got, want, "{text:?}");
            for key in [A, B, C] {
                assert!(!got.to_string().contains(key), "{got}");
            }
        }
        assert_eq!(
            ApiKeys::from_file(&[b'#'; MAX_KEYS_FILE_BYTES + 1]).unwrap_err(),
            KeysError::TooLarge {
                bytes: MAX_KEYS_FILE_BYTES + 1
            }
        );
        assert_eq!(
            ApiKeys::from_file(b"sk-\xff\xfe-aaaaaaaaaaaaaaa").unwrap_err(),
            KeysError::NotUtf8
        );
        let e = file("x\n").unwrap_err().to_string();
        assert!(e.contains("at least 16") && e.contains("guessed"), "{e}");
    }

    #[test]
    fn an_empty_or_short_flag_key_is_refused_not_read_as_open() {
        for empty in ["", " ", "\n", " \t "] {
            assert_eq!(
                ApiKeys::from_flag(empty).unwrap_err(),
                KeysError::Flag(KeyError::Empty)
            );
        }
        assert!(KeysError::Flag(KeyError::Empty)
            .to_string()
            .contains("empty"));
        assert_eq!(
            ApiKeys::from_flag("sk-123456789abc").unwrap_err(),
            KeysError::Flag(KeyError::TooShort { bytes: 15 })
        );
        assert_eq!(
            ApiKeys::from_flag("sk-1234 56789abcdef").unwrap_err(),
            KeysError::Flag(KeyError::NotVisibleAscii { at: 7 })
        );
        // A secret file's trailing newline is not part of the key.
        let keys = ApiKeys::from_flag(&format!("{A}\n")).unwrap();
        let access = keyed(keys, Grants::default());
        assert!(access.check(Some(&header(A))).is_ok());
    }

    #[test]
    fn only_the_whole_right_key_is_accepted() {
        let access = keyed(
            ApiKeys::from_flag(A).unwrap(),
            Grants {
                routing_extension: false,
                overlap_header: true,
            },
        );
        assert_eq!(access.check(Some(&header(A))), Ok(HEADER));
        assert_eq!(
            access.check(Some(format!("bearer   {A}  ").as_bytes())),
            Ok(HEADER)
        );
        let wrong = [
            B.to_string(),
            A[..A.len() - 1].to_string(),      // a prefix
            format!("{A}a"),                   // longer
            A.to_ascii_uppercase(),            // case
            format!("{}b", &A[..A.len() - 1]), // last byte differs
            "s".into(),
            "x".repeat(100_000),
        ];
        for w in &wrong {
            assert_eq!(
                access.check(Some(&header(w))),
                Err(Refusal::WrongKey),
                "{}",
                &w[..w.len().min(30)]
            );
        }
        for missing in [
            None,
            Some(&b""[..]),
            Some(&b"Bearer"[..]),
            Some(&b"Bearer "[..]),
            Some(&b"Bearer    "[..]),
            Some(A.as_bytes()),
            Some(format!("Basic {A}").as_bytes()),
            Some(format!("Bearer{A}").as_bytes()),
        ]
        .iter()
        .map(|o| o.map(<[u8]>::to_vec))
        {
            assert_eq!(
                access.check(missing.as_deref()),
                Err(Refusal::MissingKey),
                "{missing:?}"
            );
        }
    }

    #[test]
    fn grants_come_from_the_key_and_from_every_caller_flags() {
        let keys = file(&format!("{A} routing-extension\n{B}\n")).unwrap();
        let access = keyed(keys.clone(), Grants::default());
        assert_eq!(access.check(Some(&header(A))), Ok(EXT));
        assert_eq!(access.check(Some(&header(B))), Ok(Grants::default()));
        let access = keyed(keys, HEADER);
        assert_eq!(access.check(Some(&header(A))), Ok(BOTH));
        assert_eq!(access.check(Some(&header(B))), Ok(HEADER));
        assert_eq!(access.check(None), Err(Refusal::MissingKey));
        // No keys: every caller is served with the flags' grants, and only those.
        let open = Access::new(None, EXT);
        assert_eq!(open.check(None), Ok(EXT));
        assert_eq!(open.check(Some(&header(A))), Ok(EXT));
        assert_eq!(Access::default().check(None), Ok(Grants::default()));
        assert_eq!(Grants::parse_list("overlap-header,,"), Ok(HEADER));
        assert_eq!(BOTH.to_string(), "routing-extension,overlap-header");
        assert_eq!(Grants::default().to_string(), "none");
    }

    #[test]
    fn the_flag_key_and_the_file_merge_and_may_not_repeat() {
        let flag = ApiKeys::from_flag(A).unwrap();
        let merged = flag
            .clone()
            .merge(file(&format!("{B} overlap-header\n")).unwrap())
            .unwrap();
        let access = keyed(merged, Grants::default());
        assert_eq!(access.check(Some(&header(A))), Ok(Grants::default()));
        assert_eq!(access.check(Some(&header(B))), Ok(HEADER));
        assert_eq!(
            flag.merge(file(&format!("{B}\n{A} routing-extension\n")).unwrap())
                .unwrap_err(),
            KeysError::FlagInFile { line: 2 }
        );
    }

    #[test]
    fn keys_never_show_in_debug() {
        let keys = file(&format!("{A} overlap-header\n{B}\n")).unwrap();
        let access = keyed(keys.clone(), EXT);
        for text in [format!("{keys:?}"), format!("{access:?}")] {
            assert!(!text.contains("sk-"), "{text}");
            assert!(text.contains('2'), "{text}");
        }
    }

    /// The matching key's grants are selected by the match, wherever the key sits among
    /// the others (the selection has no branch to get wrong).
    #[test]
    fn the_matching_keys_grants_wherever_it_sits() {
        let keys: Vec<String> = (0..50).map(|i| format!("sk-{i:040}")).collect();
        let text: String = keys
            .iter()
            .enumerate()
            .map(|(i, k)| match i {
                0 => format!("{k} overlap-header\n"),
                49 => format!("{k} routing-extension\n"),
                _ => format!("{k}\n"),
            })
            .collect();
        let set = file(&text).unwrap();
        assert_eq!(set.verify(keys[0].as_bytes()), Some(HEADER));
        assert_eq!(set.verify(keys[1].as_bytes()), Some(Grants::default()));
        assert_eq!(set.verify(keys[48].as_bytes()), Some(Grants::default()));
        assert_eq!(set.verify(keys[49].as_bytes()), Some(EXT));
        assert_eq!(set.verify(b"sk-nope-nope-nope-nope"), None);
        assert_eq!(set.verify(b""), None);
    }
}
