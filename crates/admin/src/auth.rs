//! Who may call an HTTP door: bearer tokens, each with its scopes, and (with mTLS) the
//! scopes a verified client certificate stands for.
//!
//! [`HttpAuth`] is the plain core: it parses tokens files, keeps each token as its SHA-256
//! digest only, and decides one call from its `Authorization` header and whether its
//! connection showed a verified client certificate. Tokens are compared as
//! [`crate::secret`] compares every secret: in constant time, all of them, so neither a
//! token nor its length leaks through timing. The admin endpoint ([`crate::serve`]) checks
//! its `/v1/`, `/debug/` and (on request) `/metrics` paths through it; any other handler on
//! [`crate::HttpServer`] may call [`HttpAuth::check`] for the paths it guards.

use crate::secret::{self, SecretDigest};
use hyper::header::AUTHORIZATION;
use std::fmt;
use std::sync::Arc;

/// The shortest token accepted: shorter ones are guessable.
pub const MIN_TOKEN_BYTES: usize = 16;
/// The longest token accepted (a file line or a header beyond this is a mistake).
pub const MAX_TOKEN_BYTES: usize = 4096;
/// The largest tokens file read (a bigger one is the wrong file).
pub const MAX_TOKENS_FILE_BYTES: usize = 1 << 20;

/// What a caller may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// `POST /v1/route`, `GET /v1/workers`.
    Route,
    /// `POST /v1/requests/{id}/prefill_done`, `.../free`, `.../output_block`.
    Lease,
    /// `/debug/...` pages (they show cached block hashes).
    Debug,
    /// `/metrics`, when the operator guards it (`--http-auth-metrics`).
    Metrics,
}

impl Scope {
    pub const ALL: [Scope; 4] = [Scope::Route, Scope::Lease, Scope::Debug, Scope::Metrics];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Lease => "lease",
            Self::Debug => "debug",
            Self::Metrics => "metrics",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of [`Scope`]s.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Scopes(u8);

impl Scopes {
    pub const NONE: Scopes = Scopes(0);

    pub fn all() -> Self {
        Scope::ALL.into_iter().collect()
    }

    pub fn contains(self, s: Scope) -> bool {
        self.0 & s.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// A list such as `route,lease` or `route lease` (`all` for every scope); empty or
    /// naming an unknown scope is an error.
    pub fn parse(list: &str) -> Result<Self, AuthConfigError> {
        let mut scopes = Scopes::NONE;
        for word in list
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
        {
            if word == "all" {
                scopes = Scopes::all();
                continue;
            }
            let s = Scope::ALL
                .into_iter()
                .find(|s| s.as_str() == word)
                .ok_or_else(|| AuthConfigError::UnknownScope(word.chars().take(64).collect()))?;
            scopes.0 |= s.bit();
        }
        if scopes.is_empty() {
            return Err(AuthConfigError::NoScopes);
        }
        Ok(scopes)
    }
}

impl FromIterator<Scope> for Scopes {
    fn from_iter<I: IntoIterator<Item = Scope>>(iter: I) -> Self {
        Scopes(iter.into_iter().fold(0, |b, s| b | s.bit()))
    }
}

impl fmt::Display for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Scope::ALL
            .into_iter()
            .filter(|s| self.contains(*s))
            .map(Scope::as_str)
            .collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

impl fmt::Debug for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scopes({self})")
    }
}

