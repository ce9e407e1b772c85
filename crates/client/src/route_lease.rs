//! A routed request's hold on router load: `mark_prefill` once the first token is out,
//! `add_output_block` per block of output, `free` exactly once, whether the answer ends, fails, times out or the client leaves
//! (dropping the lease frees it).

use crate::{Booking, ClientError, KvRouterClient};
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
    /// Where to report, under the decision's lease.
    booking: Booking,
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
            booking: Booking::new(&decision, &model, &request_id),
            decision,
            prefill_marked: false,
            output_tokens: 0,
            output_blocks: 0,
            freed: false,
            counts,
        }
    }

    pub fn request_id(&self) -> &str {
        &self.booking.request_id
    }

    /// The prefill is done (first token seen); sent once, in the background.
    pub fn mark_prefill(&mut self) {
        if std::mem::replace(&mut self.prefill_marked, true) || self.freed {
            return;
        }
        let (client, booking) = self.parts();
        spawn(async move {
            if let Err(e) = client.mark_prefill(&booking).await {
                tracing::debug!(request_id = %booking.request_id, error = %e, "mark_prefill failed");
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
            let (client, booking) = self.parts();
            spawn(async move {
                if let Err(e) = client.add_output_block(&booking, None).await {
                    tracing::debug!(request_id = %booking.request_id, error = %e, "add_output_block failed");
                }
            });
        }
    }

    /// The request is over; freed in the background.
    pub fn free(mut self) {
        self.release();
    }

    /// The request is over; freed before this returns (a shutdown must not leave bookings
    /// to the replicas' request-timeout sweep).
    pub async fn free_now(mut self) {
        if std::mem::replace(&mut self.freed, true) {
            return;
        }
        self.counts.freed.inc();
        let (client, booking) = self.parts();
        send_free(client, booking).await;
    }

    fn release(&mut self) {
        if std::mem::replace(&mut self.freed, true) {
            return;
        }
        self.counts.freed.inc();
        let (client, booking) = self.parts();
        spawn(send_free(client, booking));
    }

    fn parts(&self) -> (KvRouterClient, Booking) {
        (self.client.clone(), self.booking.clone())
    }
}

impl Drop for RouteLease {
    fn drop(&mut self) {
        self.release();
    }
}

async fn send_free(client: KvRouterClient, booking: Booking) {
    let (id, replica) = (&booking.request_id, &booking.replica_id);
    match client.free_until_delivered(&booking).await {
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
    use kvrouter_protocol::{decode, encode, Lease, OutputBlock, Reply, RequestUpdate, Subjects};
    use std::time::Duration;

    type Seen = Arc<parking_lot::Mutex<Vec<(String, String, Lease)>>>;

    /// A fake replica that answers `mark_prefill`, `add_output_block` and `free` and records
    /// what came, with the lease presented.
    async fn replica(bus: &Bus, seen: Seen) {
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
                    let (id, lease) = match kind {
                        "output" => {
                            let b = decode::<OutputBlock>(&msg.payload).unwrap();
                            (b.request_id, b.lease)
                        }
                        _ => {
                            let u = decode::<RequestUpdate>(&msg.payload).unwrap();
                            (u.request_id, u.lease)
                        }
                    };
                    seen.lock().push((kind.to_string(), id, lease));
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

    fn decision(lease: Lease) -> RouteDecision {
        RouteDecision {
            tier_overlap_blocks: kvrouter_protocol::TierBlocks::default(),
            worker_id: 1,
            dp_rank: 0,
            overlap_blocks: 0,
            replica_id: "r1".into(),
            base_url: String::new(),
            block_size: 2,
            lease,
            fallbacks: Vec::new(),
        }
    }

    #[tokio::test]
    async fn every_lease_is_freed_exactly_once() {
        let bus = Bus::local();
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        replica(&bus, seen.clone()).await;
        let client = KvRouterClient::new(bus, "ns").unwrap();
        let counts = Arc::new(LeaseCounts::default());
        let (la, lb) = (Lease::random(), Lease::random());
        let lease = |id: &str, l| {
            RouteLease::new(
                client.clone(),
                "m".into(),
                id.into(),
                decision(l),
                counts.clone(),
            )
        };
        let mut a = lease("a", la);
        a.mark_prefill();
        a.mark_prefill();
        // Blocks of 2 tokens: 5 tokens are 2 full blocks.
        for _ in 0..5 {
            a.saw_output_tokens(1);
        }
        a.free();
        drop(lease("b", lb)); // a client that left
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while seen.lock().len() < 5 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut got = seen.lock().clone();
        got.sort_by(|x, y| (&x.0, &x.1).cmp(&(&y.0, &y.1)));
        // Every report carries its decision's lease.
        assert_eq!(
            got,
            vec![
                ("free".into(), "a".into(), la),
                ("free".into(), "b".into(), lb),
                ("output".into(), "a".into(), la),
                ("output".into(), "a".into(), la),
                ("prefill".into(), "a".into(), la),
            ]
        );
        assert_eq!((counts.taken.get(), counts.freed.get()), (2, 2));
    }
}
