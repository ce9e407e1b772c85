//! How to reach NATS: a plain struct the CLI fills in, and its validation.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::BusError;

/// Connection options for [`Bus::connect`](crate::Bus::connect).
///
/// Authentication is at most one of: `user` + `password`, `token`, `credentials_file`,
/// `nkey_file`, or credentials in the URL: `nats://user:password@host:4222` or `nats://token@host:4222`, with
/// special characters percent-encoded (`%40` for `@`, `%3A` for `:`, `%20` for a space, `%25` for
/// `%`). Several URLs may carry credentials only if they carry the same ones; they are taken out
/// of the URLs and sent like the fields above. TLS is used when the server
/// asks for it or when `tls_required` is set; `tls_ca_file` adds a root certificate and
/// `tls_client_cert` + `tls_client_key` present a client certificate (mutual TLS).
///
/// Reply subjects: with an nkey (in `nkey_file` or a `.creds` file) the client's inboxes are
/// `_INBOX.<its public key>.<unique>`, so NATS permissions can let each user read only its
/// own replies (`_INBOX.<public key>.>`); `inbox_prefix` sets another prefix.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsOptions {
    /// One server URL or a comma-separated list (`nats://a:4222,nats://b:4222`).
    pub url: String,
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    /// A NATS `.creds` file (user JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    /// A file holding a user nkey seed (`SU...`, surrounding whitespace ignored): the client
    /// proves it holds the key; nats-server knows the user by its public key.
    pub nkey_file: Option<PathBuf>,
    /// The prefix of this client's reply subjects (`_INBOX.<unique>` by default,
    /// `_INBOX.<public key>` with an nkey); a valid subject without wildcards.
    pub inbox_prefix: Option<String>,
    /// A PEM file with the CA certificate(s) that signed the server's certificate.
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate, for servers that verify clients (requires `tls_client_key`).
    pub tls_client_cert: Option<PathBuf>,
    /// The PEM private key of `tls_client_cert`.
    pub tls_client_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    pub tls_required: bool,
    /// The connection name shown by the server's monitoring (`/connz`).
    pub name: Option<String>,
    /// How long one connection attempt to one server may take.
    pub connect_timeout: Duration,
}

/// The URL used when none is given: a nats-server on this host's default port.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            url: DEFAULT_NATS_URL.to_string(),
            user: None,
            password: None,
            token: None,
            credentials_file: None,
            nkey_file: None,
            inbox_prefix: None,
            tls_ca_file: None,
            tls_client_cert: None,
            tls_client_key: None,
            tls_required: false,
            name: None,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Secrets (password, token, a password in the URL) are shown as `***`.
impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |s: &Option<String>| s.as_ref().map(|_| "***");
        f.debug_struct("NatsOptions")
            .field("url", &self.redacted_url())
            .field("user", &self.user)
            .field("password", &hide(&self.password))
            .field("token", &hide(&self.token))
            .field("credentials_file", &self.credentials_file)
            .field("nkey_file", &self.nkey_file)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_client_cert", &self.tls_client_cert)
            .field("tls_client_key", &self.tls_client_key)
            .field("tls_required", &self.tls_required)
            .field("name", &self.name)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl NatsOptions {
    /// Options for `url` with everything else at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    /// The server URLs, trimmed, empty entries dropped.
    pub fn urls(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect()
    }

    /// The URL list with any password in it replaced by `***`, for logs and errors.
    pub fn redacted_url(&self) -> String {
        self.urls()
            .into_iter()
            .map(redact_url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The server URLs with any credentials taken out, and those credentials (percent-decoded).
    /// Fails if they cannot be decoded or two URLs carry different ones.
    pub(crate) fn split_url_auth(&self) -> Result<(Vec<String>, Option<UrlAuth>), BusError> {
        let fail = |why: String| {
            BusError::Connect(format!(
                "cannot connect to '{}': {why}",
                self.redacted_url()
            ))
        };
        let mut servers = Vec::new();
        let mut auth: Option<UrlAuth> = None;
        for url in self.urls() {
            let (server, this) = split_userinfo(url)
                .map_err(|why| fail(format!("the credentials in '{}' {why}", redact_url(url))))?;
            servers.push(server);
            match (&auth, this) {
                (_, None) => {}
                (None, Some(a)) => auth = Some(a),
                (Some(a), Some(b)) if *a == b => {}
                (Some(_), Some(_)) => {
                    return Err(fail(
                        "the server URLs carry different credentials; one connection uses one \
                         set, give it once"
                            .into(),
                    ))
                }
            }
        }
        Ok((servers, auth))
    }

    /// Checks that the options make sense together and that the files they name exist.
    /// Errors are [`BusError::Connect`] naming the URL and the problem.
    pub fn validate(&self) -> Result<(), BusError> {
        let fail = |why: String| {
            Err(BusError::Connect(format!(
                "cannot connect to '{}': {why}",
                self.redacted_url()
            )))
        };
        if self.urls().is_empty() {
            return fail("no NATS server URL given (e.g. nats://127.0.0.1:4222)".to_string());
        }
        match (&self.user, &self.password) {
            (Some(_), None) => {
                return fail("a NATS user is set but no password; set both or neither".into())
            }
            (None, Some(_)) => {
                return fail("a NATS password is set but no user; set both or neither".into())
            }
            _ => {}
        }
        let (_, url_auth) = self.split_url_auth()?;
        let methods: Vec<&str> = [
            url_auth.as_ref().map(|_| "credentials in the URL"),
            self.user.as_ref().map(|_| "user/password"),
            self.token.as_ref().map(|_| "token"),
            self.credentials_file.as_ref().map(|_| "credentials file"),
            self.nkey_file.as_ref().map(|_| "nkey file"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if methods.len() > 1 {
            return fail(format!(
                "conflicting NATS authentication options: {}; use only one",
                methods.join(" and ")
            ));
        }
        if self.token.as_deref() == Some("") {
            return fail("the NATS token is empty".into());
        }
        match (&self.tls_client_cert, &self.tls_client_key) {
            (Some(c), None) => {
                return fail(format!(
                    "TLS client certificate {} is set but no client key; set both or neither",
                    c.display()
                ))
            }
            (None, Some(k)) => {
                return fail(format!(
                    "TLS client key {} is set but no client certificate; set both or neither",
                    k.display()
                ))
            }
            _ => {}
        }
        let files: [(&str, Option<&PathBuf>); 5] = [
            ("credentials file", self.credentials_file.as_ref()),
            ("nkey file", self.nkey_file.as_ref()),
            ("TLS CA file", self.tls_ca_file.as_ref()),
            ("TLS client certificate", self.tls_client_cert.as_ref()),
            ("TLS client key", self.tls_client_key.as_ref()),
        ];
        for (what, path) in files {
            if let Some(path) = path {
                if let Err(why) = check_file(path) {
                    return fail(format!("the {what} {}: {why}", path.display()));
                }
            }
        }
        if let Some(path) = &self.nkey_file {
            if let Err(why) = read_nkey(path) {
                return fail(format!("the nkey file {}: {why}", path.display()));
            }
        }
        if let Some(prefix) = &self.inbox_prefix {
            if let Err(e) = crate::subject::validate_publish(prefix) {
                return fail(format!("the inbox prefix is not a valid subject: {e}"));
            }
        }
        if self.connect_timeout.is_zero() {
            return fail("connect_timeout is zero; use a few seconds".into());
        }
        Ok(())
    }

    /// The prefix of this client's reply subjects: `inbox_prefix`, else `_INBOX.<public
    /// key>` when it authenticates with an nkey (`nkey_file`, or the seed in a `.creds`
    /// file), else `None` (async-nats' `_INBOX`). Errors as [`NatsOptions::validate`].
    pub fn reply_prefix(&self) -> Result<Option<String>, BusError> {
        if let Some(p) = &self.inbox_prefix {
            return Ok(Some(p.clone()));
        }
        let fail = |what: &str, path: &Path, why: String| {
            BusError::Connect(format!(
                "cannot connect to '{}': the {what} {}: {why}",
                self.redacted_url(),
                path.display()
            ))
        };
        if let Some(path) = &self.nkey_file {
            let key = read_nkey(path).map_err(|why| fail("nkey file", path, why))?;
            return Ok(Some(format!("_INBOX.{}", key.public_key)));
        }
        if let Some(path) = &self.credentials_file {
            // async-nats reads the file itself and says what is wrong with it; a seed this
            // cannot find leaves the default inbox.
            if let Ok(text) = std::fs::read_to_string(path) {
                if let Some(key) = text.lines().find_map(|l| parse_user_seed(l).ok()) {
                    return Ok(Some(format!("_INBOX.{}", key.public_key)));
                }
            }
        }
        Ok(None)
    }
}

/// A user nkey: its seed (secret: never shown, not even in Debug) and its public key.
#[derive(Clone)]
pub(crate) struct UserNkey {
    pub(crate) seed: String,
    pub(crate) public_key: String,
}

impl std::fmt::Debug for UserNkey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UserNkey({}, seed ***)", self.public_key)
    }
}

/// The largest nkey file read: a seed is 58 characters; anything much longer is not one.
const MAX_NKEY_FILE_BYTES: u64 = 4096;

/// Reads and checks the user nkey seed in `path`. Errors say what is wrong without the seed.
pub(crate) fn read_nkey(path: &Path) -> Result<UserNkey, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot be read ({e})"))?;
    if !meta.is_file() {
        return Err("is not a regular file".into());
    }
    if meta.len() > MAX_NKEY_FILE_BYTES {
        return Err(format!(
            "is {} bytes; an nkey seed file holds one line of 58 characters",
            meta.len()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot be read ({e})"))?;
    parse_user_seed(&text)
}

/// Whether `path` may be read by every user of the host (a seed file should not be).
pub(crate) fn world_readable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o004 != 0)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        false
    }
}

/// Parses a user nkey seed (`SU` and 56 more base32 characters), whitespace around it
/// ignored.
pub(crate) fn parse_user_seed(text: &str) -> Result<UserNkey, String> {
    let seed = text.trim();
    if seed.is_empty() {
        return Err("is empty; it should hold a user nkey seed (SU...)".into());
    }
    if !seed.starts_with("SU") {
        let what = match seed.get(..2) {
            Some("SA") => "an account seed",
            Some("SO") => "an operator seed",
            Some("SN") => "a server seed",
            _ if seed.starts_with('U') => "a public key",
            _ => "no nkey seed",
        };
        return Err(format!(
            "holds {what}, not a user nkey seed (one line starting with SU, as `kvrouter \
             creds` writes)"
        ));
    }
    let pair = nkeys::KeyPair::from_seed(seed)
        .map_err(|_| "holds a malformed user nkey seed (bad length or checksum)".to_string())?;
    Ok(UserNkey {
        seed: seed.to_string(),
        public_key: pair.public_key(),
    })
}

fn check_file(path: &Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err("is not a regular file".into()),
        Err(e) => Err(format!("cannot be read ({e})")),
    }
}