/// Why a token or tokens file is refused at startup.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AuthConfigError {
    #[error("a token is empty")]
    EmptyToken,
    #[error(
        "a token is {0} bytes; at least {MIN_TOKEN_BYTES} are needed (e.g. `openssl rand -hex 32`)"
    )]
    TooShort(usize),
    #[error("a token is over {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    #[error("a token may hold only letters, digits and - . _ ~ + / = (RFC 6750)")]
    BadCharacters,
    #[error("a token needs its scopes: one or more of route, lease, debug, metrics (or all)")]
    NoScopes,
    #[error("unknown scope {0:?}: the scopes are route, lease, debug, metrics (or all)")]
    UnknownScope(String),
    #[error("{what}: {source}")]
    At {
        /// Where: `FILE line N`, `--http-token`.
        what: String,
        source: Box<AuthConfigError>,
    },
    #[error("{0} is given twice ({1} has it too)")]
    Duplicate(String, String),
    #[error(
        "{0} holds no token (only blank lines and comments): give tokens, or do not give the file"
    )]
    EmptyFile(String),
}

impl AuthConfigError {
    fn at(self, what: impl Into<String>) -> Self {
        Self::At {
            what: what.into(),
            source: Box::new(self),
        }
    }
}

/// One configured token: its digest and scopes, and where it came from (for errors). The
/// secret itself is not kept.
#[derive(Clone)]
pub struct BearerToken {
    digest: SecretDigest,
    scopes: Scopes,
    origin: String,
}

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BearerToken({}, {})", self.origin, self.scopes)
    }
}

/// RFC 6750's `b64token` characters.
fn token_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"-._~+/=".contains(&c)
}

impl BearerToken {
    /// `secret` with `scopes`; `origin` names where it came from in errors
    /// (`--http-token`, `tokens.txt line 3`).
    pub fn new(secret: &str, scopes: Scopes, origin: &str) -> Result<Self, AuthConfigError> {
        let check = || {
            let b = secret.as_bytes();
            if b.is_empty() {
                return Err(AuthConfigError::EmptyToken);
            }
            if b.len() > MAX_TOKEN_BYTES {
                return Err(AuthConfigError::TooLong);
            }
            if !b.iter().all(|&c| token_char(c)) {
                return Err(AuthConfigError::BadCharacters);
            }
            if b.len() < MIN_TOKEN_BYTES {
                return Err(AuthConfigError::TooShort(b.len()));
            }
            if scopes.is_empty() {
                return Err(AuthConfigError::NoScopes);
            }
            Ok(())
        };
        check().map_err(|e| e.at(origin))?;
        Ok(Self {
            digest: SecretDigest::of(secret.as_bytes()),
            scopes,
            origin: origin.to_string(),
        })
    }

    pub fn scopes(&self) -> Scopes {
        self.scopes
    }
}

/// A tokens file: one token a line followed by its scopes (`TOKEN route,lease`), blank
/// lines and `#` comments (whole lines, or after the scopes) ignored. `name` says where the
/// text came from in errors. No token at all is an error: an empty file must not turn
/// authentication off.
pub fn parse_tokens_file(text: &str, name: &str) -> Result<Vec<BearerToken>, AuthConfigError> {
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split_once('#').map_or(line, |(l, _)| l).trim();
        if line.is_empty() {
            continue;
        }
        let origin = format!("{name} line {}", i + 1);
        let (secret, scopes) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let scopes = Scopes::parse(scopes).map_err(|e| e.at(&origin))?;
        tokens.push(BearerToken::new(secret, scopes, &origin)?);
    }
    if tokens.is_empty() {
        return Err(AuthConfigError::EmptyFile(name.to_string()));
    }
    Ok(tokens)
}

/// Why a call was refused: its metric label, status and answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header and no client certificate that stands for scopes.
    Missing,
    /// An `Authorization` header that is not one `Bearer TOKEN`.
    Malformed,
    /// A bearer token that is none of the configured ones.
    InvalidToken,
    /// A valid token or certificate without the scope the call needs.
    InsufficientScope(Scope),
}

impl Refusal {
    /// Every label of [`Refusal::reason`], for metrics.
    pub const REASONS: [&'static str; 4] = [
        "missing",
        "malformed",
        "invalid_token",
        "insufficient_scope",
    ];

