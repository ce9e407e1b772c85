//! Where a bridge finds its engine: ZMQ endpoints per data-parallel rank, the default worker
//! id, and the engine's HTTP URLs.

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EndpointError {
    #[error(
        "ZMQ endpoint {0:?} must be tcp://HOST:PORT with a host, not `*` (the engine's \
         address; with --zmq-bind, the bridge's own, e.g. 127.0.0.1), or ipc://PATH (a \
         socket file the engine binds, shared in the pod)"
    )]
    NotTcp(String),
    #[error(
        "ZMQ endpoint {endpoint:?} for data-parallel rank {rank}: vLLM and SGLang offset \
         only tcp:// endpoints per rank (their offset_endpoint_port refuses ipc:// past rank \
         0); give the engine tcp://*:PORT and the bridge tcp://127.0.0.1:PORT instead"
    )]
    IpcRank { endpoint: String, rank: u32 },
    #[error("ZMQ endpoint {endpoint:?}: rank {rank} would publish on port {port}, above 65535")]
    PortRange {
        endpoint: String,
        rank: u32,
        port: u64,
    },
    #[error("URL {0:?} must be http://HOST[:PORT][/PATH]")]
    NotHttp(String),
}

/// The endpoint rank `rank` uses: the engine adds the global data-parallel rank to the
/// port (vLLM's and SGLang's `offset_endpoint_port`), for the publisher and the replay
/// endpoint alike.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(EndpointError::NotTcp(endpoint.into()));
        }
        if rank > 0 {
            return Err(EndpointError::IpcRank {
                endpoint: endpoint.into(),
                rank,
            });
        }
        return Ok(endpoint.to_string());
    }
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| EndpointError::NotTcp(endpoint.into()))?;
    let (host, port) = rest
        .rsplit_once(':')
        .filter(|(h, _)| !h.is_empty() && *h != "*")
        .ok_or_else(|| EndpointError::NotTcp(endpoint.into()))?;
    let port: u16 = port
        .parse()
        .map_err(|_| EndpointError::NotTcp(endpoint.into()))?;
    let p = u64::from(port) + u64::from(rank);
    if p > 65535 {
        return Err(EndpointError::PortRange {
            endpoint: endpoint.into(),
            rank,
            port: p,
        });
    }
    Ok(format!("tcp://{host}:{p}"))
}

/// The largest worker id (ids fit a JSON number exactly).
pub const MAX_WORKER_ID: u64 = (1 << 53) - 1;

/// The worker id a bridge takes when none is given, stable across bridge restarts:
/// `xxh3_64(model ‖ 0x00 ‖ base_url ‖ 0x00 ‖ dp_start_rank as decimal) & (2^53 − 1)`.
pub fn default_worker_id(model: &str, base_url: &str, dp_start_rank: u32) -> u64 {
    let mut bytes = Vec::with_capacity(model.len() + base_url.len() + 12);
    bytes.extend_from_slice(model.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(base_url.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(dp_start_rank.to_string().as_bytes());
    xxh3_64(&bytes) & MAX_WORKER_ID
}

/// An `http://` URL split for a plain HTTP/1.1 request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    /// `host:port` (port 80 when absent).
    pub authority: String,
    /// Starts with `/`.
    pub path: String,
}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<Self, EndpointError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| EndpointError::NotHttp(url.into()))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(EndpointError::NotHttp(url.into()));
        }
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_string()
        } else if authority.contains(':') && !authority.ends_with(']') {
            return Err(EndpointError::NotHttp(url.into()));
        } else {
            format!("{authority}:80")
        };
        Ok(Self {
            authority,
            path: path.to_string(),
        })
    }

    /// The same host with another path (e.g. the base URL's `/health`).
    pub fn with_path(&self, path: &str) -> Self {
        Self {
            authority: self.authority.clone(),
            path: path.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_the_port() {
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 0).unwrap(),
            "tcp://10.0.0.5:5557"
        );
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 3).unwrap(),
            "tcp://10.0.0.5:5560"
        );
        assert_eq!(
            rank_endpoint("tcp://[::1]:5557", 1).unwrap(),
            "tcp://[::1]:5558"
        );
        assert!(matches!(
            rank_endpoint("tcp://h:65535", 1),
            Err(EndpointError::PortRange { .. })
        ));
        // A socket file: rank 0 only, as the engines' own offset rule has it.
        assert_eq!(
            rank_endpoint("ipc:///run/kv/events", 0).unwrap(),
            "ipc:///run/kv/events"
        );
        assert!(matches!(
            rank_endpoint("ipc:///run/kv/events", 1),
            Err(EndpointError::IpcRank { rank: 1, .. })
        ));
        for bad in ["ipc://", "tcp://*:5557", "tcp://h", "tcp://h:x", "h:5557"] {
            assert!(rank_endpoint(bad, 0).is_err(), "{bad}");
        }
    }

    #[test]
    fn default_worker_ids_are_stable_distinct_and_fit_json() {
        let a = default_worker_id("m", "http://10.0.0.5:8000", 0);
        assert_eq!(a, default_worker_id("m", "http://10.0.0.5:8000", 0));
        assert_ne!(a, default_worker_id("m", "http://10.0.0.5:8000", 2));
        assert_ne!(a, default_worker_id("m", "http://10.0.0.6:8000", 0));
        assert_ne!(a, default_worker_id("m2", "http://10.0.0.5:8000", 0));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            default_worker_id("ab", "c", 0),
            default_worker_id("a", "bc", 0)
        );
        assert!(a <= MAX_WORKER_ID);
    }

    #[test]
    fn http_urls() {
        let u = HttpUrl::parse("http://10.0.0.5:8000").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("10.0.0.5:8000", "/")
        );
        let u = HttpUrl::parse("http://engine/metrics").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("engine:80", "/metrics")
        );
        assert_eq!(u.with_path("/health").path, "/health");
        for bad in ["https://e:1", "http://", "http://u:p@e:1/", "ftp://e"] {
            assert!(HttpUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