/// Credentials written into a server URL, percent-decoded.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum UrlAuth {
    UserPassword { user: String, password: String },
    Token(String),
}

impl std::fmt::Debug for UrlAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UrlAuth::UserPassword { user, .. } => write!(f, "UserPassword({user:?}, ***)"),
            UrlAuth::Token(_) => write!(f, "Token(***)"),
        }
    }
}

/// Splits `nats://user:password@host:port` (or `nats://token@host:port`) into the URL without
/// its userinfo and the decoded credentials. async-nats ignores credentials in a URL, so they
/// have to travel in the connect options. Errors say what is wrong without echoing secrets.
pub(crate) fn split_userinfo(url: &str) -> Result<(String, Option<UrlAuth>), String> {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return Ok((url.to_string(), None));
    };
    let (userinfo, host) = (&rest[..at], &rest[at + 1..]);
    let server = format!("{scheme}{host}");
    let decode = |part: &str, what: &str| {
        percent_decode(part).ok_or_else(|| {
            format!(
                "are not valid: the {what} has a '%' not followed by two hex digits, or is not \
                 UTF-8 once decoded (write '%' as %25)"
            )
        })
    };
    let auth = match userinfo.split_once(':') {
        _ if userinfo.is_empty() => None,
        Some(("", _)) => return Err("are not valid: a password but no user".into()),
        Some((user, password)) => Some(UrlAuth::UserPassword {
            user: decode(user, "user")?,
            password: decode(password, "password")?,
        }),
        None => Some(UrlAuth::Token(decode(userinfo, "token")?)),
    };
    Ok((server, auth))
}