    /// The metric label.
    pub fn reason(self) -> &'static str {
        Self::REASONS[self.index()]
    }

    /// The position of [`Refusal::reason`] in [`Refusal::REASONS`].
    pub fn index(self) -> usize {
        match self {
            Self::Missing => 0,
            Self::Malformed => 1,
            Self::InvalidToken => 2,
            Self::InsufficientScope(_) => 3,
        }
    }

    /// 401, or 403 for a caller known but not allowed.
    pub fn status(self) -> u16 {
        match self {
            Self::InsufficientScope(_) => 403,
            _ => 401,
        }
    }

    /// The JSON error kind: `unauthenticated` (401) or `forbidden` (403).
    pub fn kind(self) -> &'static str {
        match self {
            Self::InsufficientScope(_) => "forbidden",
            _ => "unauthenticated",
        }
    }

    /// The `WWW-Authenticate` header (RFC 6750, section 3).
    pub fn www_authenticate(self) -> String {
        match self {
            Self::Missing => r#"Bearer realm="kvrouter""#.into(),
            Self::Malformed => r#"Bearer realm="kvrouter", error="invalid_request""#.into(),
            Self::InvalidToken => r#"Bearer realm="kvrouter", error="invalid_token""#.into(),
            Self::InsufficientScope(s) => {
                format!(r#"Bearer realm="kvrouter", error="insufficient_scope", scope="{s}""#)
            }
        }
    }

    /// What the caller is told (never the token).
    pub fn message(self, path: &str) -> String {
        match self {
            Self::Missing => {
                format!("{path} needs an `Authorization: Bearer TOKEN` header")
            }
            Self::Malformed => "the Authorization header must be one `Bearer TOKEN`".into(),
            Self::InvalidToken => "the bearer token is not valid here".into(),
            Self::InsufficientScope(s) => {
                format!("{path} needs the {s:?} scope, which this credential does not have")
            }
        }
    }
}

/// The `Authorization` headers of a call, as far as [`HttpAuth::decide`] cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authorization<'a> {
    None,
    One(&'a [u8]),
    /// More than one header: ambiguous, refused.
    Many,
}

/// Put into a request's extensions by [`crate::HttpServer`] when its connection presented a
/// client certificate that the listener's CA verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifiedClientCert;

struct Inner {
    tokens: Vec<BearerToken>,
    cert_scopes: Scopes,
    guard_metrics: bool,
}

/// Who may call a listener. Open (everyone may do everything) unless tokens or client
/// certificate scopes are configured. Cheap to clone.
#[derive(Clone)]
pub struct HttpAuth(Arc<Inner>);

impl Default for HttpAuth {
    fn default() -> Self {
        Self::open()
    }
}

impl fmt::Debug for HttpAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the digests: only how many tokens and what they may do.
        f.debug_struct("HttpAuth")
            .field("tokens", &self.0.tokens)
            .field("client_cert_scopes", &self.0.cert_scopes)
            .field("guard_metrics", &self.0.guard_metrics)
            .finish()
    }
}

impl PartialEq for HttpAuth {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for HttpAuth {}

impl HttpAuth {
    /// No authentication: every call is allowed.
    pub fn open() -> Self {
        Self(Arc::new(Inner {
            tokens: Vec::new(),
            cert_scopes: Scopes::NONE,
            guard_metrics: false,
        }))
    }

    /// `tokens`; `cert_scopes` for a call without a token whose connection showed a verified
    /// client certificate; `guard_metrics` to require the `metrics` scope on `/metrics`.
    /// The same token twice is refused (its scopes would be ambiguous).
    pub fn new(
        tokens: Vec<BearerToken>,
        cert_scopes: Scopes,
        guard_metrics: bool,
    ) -> Result<Self, AuthConfigError> {
        for (i, t) in tokens.iter().enumerate() {
            if let Some(first) = tokens[..i].iter().find(|o| o.digest == t.digest) {
                return Err(AuthConfigError::Duplicate(
                    format!("the token of {}", t.origin),
                    first.origin.clone(),
                ));
            }
        }
        Ok(Self(Arc::new(Inner {
            tokens,
            cert_scopes,
            guard_metrics,
        })))
    }

