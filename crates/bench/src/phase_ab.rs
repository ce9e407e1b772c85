//! Phase timing on and off in one run (`bench route-latency --phase-timing-ab`): the
//! replicas' `/debug/phase-timing` switch is flipped every period, and each request is
//! counted under the state that held from its send to its answer; requests that straddle a
//! flip are left out. So both halves see the same machine, the same minute and the same
//! index.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

type AdminClient = Client<HttpConnector, Full<Bytes>>;

/// Where the switches are and how often to flip them.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseAb {
    /// Admin base URLs of the replicas (`http://127.0.0.1:9090`).
    pub admin_urls: Vec<String>,
    /// A token with the `debug` scope, when the admin endpoints ask for one.
    pub token: Option<String>,
    pub period: Duration,
}

/// The run's phase-timing state, as requests see it. Counts up through
/// on, turning off, off, turning on: a request's two readings that are equal and even
/// say one state held throughout.
#[derive(Default)]
pub struct AbState(AtomicU64);

impl AbState {
    pub fn read(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    fn next(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether a request sent at `sent` and answered at `done` saw one settled state, and
    /// whether timing was on then.
    pub fn settled(sent: u64, done: u64) -> Option<bool> {
        (sent == done && sent.is_multiple_of(2)).then_some(sent.is_multiple_of(4))
    }
}

impl PhaseAb {
    pub fn validate(&self) -> Result<(), String> {
        if self.admin_urls.is_empty() {
            return Err("the A/B run needs at least one replica admin URL".into());
        }
        if self.period < Duration::from_millis(10) {
            return Err("the A/B period must be at least 10 ms".into());
        }
        Ok(())
    }

    async fn set(&self, client: &AdminClient, on: bool) -> Result<(), String> {
        let state = if on { "on" } else { "off" };
        for base in &self.admin_urls {
            let url = format!(
                "{}/debug/phase-timing?set={state}",
                base.trim_end_matches('/')
            );
            let mut req = hyper::Request::get(&url);
            if let Some(t) = &self.token {
                req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
            }
            let req = req
                .body(Full::new(Bytes::new()))
                .map_err(|e| format!("bad admin URL {url:?}: {e}"))?;
            let res = client
                .request(req)
                .await
                .map_err(|e| format!("cannot reach {url}: {e}"))?;
            let status = res.status();
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            if !status.is_success() {
                let body = body.map(|b| String::from_utf8_lossy(&b).into_owned());
                return Err(format!(
                    "{url} answered {status}: {}",
                    body.unwrap_or_default().trim()
                ));
            }
        }
        Ok(())
    }

    /// Sets timing on everywhere (the state requests start in), then flips it every period
    /// until `stop`; leaves it on.
    pub async fn run(
        self,
        state: Arc<AbState>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), String> {
        let client =
            Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
        self.set(&client, true).await?;
        let mut on = true;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.period) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            state.next();
            on = !on;
            self.set(&client, on).await?;
            state.next();
        }
        if !on {
            state.next();
            self.set(&client, true).await?;
            state.next();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_requests_within_one_settled_state_count() {
        let s = AbState::default();
        let sent = s.read();
        assert_eq!(AbState::settled(sent, s.read()), Some(true));
        s.next(); // turning off
        assert_eq!(AbState::settled(sent, s.read()), None, "straddles a flip");
        assert_eq!(AbState::settled(s.read(), s.read()), None, "mid-flip");
        s.next(); // off
        assert_eq!(AbState::settled(s.read(), s.read()), Some(false));
        s.next();
        s.next(); // on again
        assert_eq!(AbState::settled(s.read(), s.read()), Some(true));
    }
}