/// Decodes `%XX` escapes; `None` for a malformed escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            // Two ASCII hex digits: always a valid u8.
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Replaces the password (or token) of `nats://user:password@host` with `***`.
pub(crate) fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    let host = &rest[at..];
    match userinfo.find(':') {
        Some(colon) => format!("{scheme}{}:***{host}", &userinfo[..colon]),
        // a lone userinfo is a token: hide it all
        None => format!("{scheme}***{host}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(o: &NatsOptions) -> String {
        match o.validate() {
            Err(BusError::Connect(m)) => m,
            other => panic!("expected a Connect error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let o = NatsOptions::default();
        assert_eq!(o.connect_timeout, Duration::from_secs(5));
        assert!(o.validate().is_ok());
    }

    #[test]
    fn url_lists() {
        let o = NatsOptions::new(" nats://a:4222, nats://b:4222 ,,");
        assert_eq!(o.urls(), vec!["nats://a:4222", "nats://b:4222"]);
        assert!(err(&NatsOptions::new(" , ")).contains("no NATS server URL"));
    }

    #[test]
    fn user_needs_password_and_back() {
        let mut o = NatsOptions::new("nats://h:1");
        o.user = Some("u".into());
        let m = err(&o);
        assert!(m.contains("nats://h:1") && m.contains("no password"), "{m}");
        o.user = None;
        o.password = Some("p".into());
        assert!(err(&o).contains("no user"));
        o.user = Some("u".into());
        assert!(o.validate().is_ok());
        o.token = Some("t".into());
        assert!(err(&o).contains("conflicting"));
    }

    #[test]
    fn cert_needs_key() {
        let mut o = NatsOptions::new("tls://h:1");
        o.tls_client_cert = Some("/nonexistent/cert.pem".into());
        assert!(err(&o).contains("no client key"));
        o.tls_client_cert = None;
        o.tls_client_key = Some("/nonexistent/key.pem".into());
        assert!(err(&o).contains("no client certificate"));
        o.tls_client_cert = Some("/nonexistent/cert.pem".into());
        let m = err(&o);
        assert!(
            m.contains("/nonexistent/cert.pem") && m.contains("cannot be read"),
            "{m}"
        );
    }

    /// A user seed in a fresh file of `mode`; the file and its seed and public key.
    fn seed_file(mode: u32) -> (tempfile::NamedTempFile, String, String) {
        let pair = nkeys::KeyPair::new_user();
        let seed = pair.seed().unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), format!("  {seed}\n\n")).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        }
        (file, seed, pair.public_key())
    }

    #[test]
    fn an_nkey_file_is_checked_and_names_the_inbox() {
        let (file, seed, public) = seed_file(0o600);
        let mut o = NatsOptions::new("nats://h:1");
        o.nkey_file = Some(file.path().into());
        assert!(o.validate().is_ok());
        assert_eq!(o.reply_prefix().unwrap(), Some(format!("_INBOX.{public}")));
        assert!(!world_readable(file.path()));
        // Another auth method beside it is refused, like any two.
        o.token = Some("t".into());
        let m = err(&o);
        assert!(m.contains("token and nkey file"), "{m}");
        o.token = None;
        // An explicit prefix wins.
        o.inbox_prefix = Some("_INBOX.frontend".into());
        assert_eq!(
            o.reply_prefix().unwrap().as_deref(),
            Some("_INBOX.frontend")
        );
        o.inbox_prefix = Some("_INBOX.*".into());
        assert!(err(&o).contains("inbox prefix"));
        o.inbox_prefix = None;
        // Debug shows the file, never the seed.
        assert!(!format!("{o:?}").contains(&seed));
        let (loose, _, _) = seed_file(0o644);
        assert!(cfg!(not(unix)) || world_readable(loose.path()));
    }

    #[test]
    fn a_bad_nkey_file_is_refused_without_echoing_it() {
        let pair = nkeys::KeyPair::new_user();
        let seed = pair.seed().unwrap();
        let account = nkeys::KeyPair::new_account().seed().unwrap();
        let public = pair.public_key();
        // One character changed: the checksum no longer holds.
        let mut broken = seed.clone();
        broken.replace_range(10..11, if &seed[10..11] == "A" { "B" } else { "A" });
        let cases = [
            ("", "is empty"),
            (account.as_str(), "an account seed"),
            (public.as_str(), "a public key"),
            (broken.as_str(), "malformed"),
            ("hunter2", "no nkey seed"),
        ];
        for (content, want) in cases {
            let file = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(file.path(), content).unwrap();
            let mut o = NatsOptions::new("nats://h:1");
            o.nkey_file = Some(file.path().into());
            let m = err(&o);
            assert!(m.contains(want), "{content:?}: {m}");
            assert!(content.is_empty() || !m.contains(content), "{m}");
            assert!(o.reply_prefix().is_err());
        }
        let mut o = NatsOptions::new("nats://h:1");
        o.nkey_file = Some("/nonexistent/seed.nk".into());
        assert!(err(&o).contains("/nonexistent/seed.nk"));
        let big = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(big.path(), "S".repeat(10_000)).unwrap();
        o.nkey_file = Some(big.path().into());
        assert!(err(&o).contains("10000 bytes"));
    }

    #[test]
    fn a_creds_file_seed_names_the_inbox_too() {
        let pair = nkeys::KeyPair::new_user();
        let creds = format!(
            "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.e30.sig\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            pair.seed().unwrap()
        );
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), creds).unwrap();
        let mut o = NatsOptions::new("nats://h:1");
        o.credentials_file = Some(file.path().into());
        assert_eq!(
            o.reply_prefix().unwrap(),
            Some(format!("_INBOX.{}", pair.public_key()))
        );
        assert_eq!(NatsOptions::new("nats://h:1").reply_prefix().unwrap(), None);
    }

    #[test]
    fn missing_credentials_file() {
        let mut o = NatsOptions::new("nats://h:1");
        o.credentials_file = Some("/nonexistent/x.creds".into());
        assert!(err(&o).contains("/nonexistent/x.creds"));
    }

    fn up(user: &str, password: &str) -> Option<UrlAuth> {
        Some(UrlAuth::UserPassword {
            user: user.into(),
            password: password.into(),
        })
    }

    #[test]
    fn url_credentials_are_split_out_and_decoded() {
        let split = |u: &str| split_userinfo(u).unwrap();
        assert_eq!(split("nats://h:4222"), ("nats://h:4222".into(), None));
        assert_eq!(
            split("nats://alice:s3cr%20et@127.0.0.1:4222"),
            ("nats://127.0.0.1:4222".into(), up("alice", "s3cr et"))
        );
        // An encoded '@' or ':' belongs to the password; an unencoded ':' after the first too.
        assert_eq!(
            split("nats://a%40b:p%40ss%3Aw:x@h:1"),
            ("nats://h:1".into(), up("a@b", "p@ss:w:x"))
        );
        assert_eq!(
            split("tls://t%2Fok@h:1"),
            ("tls://h:1".into(), Some(UrlAuth::Token("t/ok".into())))
        );
        assert_eq!(split("nats://u:@h"), ("nats://h".into(), up("u", "")));
        assert_eq!(split("nats://@h:1"), ("nats://h:1".into(), None));
        assert_eq!(split("u:p@h"), ("h".into(), up("u", "p")));
        assert_eq!(split("nats://h:1/x@y"), ("nats://h:1/x@y".into(), None));
        for bad in [
            "nats://u:100%@h",
            "nats://u:%zz@h",
            "nats://u:%ff@h",
            "nats://:p@h",
        ] {
            let e = split_userinfo(bad).unwrap_err();
            assert!(!e.contains("100") && !e.contains("zz"), "{bad}: {e}");
        }
    }

    #[test]
    fn url_credentials_conflict_with_other_auth_and_each_other() {
        let o = NatsOptions::new("nats://u:p@a:1, nats://b:2,nats://u:p@c:3");
        let (servers, auth) = o.split_url_auth().unwrap();
        assert_eq!(servers, ["nats://a:1", "nats://b:2", "nats://c:3"]);
        assert_eq!(auth, up("u", "p"));
        assert!(o.validate().is_ok());

        let m = err(&NatsOptions::new("nats://u:p@a:1,nats://u:q@b:2"));
        assert!(
            m.contains("different credentials") && !m.contains(":q@"),
            "{m}"
        );
        let m = err(&NatsOptions::new("nats://u:%zzsecret@a:1"));
        assert!(m.contains("'%'") && !m.contains("secret"), "{m}");

        let mut o = NatsOptions::new("nats://u:url-secret@h:1");
        o.user = Some("u".into());
        o.password = Some("flag-secret".into());
        let m = err(&o);
        assert!(
            m.contains("conflicting") && m.contains("credentials in the URL"),
            "{m}"
        );
        assert!(!m.contains("secret"), "{m}");
        let mut o = NatsOptions::new("nats://tok@h:1");
        o.token = Some("t".into());
        assert!(err(&o).contains("credentials in the URL and token"));
        let mut o = NatsOptions::new("nats://tok@h:1");
        o.credentials_file = Some("/nonexistent/x.creds".into());
        assert!(err(&o).contains("credentials in the URL and credentials file"));
    }

    #[test]
    fn redaction() {
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_url("nats://u:secret@h:4222"), "nats://u:***@h:4222");
        assert_eq!(redact_url("nats://tok@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("u:p@h"), "u:***@h");
        let o = NatsOptions::new("nats://u:p@a:1,nats://b:2");
        assert_eq!(o.redacted_url(), "nats://u:***@a:1,nats://b:2");
        let mut o = NatsOptions::new("nats://u:hunter2@h:1");
        o.user = Some("x".into());
        assert!(!err(&o).contains("hunter2"));
        o.password = Some("pw-secret".into());
        o.token = Some("tok-secret".into());
        let debug = format!("{o:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("secret"),
            "{debug}"
        );
    }
}