    /// True when no credential is configured: every call is allowed.
    pub fn is_open(&self) -> bool {
        self.0.tokens.is_empty() && self.0.cert_scopes.is_empty()
    }

    /// Whether `/metrics` needs the `metrics` scope.
    pub fn guards_metrics(&self) -> bool {
        self.0.guard_metrics && !self.is_open()
    }

    pub fn token_count(&self) -> usize {
        self.0.tokens.len()
    }

    /// The scopes a presented token holds; `None` when it is none of the configured ones.
    /// Every configured token is compared, in constant time.
    fn lookup(&self, token: &[u8]) -> Option<Scopes> {
        secret::lookup(self.0.tokens.iter().map(|t| (&t.digest, t.scopes.0)), token).map(Scopes)
    }

    /// May a call with these credentials do what needs `need`? `need: None` asks only that
    /// the caller be known (any valid credential), e.g. before answering 404.
    pub fn decide(
        &self,
        authorization: Authorization<'_>,
        client_cert: bool,
        need: Option<Scope>,
    ) -> Result<(), Refusal> {
        if self.is_open() {
            return Ok(());
        }
        let scopes = match authorization {
            Authorization::Many => return Err(Refusal::Malformed),
            Authorization::One(h) => {
                let token = secret::bearer(h, MAX_TOKEN_BYTES).ok_or(Refusal::Malformed)?;
                self.lookup(token).ok_or(Refusal::InvalidToken)?
            }
            Authorization::None if client_cert && !self.0.cert_scopes.is_empty() => {
                self.0.cert_scopes
            }
            Authorization::None => return Err(Refusal::Missing),
        };
        match need {
            Some(s) if !scopes.contains(s) => Err(Refusal::InsufficientScope(s)),
            _ => Ok(()),
        }
    }

    /// [`HttpAuth::decide`] for a request: its `Authorization` headers and whether
    /// [`crate::HttpServer`] marked it [`VerifiedClientCert`].
    pub fn check<B>(&self, req: &hyper::Request<B>, need: Option<Scope>) -> Result<(), Refusal> {
        if self.is_open() {
            return Ok(());
        }
        let mut values = req.headers().get_all(AUTHORIZATION).iter();
        let authorization = match (values.next(), values.next()) {
            (None, _) => Authorization::None,
            (Some(v), None) => Authorization::One(v.as_bytes()),
            _ => Authorization::Many,
        };
        let cert = req.extensions().get::<VerifiedClientCert>().is_some();
        self.decide(authorization, cert, need)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTE: &str = "route-token-0123456789";
    const OPS: &str = "ops-token-abcdefghijkl";
    const ALL: &str = "all-token-ABCDEFGHIJKL";

    fn auth() -> HttpAuth {
        let file = format!(
            "# peer routers\n{ROUTE} route,lease\n\n  {OPS}   debug metrics  # the on-call\n"
        );
        let mut tokens = parse_tokens_file(&file, "tokens.txt").unwrap();
        tokens.push(BearerToken::new(ALL, Scopes::all(), "--http-token").unwrap());
        HttpAuth::new(tokens, Scopes::NONE, false).unwrap()
    }

    fn header(token: &str) -> String {
        format!("Bearer {token}")
    }

    fn call(a: &HttpAuth, h: Option<&str>, need: Scope) -> Result<(), Refusal> {
        let authz = h.map_or(Authorization::None, |h| Authorization::One(h.as_bytes()));
        a.decide(authz, false, Some(need))
    }

    #[test]
    fn tokens_file_lines_scopes_and_comments() {
        let t = parse_tokens_file(
            &format!("{ROUTE} route\n#{OPS} debug\n{OPS} debug,lease # two\n"),
            "f",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].scopes(), Scopes::parse("route").unwrap());
        assert_eq!(t[1].scopes().to_string(), "lease,debug");
        assert_eq!(Scopes::parse("all").unwrap(), Scopes::all());
        assert_eq!(Scopes::all().to_string(), "route,lease,debug,metrics");
        // The secret is not in Debug.
        let dbg = format!("{:?} {:?}", t, auth());
        assert!(!dbg.contains(ROUTE) && !dbg.contains(OPS), "{dbg}");
        assert!(dbg.contains("f line 1"), "{dbg}");
    }

