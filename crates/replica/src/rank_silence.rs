//! Which ranks are sent requests but publish no KV events: a plain core, fed each route
//! decision and each applied event, checked on the tracker's tick.
//!
//! An engine stores blocks for every prompt of a full block or more, and publishes them; a
//! rank the router keeps sending such prompts to without one event from it for the window
//! is not publishing where the router listens (a wrong endpoint, another topic, a publisher
//! that connects instead of binding, events off, a bridge stuck). Its overlap then reads 0
//! everywhere and routing quietly turns to load balancing: the replica says so.

use kvrouter_protocol::{WorkerId, WorkerKey};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Routes since the last event before a rank may count as silent: one or two prompts may
/// have been cached whole already (nothing new to store).
pub const MIN_ROUTES: u64 = 3;

#[derive(Debug, Clone)]
struct Watch {
    joined: Instant,
    /// When its last KV event was applied (`None`: none since it joined).
    last_event: Option<Instant>,
    /// The first route to it since its last event (or since it joined).
    first_route: Option<Instant>,
    routes: u64,
    silent: bool,
}

/// What a check or an event changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SilenceChange {
    /// Routed to for the whole window without an event: the rank just turned silent.
    Silent {
        key: WorkerKey,
        /// Since its last event (or since it joined).
        quiet_for: Duration,
        /// Routes sent to it meanwhile.
        routes: u64,
        /// It has published nothing since it joined.
        never_published: bool,
    },
    /// A silent rank's events arrive again.
    Resumed { key: WorkerKey, quiet_for: Duration },
}

/// A rank's silence, as `/v1/workers` and the metrics show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quiet {
    pub silent: bool,
    /// Since its last event, or since it joined when it has published none.
    pub since_last_event: Duration,
    pub never_published: bool,
}

/// Every rank's watch, for one model.
#[derive(Debug)]
pub struct RankSilence {
    after: Duration,
    ranks: FxHashMap<WorkerKey, Watch>,
}

impl RankSilence {
    /// Silent after `after` of routes without an event (`Duration::ZERO`: never).
    pub fn new(after: Duration) -> Self {
        Self {
            after,
            ranks: FxHashMap::default(),
        }
    }

    pub fn joined(&mut self, key: WorkerKey, now: Instant) {
        self.ranks.entry(key).or_insert(Watch {
            joined: now,
            last_event: None,
            first_route: None,
            routes: 0,
            silent: false,
        });
    }

    pub fn left(&mut self, key: WorkerKey) {
        self.ranks.remove(&key);
    }

