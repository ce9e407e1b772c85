//! A routed request's hold on router load: `mark_prefill` once the first token is out,
//! `add_output_block` per block of output, `free` exactly once, whether the answer ends, fails, times out or the client leaves
//! (dropping the lease frees it).

use kvrouter_client::{ClientError, KvRouterClient};
use kvrouter_protocol::{ErrorKind, RouteDecision};
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;

/// How many routes were taken and freed (equal at rest: nothing leaks).
#[derive(Debug, Default)]
pub struct LeaseCounts {
    pub taken: Counter,
    pub freed: Counter,
}

/// One route decision made with `update_states`, until freed.
pub struct RouteLease {
    client: KvRouterClient,
    model: String,
    request_id: String,
    pub decision: RouteDecision,
    prefill_marked: bool,
    /// Output tokens seen, and blocks of them reported.
    output_tokens: u32,
    output_blocks: u32,
    freed: bool,
    counts: Arc<LeaseCounts>,
}

impl RouteLease {
    pub fn new(
        client: KvRouterClient,
        model: String,
        request_id: String,
        decision: RouteDecision,
        counts: Arc<LeaseCounts>,
    ) -> Self {
        counts.taken.inc();
        Self {
            client,
            model,
            request_id,
            decision,
            prefill_marked: false,
            output_tokens: 0,
            output_blocks: 0,
            freed: false,
            counts,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The prefill is done (first token seen); sent once, in the background.
    pub fn mark_prefill(&mut self) {
        if std::mem::replace(&mut self.prefill_marked, true) || self.freed {
            return;
        }
        let (client, replica, model, id) = self.parts();
        spawn(async move {
            if let Err(e) = client.mark_prefill(&replica, &model, &id).await {
                tracing::debug!(request_id = %id, error = %e, "mark_prefill failed");
            }
        });
    }

    /// `tokens` more tokens of output came: each full block of them is reported to the
    /// replica (`add_output_block`, in the background), so its decode load grows with it.
    pub fn saw_output_tokens(&mut self, tokens: u32) {
        let block = self.decision.block_size;
        if self.freed || block == 0 {
            return;
        }
        self.output_tokens = self.output_tokens.saturating_add(tokens);
        let due = self.output_tokens / block;
        while self.output_blocks < due {
            self.output_blocks += 1;
            let (client, replica, model, id) = self.parts();
            spawn(async move {
                if let Err(e) = client.add_output_block(&replica, &model, &id, None).await {
                    tracing::debug!(request_id = %id, error = %e, "add_output_block failed");
                }
            });
        }
    }

    /// The request is over; freed in the background.
    pub fn free(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if std::mem::replace(&mut self.freed, true) {
            return;
        }
        self.counts.freed.inc();
        let (client, replica, model, id) = self.parts();
        spawn(async move {
            match client.free_until_delivered(&replica, &model, &id).await {
                Ok(()) => {}
                // Already gone there (its worker left, or the sweep took it): nothing held.
                Err(ClientError::Router(e)) if e.kind == ErrorKind::UnknownRequest => {
                    tracing::debug!(request_id = %id, replica = %replica, "free: the replica no longer tracks it");
                }
                // The replica's request-timeout sweep frees it eventually.
                Err(e) => {
                    tracing::warn!(request_id = %id, replica = %replica, error = %e, "free failed")
                }
            }
        });
    }

    fn parts(&self) -> (KvRouterClient, String, String, String) {
        (
            self.client.clone(),
            self.decision.replica_id.clone(),
            self.model.clone(),
            self.request_id.clone(),
        )
    }
}

impl Drop for RouteLease {
    fn drop(&mut self) {
        self.release();
    }
}

fn spawn(f: impl std::future::Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn(f);
        }
        Err(_) => tracing::warn!("no runtime to send a route update on (shutting down)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use kvrouter_bus::Bus;
    use kvrouter_protocol::{decode, encode, OutputBlock, Reply, RequestUpdate, Subjects};
    use std::time::Duration;

    /// A fake replica that answers `mark_prefill`, `add_output_block` and `free` and records
    /// what came.
    async fn replica(bus: &Bus, seen: Arc<parking_lot::Mutex<Vec<(String, String)>>>) {
        let s = Subjects::new("ns").unwrap();
        for (kind, subject) in [
            ("prefill", s.mark_prefill("r1")),
            ("free", s.free("r1")),
            ("output", s.add_output_block("r1")),
        ] {
            let mut sub = bus.subscribe(&subject).await.unwrap();
            let (bus, seen) = (bus.clone(), seen.clone());
            tokio::spawn(async move {
                while let Some(msg) = sub.next().await {
                    let id = match kind {
                        "output" => decode::<OutputBlock>(&msg.payload).unwrap().request_id,
                        _ => decode::<RequestUpdate>(&msg.payload).unwrap().request_id,
                    };
                    seen.lock().push((kind.to_string(), id));
                    if let Some(reply) = msg.reply {
                        let ok: Reply<()> = Reply::Ok(());
                        bus.publish(&reply, Bytes::from(encode(&ok).unwrap()))
                            .await
                            .unwrap();
                    }
                }
            });
        }
    }

    fn decision() -> RouteDecision {
        RouteDecision {
            tier_overlap_blocks: kvrouter_protocol::TierBlocks::default(),
            worker_id: 1,
            dp_rank: 0,
            overlap_blocks: 0,
            replica_id: "r1".into(),
            base_url: String::new(),
            block_size: 2,
        }
    }

    #[tokio::test]
    async fn every_lease_is_freed_exactly_once() {
        let bus = Bus::local();
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        replica(&bus, seen.clone()).await;
        let client = KvRouterClient::new(bus, "ns").unwrap();
        let counts = Arc::new(LeaseCounts::default());
        let lease = |id: &str| {
            RouteLease::new(
                client.clone(),
                "m".into(),
                id.into(),
                decision(),
                counts.clone(),
            )
        };
        let mut a = lease("a");
        a.mark_prefill();
        a.mark_prefill();
        // Blocks of 2 tokens: 5 tokens are 2 full blocks.
        for _ in 0..5 {
            a.saw_output_tokens(1);
        }
        a.free();
        drop(lease("b")); // a client that left
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while seen.lock().len() < 5 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut got = seen.lock().clone();
        got.sort();
        assert_eq!(
            got,
            vec![
                ("free".into(), "a".into()),
                ("free".into(), "b".into()),
                ("output".into(), "a".into()),
                ("output".into(), "a".into()),
                ("prefill".into(), "a".into()),
            ]
        );
        assert_eq!((counts.taken.get(), counts.freed.get()), (2, 2));
    }
}
