//! How every networked command reaches NATS: `#[command(flatten)] nats: NatsArgs`.

use clap::Args;
use kvrouter_bus::{Bus, NatsOptions, DEFAULT_NATS_URL};
use std::path::PathBuf;

/// NATS connection and namespace flags, shared by every command that talks to the bus.
#[derive(Args, Clone, Debug)]
pub struct NatsArgs {
    /// NATS server URL, or a comma-separated list. Credentials may be in the URL:
    /// nats://user:password@host:4222 or nats://token@host:4222, percent-encoded (%40 for @,
    /// %3A for :, %20 for a space, %25 for %); giving them also with --nats-user, --nats-token,
    /// --nats-creds or --nats-nkey-file is refused.
    #[arg(long = "nats", env = "KVROUTER_NATS", default_value = DEFAULT_NATS_URL, value_name = "URL")]
    pub url: String,
    /// NATS user (with --nats-password).
    #[arg(long, env = "KVROUTER_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(long, env = "KVROUTER_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS authentication token.
    #[arg(long, env = "KVROUTER_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// NATS credentials file (.creds: user JWT and nkey seed).
    #[arg(long, env = "KVROUTER_NATS_CREDS", value_name = "FILE")]
    pub nats_creds: Option<PathBuf>,
    /// File holding this process's NATS user nkey seed (one line, SU...; `kvrouter creds`
    /// writes them). Its reply subjects become _INBOX.<public key>, so permissions can let it
    /// read only its own replies. Not with the other authentication flags. Keep the file
    /// readable by this process only (a warning says when every user may read it).
    #[arg(long, env = "KVROUTER_NATS_NKEY_FILE", value_name = "FILE")]
    pub nats_nkey_file: Option<PathBuf>,
    /// Prefix of this process's reply subjects (default _INBOX, or _INBOX.<public key> with
    /// an nkey or a .creds file), for permissions that confine each user's replies.
    #[arg(long, env = "KVROUTER_NATS_INBOX_PREFIX", value_name = "SUBJECT")]
    pub nats_inbox_prefix: Option<String>,
    /// PEM file with the CA certificate(s) that signed the server's certificate.
    #[arg(long, env = "KVROUTER_NATS_TLS_CA", value_name = "FILE")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with --nats-tls-key).
    #[arg(long, env = "KVROUTER_NATS_TLS_CERT", value_name = "FILE")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long, env = "KVROUTER_NATS_TLS_KEY", value_name = "FILE")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    #[arg(long, env = "KVROUTER_NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// Namespace of every subject, so several fleets can share one NATS.
    #[arg(
        long,
        env = "KVROUTER_NAMESPACE",
        default_value = "kvrouter",
        value_name = "NS"
    )]
    pub namespace: String,
    /// Wire format version this process writes: the current one (8), or 7 while a fleet is
    /// upgraded from version-7 builds, so they read everything (set it on every upgraded
    /// process until none of the old ones is left). Answers always follow their request.
    #[arg(long, env = "KVROUTER_WIRE_VERSION", default_value_t = kvrouter_protocol::FORMAT_VERSION,
          value_parser = clap::value_parser!(u8).range(kvrouter_protocol::MIN_READ_VERSION as i64..=kvrouter_protocol::FORMAT_VERSION as i64))]
    pub wire_version: u8,
}

impl NatsArgs {
    /// Connection options; `name` is the connection name the server shows (`/connz`).
    pub fn options(&self, name: &str) -> NatsOptions {
        NatsOptions {
            url: self.url.clone(),
            user: self.nats_user.clone(),
            password: self.nats_password.clone(),
            token: self.nats_token.clone(),
            credentials_file: self.nats_creds.clone(),
            nkey_file: self.nats_nkey_file.clone(),
            inbox_prefix: self.nats_inbox_prefix.clone(),
            tls_ca_file: self.nats_tls_ca.clone(),
            tls_client_cert: self.nats_tls_cert.clone(),
            tls_client_key: self.nats_tls_key.clone(),
            tls_required: self.nats_tls_required,
            name: Some(name.to_string()),
            ..NatsOptions::default()
        }
    }

    /// Connects to NATS; the error names the (redacted) URL already.
    pub async fn connect(&self, name: &str) -> anyhow::Result<Bus> {
        kvrouter_protocol::set_write_version(self.wire_version)?;
        Ok(Bus::connect(&self.options(name)).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{FORMAT_VERSION, MIN_READ_VERSION};

    /// The help names the versions the codec writes and reads (a doc comment cannot take
    /// the constants: this keeps it honest when they move).
    #[test]
    fn wire_version_help_names_the_current_and_the_previous_version() {
        let cmd = NatsArgs::augment_args(clap::Command::new("t"));
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "wire_version")
            .expect("--wire-version");
        let help = arg.get_long_help().or(arg.get_help()).unwrap().to_string();
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        for want in [
            format!("the current one ({FORMAT_VERSION})"),
            format!("or {MIN_READ_VERSION} while"),
            format!("from version-{MIN_READ_VERSION} builds"),
        ] {
            assert!(help.contains(&want), "{want:?} not in {help:?}");
        }
        assert_eq!(
            arg.get_default_values(),
            [FORMAT_VERSION.to_string().as_str()]
        );
    }
}
