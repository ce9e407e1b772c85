//! The HTTP client bounds and TLS: one group, flattened into every command that listens
//! (`serve`, `frontend`, `bridge`), so a slow or half-open client is cut the same way
//! everywhere and every listener can serve HTTPS (and mTLS). The bearer tokens of the
//! replica's JSON API and debug pages ([`HttpAuthArgs`]) are `serve`'s alone: the frontend
//! has its own API keys, the bridge serves only health and metrics.

use anyhow::Context;
use clap::Args;
use kvrouter_admin::auth::{parse_tokens_file, BearerToken, MAX_TOKENS_FILE_BYTES};
use kvrouter_admin::secret;
use kvrouter_admin::{HttpAuth, HttpLimits, Scopes, ServerTls, TlsFiles};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// Seconds a client may take from a request head's first byte to its end.
    #[arg(
        long,
        env = "KVROUTER_HTTP_HEADER_TIMEOUT_SECS",
        default_value_t = 10.0
    )]
    pub http_header_timeout_secs: f64,
    /// Seconds a client may take to send a request body once its head has come (408 after).
    #[arg(long, env = "KVROUTER_HTTP_BODY_TIMEOUT_SECS", default_value_t = 30.0)]
    pub http_body_timeout_secs: f64,
    /// Seconds a connection may sit with no request in flight before it is closed; also how
    /// long an answer may wait for a client that does not read it.
    #[arg(long, env = "KVROUTER_HTTP_IDLE_TIMEOUT_SECS", default_value_t = 60.0)]
    pub http_idle_timeout_secs: f64,
    /// Client connections open at once per listener; one more is answered 503 and closed.
    #[arg(long, env = "KVROUTER_HTTP_MAX_CONNECTIONS", default_value_t = 4096)]
    pub http_max_connections: usize,
    /// Largest request head (request line and headers) in bytes; a longer one gets 431.
    #[arg(long, env = "KVROUTER_HTTP_MAX_HEADER_BYTES", default_value_t = 64 << 10)]
    pub http_max_header_bytes: usize,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --http-tls-key. The
    /// TLS handshake must end within --http-header-timeout-secs.
    #[arg(long, env = "KVROUTER_HTTP_TLS_CERT", requires = "http_tls_key")]
    pub http_tls_cert: Option<PathBuf>,
    /// The private key of --http-tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "KVROUTER_HTTP_TLS_KEY", requires = "http_tls_cert")]
    pub http_tls_key: Option<PathBuf>,
    /// mTLS: require a client certificate signed by a CA in this PEM file; clients without
    /// one fail the handshake.
    #[arg(long, env = "KVROUTER_HTTP_TLS_CLIENT_CA", requires = "http_tls_cert")]
    pub http_tls_client_ca: Option<PathBuf>,
}

impl HttpArgs {
    pub fn limits(&self) -> anyhow::Result<HttpLimits> {
        let secs = |flag: &str, v: f64| -> anyhow::Result<Duration> {
            if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                anyhow::bail!("--{flag} must be above 0 and at most 86400 seconds, not {v}");
            }
            Ok(Duration::from_secs_f64(v))
        };
        let limits = HttpLimits {
            header_timeout: secs("http-header-timeout-secs", self.http_header_timeout_secs)?,
            body_timeout: secs("http-body-timeout-secs", self.http_body_timeout_secs)?,
            idle_timeout: secs("http-idle-timeout-secs", self.http_idle_timeout_secs)?,
            max_connections: self.http_max_connections,
            max_header_bytes: self.http_max_header_bytes,
            tls: self.tls()?,
            auth: HttpAuth::open(),
        };
        limits.validate().map_err(anyhow::Error::msg)?;
        Ok(limits)
    }

    fn tls(&self) -> anyhow::Result<Option<ServerTls>> {
        let (Some(cert), Some(key)) = (&self.http_tls_cert, &self.http_tls_key) else {
            return Ok(None);
        };
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.http_tls_client_ca.clone(),
        };
        Ok(Some(ServerTls::load(&files).context("--http-tls-*")?))
    }
}

