//! The hostile fleet runs locked, as docs/operations.md says to deploy it: one NATS identity
//! per role (`kvrouter creds`, the real binary, writes the seeds and the users file),
//! bearer tokens on the replicas' JSON API, API keys on the frontend. The honest clients
//! hold one set of credentials; the attackers hold their own valid ones (a tenant of the
//! same API, a spare bridge's seed, a frontend's seed), so what stops them is what the
//! fleet checks, not a missing password.

use kvrouter_protocol::Lease;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Seeds, the nats-server configuration, the tokens and keys files of one run, in a
/// temporary directory removed when this is dropped.
pub struct FleetCredentials {
    dir: tempfile::TempDir,
    /// `route,lease` on the replicas' JSON API: the honest route clients.
    pub honest_token: String,
    /// `route,lease` too: another tenant of the same API (every attacker's token).
    pub tenant_token: String,
    /// The honest completion clients' frontend key (no grants).
    pub honest_key: String,
    /// The attackers' frontend key, with both grants (routing extension, overlap header):
    /// the attacks on the extension's bounds need it to be parsed at all.
    pub tenant_key: String,
}

/// Why the credentials could not be made.
#[derive(Debug, thiserror::Error)]
#[error("hostile fleet credentials: {0}")]
pub struct CredentialsError(String);

/// A fresh 128-bit secret, as 32 hexadecimal digits.
fn secret() -> String {
    Lease::random().to_hex()
}

impl FleetCredentials {
    /// Runs `exe creds` for these replicas and workers (and one frontend and one peer
    /// identity) in `namespace`, and writes the rest.
    pub fn generate(
        exe: &Path,
        namespace: &str,
        replica_ids: &[String],
        worker_ids: &[u64],
    ) -> Result<Self, CredentialsError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| CredentialsError(format!("{what}: {e}"));
        let dir = tempfile::Builder::new()
            .prefix("kvrouter-hostile-")
            .tempdir()
            .map_err(|e| fail("temporary directory", &e))?;
        let workers: Vec<String> = worker_ids.iter().map(u64::to_string).collect();
        let out = Command::new(exe)
            .arg("creds")
            .arg("--out")
            .arg(dir.path())
            .args(["--namespace", namespace])
            .args(["--replica-ids", &replica_ids.join(",")])
            .args(["--worker-ids", &workers.join(",")])
            .args(["--frontends", "1", "--peers", "1"])
            .env("KVROUTER_LOG", "warn")
            .output()
            .map_err(|e| fail("kvrouter creds", &e))?;
        if !out.status.success() {
            return Err(fail(
                "kvrouter creds",
                &String::from_utf8_lossy(&out.stderr).trim(),
            ));
        }
        let creds = Self {
            dir,
            honest_token: secret(),
            tenant_token: secret(),
            honest_key: format!("sk-{}", secret()),
            tenant_key: format!("sk-{}", secret()),
        };
        let files = [
            (
                creds.nats_conf(),
                "include \"nats-users.conf\"\n".to_string(),
            ),
            (
                creds.tokens_file(),
                format!(
                    "{} route,lease # honest\n{} route,lease # another tenant\n",
                    creds.honest_token, creds.tenant_token
                ),
            ),
            (
                creds.api_keys_file(),
                format!(
                    "{}\n{} routing-extension,overlap-header\n",
                    creds.honest_key, creds.tenant_key
                ),
            ),
        ];
        for (path, text) in files {
            std::fs::write(&path, text).map_err(|e| fail(&path.display().to_string(), &e))?;
        }
        Ok(creds)
    }

    /// The seed file of `who` (`replica-r0`, `frontend-0`, `peer-0`, `bridge-7`).
    pub fn seed(&self, who: &str) -> PathBuf {
        self.dir.path().join("seeds").join(format!("{who}.nk"))
    }

    /// `who`'s seed and public key.
    pub fn keys(&self, who: &str) -> Result<(String, String), String> {
        let path = self.seed(who);
        let seed = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .trim()
            .to_string();
        let public = nkeys::KeyPair::from_seed(&seed)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .public_key();
        Ok((seed, public))
    }

    /// nats-server's configuration: the generated users, nothing else.
    pub fn nats_conf(&self) -> PathBuf {
        self.dir.path().join("nats.conf")
    }

    pub fn tokens_file(&self) -> PathBuf {
        self.dir.path().join("tokens.txt")
    }

    pub fn api_keys_file(&self) -> PathBuf {
        self.dir.path().join("api-keys.txt")
    }
}

impl std::fmt::Debug for FleetCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetCredentials")
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}
