//! HTTPS for a listener, with client certificates required and verified against a CA when
//! asked (mTLS). rustls with the ring provider (no C toolchain beyond ring's own), HTTP/1.1
//! only.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// Why a listener's TLS setup was refused.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path} holds no PEM {expected}")]
    Empty {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("{what} {path} is not valid PEM: {message}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("the client CA {path}: {message}")]
    ClientCa { path: PathBuf, message: String },
    #[error("the certificate {cert} and key {key} do not make a TLS server: {message}")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        message: String,
    },
}

/// Where a listener's certificate, key and (for mTLS) client CA are, all PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by one of these CAs.
    pub client_ca: Option<PathBuf>,
}

/// A listener's TLS: built once at startup, shared by every connection. Compares equal only
/// to itself (a clone).
#[derive(Clone)]
pub struct ServerTls {
    acceptor: TlsAcceptor,
    client_auth: bool,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("client_auth", &self.client_auth)
            .finish()
    }
}

impl PartialEq for ServerTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(self.acceptor.config(), other.acceptor.config())
    }
}

impl Eq for ServerTls {}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_path_buf(),
            expected: "CERTIFICATE",
        });
    }
    Ok(certs)
}

impl ServerTls {
    /// Reads and checks `files`: the key must match the certificate, the client CA must
    /// hold at least one usable certificate.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        Self::load_for(files, &[b"http/1.1"])
    }

    /// [`ServerTls::load`] for a listener speaking these ALPN protocols (`h2` for gRPC).
    pub fn load_for(files: &TlsFiles, alpn: &[&[u8]]) -> Result<Self, TlsError> {
        let chain = certs("the certificate", &files.cert)?;
        let key_pem = read("the key", &files.key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
                what: "the key",
                path: files.key.clone(),
                expected: "PRIVATE KEY",
            },
            e => TlsError::Pem {
                what: "the key",
                path: files.key.clone(),
                message: e.to_string(),
            },
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config_error = |e: rustls::Error| TlsError::Config {
            cert: files.cert.clone(),
            key: files.key.clone(),
            message: e.to_string(),
        };
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(config_error)?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for c in certs("the client CA", path)? {
                    roots.add(c).map_err(|e| TlsError::ClientCa {
                        path: path.clone(),
                        message: e.to_string(),
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| TlsError::ClientCa {
                            path: path.clone(),
                            message: e.to_string(),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(chain, key).map_err(config_error)?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            client_auth: files.client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate the CA signed.
    pub fn requires_client_cert(&self) -> bool {
        self.client_auth
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// The server side of a TLS handshake on `stream`.
    pub async fn accept<S>(&self, stream: S) -> std::io::Result<tokio_rustls::server::TlsStream<S>>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        self.acceptor.accept(stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_testkit::TestCerts;

    #[test]
    fn bad_files_are_refused_saying_which_and_why() {
        let dir = tempfile::tempdir().unwrap();
        let c = TestCerts::generate(dir.path()).unwrap();
        let files = |cert: &Path, key: &Path, ca: Option<&Path>| TlsFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            client_ca: ca.map(Path::to_path_buf),
        };
        let err = |f: TlsFiles| ServerTls::load(&f).unwrap_err().to_string();
        let good = ServerTls::load(&files(&c.server_cert, &c.server_key, None)).unwrap();
        assert!(!good.requires_client_cert());
        assert_eq!(good, good.clone());
        let missing = dir.path().join("nope.pem");
        assert!(
            err(files(&missing, &c.server_key, None)).starts_with(&format!(
                "cannot read the certificate {}",
                missing.display()
            ))
        );
        // A key where the certificate should be, and the reverse.
        assert_eq!(
            err(files(&c.server_key, &c.server_key, None)),
            format!(
                "the certificate {} holds no PEM CERTIFICATE",
                c.server_key.display()
            )
        );
        assert!(
            err(files(&c.server_cert, &c.server_cert, None)).contains("holds no PEM PRIVATE KEY")
        );
        // Another certificate's key.
        let mismatch = err(files(&c.server_cert, &c.client_key, None));
        assert!(mismatch.contains("do not make a TLS server"), "{mismatch}");
        let ca = err(files(&c.server_cert, &c.server_key, Some(&c.server_key)));
        assert!(
            ca.contains("the client CA") && ca.contains("no PEM CERTIFICATE"),
            "{ca}"
        );
        let junk = dir.path().join("junk.pem");
        std::fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert!(err(files(&junk, &c.server_key, None)).contains("is not valid PEM"));
    }
}