/// Who may call a replica's JSON API and debug pages (docs/operations.md, "Who may call the
/// HTTP doors"). No `Debug`: it holds a secret.
#[derive(Args, Clone)]
pub struct HttpAuthArgs {
    /// Bearer tokens for the JSON API and /debug pages, one a line with its scopes
    /// (`TOKEN route,lease`; scopes route, lease, debug, metrics or all; `#` comments).
    /// Without tokens every caller may do everything.
    #[arg(long, env = "KVROUTER_HTTP_TOKENS_FILE")]
    pub http_tokens_file: Option<PathBuf>,
    /// One more bearer token, with --http-token-scopes (prefer the environment variable:
    /// a flag shows in `ps`).
    #[arg(long, env = "KVROUTER_HTTP_TOKEN", hide_env_values = true)]
    pub http_token: Option<String>,
    /// The scopes of --http-token (comma-separated: route, lease, debug, metrics, or all).
    #[arg(long, env = "KVROUTER_HTTP_TOKEN_SCOPES", default_value = "all")]
    pub http_token_scopes: String,
    /// Require the `metrics` scope on /metrics too (/healthz and /readyz stay open).
    #[arg(long, env = "KVROUTER_HTTP_AUTH_METRICS")]
    pub http_auth_metrics: bool,
    /// The scopes a verified client certificate (--http-tls-client-ca) stands for when a
    /// call carries no token; without it a certificate only admits the connection.
    #[arg(long, env = "KVROUTER_HTTP_TLS_CLIENT_SCOPES")]
    pub http_tls_client_scopes: Option<String>,
}

impl HttpAuthArgs {
    /// The credentials, read and checked: an empty or short token, an unknown scope or an
    /// empty file stops the start. `http` says whether client certificates are verified.
    pub fn auth(&self, http: &HttpArgs) -> anyhow::Result<HttpAuth> {
        let mut tokens = Vec::new();
        if let Some(path) = &self.http_tokens_file {
            let what = || format!("--http-tokens-file {}", path.display());
            let bytes = secret::read_file(path, MAX_TOKENS_FILE_BYTES).with_context(what)?;
            let text = String::from_utf8(bytes)
                .map_err(|_| anyhow::anyhow!("{} is not UTF-8 text", what()))?;
            tokens = parse_tokens_file(&text, &path.display().to_string())?;
        }
        if let Some(token) = &self.http_token {
            let scopes = Scopes::parse(&self.http_token_scopes).context("--http-token-scopes")?;
            tokens.push(BearerToken::new(
                token,
                scopes,
                "--http-token (KVROUTER_HTTP_TOKEN)",
            )?);
        }
        let cert_scopes = match &self.http_tls_client_scopes {
            None => Scopes::NONE,
            Some(_) if http.http_tls_client_ca.is_none() => anyhow::bail!(
                "--http-tls-client-scopes needs --http-tls-client-ca: only a verified client certificate may stand for scopes"
            ),
            Some(list) => Scopes::parse(list).context("--http-tls-client-scopes")?,
        };
        if self.http_auth_metrics && tokens.is_empty() && cert_scopes.is_empty() {
            anyhow::bail!(
                "--http-auth-metrics needs credentials to check: give --http-tokens-file, --http-token or --http-tls-client-scopes"
            );
        }
        Ok(HttpAuth::new(tokens, cert_scopes, self.http_auth_metrics)?)
    }
}

/// Says once, at startup, who may call the listeners at `addrs` (serving the JSON API and
/// debug pages): a warning when anyone may.
pub fn log_doors(auth: &HttpAuth, http: &HttpArgs, addrs: &[SocketAddr]) {
    if addrs.is_empty() {
        return;
    }
    let scheme = if http.http_tls_cert.is_some() {
        "https"
    } else {
        "http"
    };
    if !auth.is_open() {
        tracing::info!(
            listeners = ?addrs,
            scheme,
            tokens = auth.token_count(),
            metrics_guarded = auth.guards_metrics(),
            "the JSON API and /debug pages need a bearer token (or a client certificate) with the right scope"
        );
    } else if http.http_tls_client_ca.is_some() {
        tracing::info!(
            listeners = ?addrs,
            "no bearer tokens: every client with a certificate from --http-tls-client-ca may route, act on any routed request and read /debug pages"
        );
    } else {
        tracing::warn!(
            listeners = ?addrs,
            "the JSON API and /debug pages are unauthenticated: anyone who reaches these ports may route and book load and read cached block hashes (ending a request still takes its lease); give --http-tokens-file or --http-token (docs/operations.md, \"Who may call the HTTP doors\")"
        );
    }
}