    pub fn left_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|k, _| k.worker_id != worker_id);
    }

    /// A route to `key` whose prompt has a full block (shorter ones store nothing).
    pub fn routed(&mut self, key: WorkerKey, now: Instant) {
        if let Some(w) = self.ranks.get_mut(&key) {
            w.routes += 1;
            w.first_route.get_or_insert(now);
        }
    }

    /// KV events of `key` were applied.
    pub fn events(&mut self, key: WorkerKey, now: Instant) -> Option<SilenceChange> {
        let w = self.ranks.get_mut(&key)?;
        let quiet_for = now.duration_since(w.last_event.unwrap_or(w.joined));
        w.last_event = Some(now);
        w.first_route = None;
        w.routes = 0;
        std::mem::take(&mut w.silent).then_some(SilenceChange::Resumed { key, quiet_for })
    }

    /// Ranks that just turned silent.
    pub fn check(&mut self, now: Instant) -> Vec<SilenceChange> {
        if self.after.is_zero() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (&key, w) in &mut self.ranks {
            let due = w
                .first_route
                .is_some_and(|f| now.duration_since(f) >= self.after);
            if !w.silent && due && w.routes >= MIN_ROUTES {
                w.silent = true;
                out.push(SilenceChange::Silent {
                    key,
                    quiet_for: now.duration_since(w.last_event.unwrap_or(w.joined)),
                    routes: w.routes,
                    never_published: w.last_event.is_none(),
                });
            }
        }
        out
    }

    pub fn is_silent(&self, key: WorkerKey) -> bool {
        self.ranks.get(&key).is_some_and(|w| w.silent)
    }

    pub fn quiet(&self, key: WorkerKey, now: Instant) -> Option<Quiet> {
        self.ranks.get(&key).map(|w| Quiet {
            silent: w.silent,
            since_last_event: now.duration_since(w.last_event.unwrap_or(w.joined)),
            never_published: w.last_event.is_none(),
        })
    }

    /// Every rank's silence.
    pub fn all(&self, now: Instant) -> impl Iterator<Item = (WorkerKey, Quiet)> + '_ {
        self.ranks
            .keys()
            .filter_map(move |&k| Some((k, self.quiet(k, now)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Duration = Duration::from_secs(1);

    fn k(w: u64, r: u32) -> WorkerKey {
        WorkerKey::new(w, r)
    }

    #[test]
    fn a_rank_that_never_published_turns_silent_once() {
        let t0 = Instant::now();
        let mut s = RankSilence::new(10 * S);
        s.joined(k(1, 0), t0);
        s.joined(k(2, 0), t0);
        // Idle for long: nothing to say.
        assert!(s.check(t0 + 100 * S).is_empty());
        for i in 0..3 {
            s.routed(k(1, 0), t0 + (100 + i) * S);
        }
        assert!(
            s.check(t0 + 109 * S).is_empty(),
            "the window runs from the first route"
        );
        assert_eq!(
            s.check(t0 + 110 * S),
            [SilenceChange::Silent {
                key: k(1, 0),
                quiet_for: 110 * S,
                routes: 3,
                never_published: true,
            }]
        );
        assert!(s.is_silent(k(1, 0)) && !s.is_silent(k(2, 0)));
        assert!(s.check(t0 + 200 * S).is_empty(), "said once");
        let q = s.quiet(k(1, 0), t0 + 200 * S).unwrap();
        assert_eq!(
            (q.silent, q.since_last_event, q.never_published),
            (true, 200 * S, true)
        );
        // Its events come: resumed, said once, and the watch starts again.
        assert_eq!(
            s.events(k(1, 0), t0 + 201 * S),
            Some(SilenceChange::Resumed {
                key: k(1, 0),
                quiet_for: 201 * S
            })
        );
        assert_eq!(s.events(k(1, 0), t0 + 202 * S), None);
        assert!(!s.is_silent(k(1, 0)));
        assert!(!s.quiet(k(1, 0), t0 + 202 * S).unwrap().never_published);
    }

    #[test]
    fn a_rank_that_stops_publishing_turns_silent_and_few_routes_do_not() {
        let t0 = Instant::now();
        let mut s = RankSilence::new(10 * S);
        s.joined(k(1, 0), t0);
        s.events(k(1, 0), t0 + S);
        s.routed(k(1, 0), t0 + 2 * S);
        s.routed(k(1, 0), t0 + 3 * S);
        assert!(
            s.check(t0 + 60 * S).is_empty(),
            "two routes may have hit the cache whole"
        );
        s.routed(k(1, 0), t0 + 61 * S);
        assert_eq!(
            s.check(t0 + 61 * S),
            [SilenceChange::Silent {
                key: k(1, 0),
                quiet_for: 60 * S,
                routes: 3,
                never_published: false,
            }]
        );
        // Gone: forgotten.
        s.left_worker(1);
        assert_eq!(s.quiet(k(1, 0), t0 + 62 * S), None);
        s.routed(k(1, 0), t0 + 63 * S);
        assert!(s.check(t0 + 100 * S).is_empty());
    }

    #[test]
    fn a_zero_window_is_off() {
        let t0 = Instant::now();
        let mut s = RankSilence::new(Duration::ZERO);
        s.joined(k(1, 0), t0);
        for _ in 0..10 {
            s.routed(k(1, 0), t0);
        }
        assert!(s.check(t0 + 1000 * S).is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Route(u8),
        Event(u8),
        Check,
    }

    proptest! {
        /// Against a reference that keeps each rank's whole history: a check flags a rank
        /// iff, since its last event (or its start), it was routed at least MIN_ROUTES times
        /// and the first of those is the window old; it stays flagged until an event, which
        /// reports it resumed.
        #[test]
        fn silence_follows_the_history(
            ops in prop::collection::vec((prop_oneof![
                (0u8..3).prop_map(Op::Route),
                (0u8..3).prop_map(Op::Event),
                Just(Op::Check),
            ], 0u32..5), 0..80),
        ) {
            let t0 = Instant::now();
            let after = 6 * S;
            let mut s = RankSilence::new(after);
            for r in 0..3 {
                s.joined(k(1, r), t0);
            }
            // Reference: per rank, routes since its last event, and its flag.
            let mut routes: Vec<Vec<Instant>> = vec![Vec::new(); 3];
            let mut flagged = [false; 3];
            let mut now = t0;
            for (op, dt) in ops {
                now += dt * S;
                match op {
                    Op::Route(r) => {
                        s.routed(k(1, r.into()), now);
                        routes[usize::from(r)].push(now);
                    }
                    Op::Event(r) => {
                        let got = s.events(k(1, r.into()), now);
                        let r = usize::from(r);
                        prop_assert_eq!(matches!(got, Some(SilenceChange::Resumed { .. })), flagged[r]);
                        routes[r].clear();
                        flagged[r] = false;
                    }
                    Op::Check => {
                        let mut got: Vec<u32> = s.check(now).iter().map(|c| match c {
                            SilenceChange::Silent { key, .. } => key.dp_rank,
                            SilenceChange::Resumed { .. } => u32::MAX,
                        }).collect();
                        got.sort_unstable();
                        let mut want = Vec::new();
                        for r in 0..3 {
                            let due = routes[r].len() as u64 >= MIN_ROUTES
                                && now.duration_since(routes[r][0]) >= after;
                            if due && !flagged[r] {
                                flagged[r] = true;
                                want.push(r as u32);
                            }
                        }
                        prop_assert_eq!(got, want);
                    }
                }
                for r in 0..3u32 {
                    prop_assert_eq!(s.is_silent(k(1, r)), flagged[r as usize]);
                }
            }
        }
    }
}
