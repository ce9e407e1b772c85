//! Throwaway certificates for TLS tests, made by the `openssl` command (no crate to build):
//! a CA, a server certificate for `localhost` and `127.0.0.1` signed by it, a client
//! certificate signed by it, and a client certificate signed by another CA (one a server
//! trusting the first CA must refuse). EC P-256 keys, valid for two days.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PEM files [`TestCerts::generate`] wrote.
#[derive(Clone, Debug)]
pub struct TestCerts {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// Signed by a CA the server does not trust.
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
    /// A member of a cluster that both serves and connects (server and client use), for
    /// `localhost`, `nats` (the Kubernetes base's NATS Service) and `127.0.0.1`.
    pub member_cert: PathBuf,
    pub member_key: PathBuf,
}

const CA_CONFIG: &str = "[req]
distinguished_name = dn
x509_extensions = ca
prompt = no
[dn]
CN = kvrouter test CA
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
";

fn openssl(dir: &Path, args: &[&str]) -> io::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run openssl: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

/// A CA `NAME.pem` / `NAME.key` in `dir`.
fn ca(dir: &Path, name: &str) -> io::Result<()> {
    std::fs::write(dir.join("ca.cnf"), CA_CONFIG)?;
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-config",
            "ca.cnf",
        ],
    )
}

/// A leaf `NAME.pem` / `NAME.key` (PKCS#8) signed by the CA `ca`, with `extensions`.
fn leaf(dir: &Path, name: &str, cn: &str, ca: &str, extensions: &str) -> io::Result<()> {
    let ext = format!("{name}.ext");
    std::fs::write(dir.join(&ext), extensions)?;
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    )
}

impl TestCerts {
    /// Writes the certificates into `dir` (which must exist).
    pub fn generate(dir: &Path) -> io::Result<Self> {
        ca(dir, "ca")?;
        ca(dir, "stranger-ca")?;
        let server = "basicConstraints = CA:FALSE\nextendedKeyUsage = serverAuth\nsubjectAltName = DNS:localhost, IP:127.0.0.1\n";
        let client = "basicConstraints = CA:FALSE\nextendedKeyUsage = clientAuth\n";
        leaf(dir, "server", "localhost", "ca", server)?;
        leaf(dir, "client", "peer-router", "ca", client)?;
        leaf(dir, "stranger", "stranger", "stranger-ca", client)?;
        let member = "basicConstraints = CA:FALSE\nextendedKeyUsage = serverAuth, clientAuth\nsubjectAltName = DNS:localhost, DNS:nats, IP:127.0.0.1\n";
        leaf(dir, "member", "nats", "ca", member)?;
        let p = |f: &str| dir.join(f);
        Ok(Self {
            ca: p("ca.pem"),
            server_cert: p("server.pem"),
            server_key: p("server.key"),
            client_cert: p("client.pem"),
            client_key: p("client.key"),
            stranger_cert: p("stranger.pem"),
            stranger_key: p("stranger.key"),
            member_cert: p("member.pem"),
            member_key: p("member.key"),
        })
    }
}