    #[test]
    fn bad_tokens_files_are_refused_saying_where() {
        let err = |text: &str| parse_tokens_file(text, "t.txt").unwrap_err().to_string();
        assert_eq!(
            err("# nothing\n\n"),
            "t.txt holds no token (only blank lines and comments): give tokens, or do not give the file"
        );
        assert_eq!(err(""), err("   \n# x"));
        assert!(err("short route").starts_with("t.txt line 1: a token is 5 bytes; at least 16"));
        assert!(err(&format!("{ROUTE}\n")).contains("t.txt line 1: a token needs its scopes"));
        assert!(err(&format!("\n{ROUTE} route,admin"))
            .starts_with("t.txt line 2: unknown scope \"admin\""));
        assert!(err(&format!("{ROUTE}\u{e9}xyz route")).contains("only letters, digits"));
        assert!(err(&format!("{} route", "a".repeat(5000))).contains("over 4096 bytes"));
        let dup = format!("{ROUTE} route\n{OPS} debug\n{ROUTE} lease\n");
        let tokens = parse_tokens_file(&dup, "t.txt").unwrap();
        assert_eq!(
            HttpAuth::new(tokens, Scopes::NONE, false)
                .unwrap_err()
                .to_string(),
            "the token of t.txt line 3 is given twice (t.txt line 1 has it too)"
        );
        assert_eq!(
            BearerToken::new("", Scopes::all(), "--http-token")
                .unwrap_err()
                .to_string(),
            "--http-token: a token is empty"
        );
        assert_eq!(Scopes::parse(" , ").unwrap_err(), AuthConfigError::NoScopes);
    }

    #[test]
    fn each_scope_is_needed_for_its_calls() {
        let a = auth();
        assert!(!a.is_open());
        assert_eq!(call(&a, Some(&header(ROUTE)), Scope::Route), Ok(()));
        assert_eq!(call(&a, Some(&header(ROUTE)), Scope::Lease), Ok(()));
        assert_eq!(
            call(&a, Some(&header(ROUTE)), Scope::Debug),
            Err(Refusal::InsufficientScope(Scope::Debug))
        );
        assert_eq!(call(&a, Some(&header(OPS)), Scope::Debug), Ok(()));
        assert_eq!(call(&a, Some(&header(OPS)), Scope::Metrics), Ok(()));
        assert_eq!(
            call(&a, Some(&header(OPS)), Scope::Route),
            Err(Refusal::InsufficientScope(Scope::Route))
        );
        for s in Scope::ALL {
            assert_eq!(call(&a, Some(&header(ALL)), s), Ok(()));
        }
        // The scheme is case-insensitive; extra spaces around the token are tolerated.
        assert_eq!(
            call(&a, Some(&format!("bEaReR   {ROUTE} ")), Scope::Route),
            Ok(())
        );
        // Any valid credential may see a 404.
        assert_eq!(
            a.decide(Authorization::One(header(OPS).as_bytes()), false, None),
            Ok(())
        );
    }

    #[test]
    fn unknown_missing_and_malformed_credentials_are_told_apart() {
        let a = auth();
        assert_eq!(call(&a, None, Scope::Route), Err(Refusal::Missing));
        for bad in [
            "Basic dXNlcjpwYXNz",
            "Bearer",
            "Bearer ",
            "Bearer\tx",
            ROUTE,
            "Bearerroute-token-0123456789",
        ] {
            assert_eq!(
                call(&a, Some(bad), Scope::Route),
                Err(Refusal::Malformed),
                "{bad}"
            );
        }
        // A prefix, an extension, another case of the same token: unknown.
        for wrong in [&ROUTE[..20], &format!("{ROUTE}x"), &ROUTE.to_uppercase()] {
            assert_eq!(
                call(&a, Some(&header(wrong)), Scope::Route),
                Err(Refusal::InvalidToken),
                "{wrong}"
            );
        }
        assert_eq!(
            a.decide(Authorization::Many, false, Some(Scope::Route)),
            Err(Refusal::Malformed)
        );
        assert_eq!(Refusal::Missing.status(), 401);
        assert_eq!(Refusal::InvalidToken.kind(), "unauthenticated");
        let forbidden = Refusal::InsufficientScope(Scope::Debug);
        assert_eq!((forbidden.status(), forbidden.kind()), (403, "forbidden"));
        assert!(forbidden.www_authenticate().contains(r#"scope="debug""#));
        assert_eq!(forbidden.reason(), "insufficient_scope");
        assert!(Refusal::Missing.www_authenticate().starts_with("Bearer"));
    }

    #[test]
    fn open_unless_configured_and_client_certificates_stand_for_their_scopes() {
        let open = HttpAuth::open();
        assert!(open.is_open() && !open.guards_metrics());
        assert_eq!(call(&open, None, Scope::Debug), Ok(()));
        assert_eq!(call(&open, Some("garbage"), Scope::Lease), Ok(()));
        // Guarding metrics means nothing without credentials to guard them with.
        assert!(!HttpAuth::new(Vec::new(), Scopes::NONE, true)
            .unwrap()
            .guards_metrics());

        let certs = HttpAuth::new(Vec::new(), Scopes::parse("route,lease").unwrap(), true).unwrap();
        assert!(!certs.is_open() && certs.guards_metrics());
        assert_eq!(
            certs.decide(Authorization::None, true, Some(Scope::Route)),
            Ok(())
        );
        assert_eq!(
            certs.decide(Authorization::None, true, Some(Scope::Debug)),
            Err(Refusal::InsufficientScope(Scope::Debug))
        );
        assert_eq!(
            certs.decide(Authorization::None, false, Some(Scope::Route)),
            Err(Refusal::Missing)
        );
        // A token, when given, decides (a wrong one is not rescued by the certificate).
        assert_eq!(
            certs.decide(
                Authorization::One(header(ROUTE).as_bytes()),
                true,
                Some(Scope::Route)
            ),
            Err(Refusal::InvalidToken)
        );
        // Without certificate scopes, a certificate alone is no credential.
        assert_eq!(
            auth().decide(Authorization::None, true, Some(Scope::Route)),
            Err(Refusal::Missing)
        );
    }

    #[test]
    fn requests_are_checked_by_their_headers_and_certificate_mark() {
        let a = auth();
        let req = |h: &[&str]| {
            let mut b = hyper::Request::builder().uri("/v1/route");
            for v in h {
                b = b.header(AUTHORIZATION, *v);
            }
            b.body(()).unwrap()
        };
        assert_eq!(a.check(&req(&[&header(ROUTE)]), Some(Scope::Route)), Ok(()));
        assert_eq!(
            a.check(&req(&[&header(ROUTE), &header(ALL)]), Some(Scope::Route)),
            Err(Refusal::Malformed)
        );
        let certs = HttpAuth::new(Vec::new(), Scopes::all(), false).unwrap();
        let mut marked = req(&[]);
        assert_eq!(
            certs.check(&marked, Some(Scope::Debug)),
            Err(Refusal::Missing)
        );
        marked.extensions_mut().insert(VerifiedClientCert);
        assert_eq!(certs.check(&marked, Some(Scope::Debug)), Ok(()));
    }
}
