//! Plain core: a circuit breaker for the remote indexer (`--use-remote-indexer`).
//!
//! A serving indexer that is down fails fast (no responders), but one that is hung (it takes
//! queries and never answers) costs every route the whole `--remote-indexer-timeout-ms`. After
//! `failures` consecutive failures (the remote indexer reports timeouts only) the breaker opens: routes skip the remote lookup (overlap 0)
//! for a cooldown. Then it is half-open: one probe goes through; an answer closes the breaker,
//! a failure re-opens it with the cooldown doubled (up to `max_cooldown`).
//!
//! No I/O and no clock: the caller passes the time in. Outcomes carry the [`Ticket`] their
//! lookup was admitted with, so a lookup that started before the breaker opened (or a probe
//! given up as lost) cannot close or re-open it afterwards.

use std::time::{Duration, Instant};

/// Default of `--remote-indexer-breaker-cooldown-ms`.
pub use crate::config::DEFAULT_BREAKER_COOLDOWN as DEFAULT_COOLDOWN;
/// Default of `--remote-indexer-breaker-failures`.
pub use crate::config::DEFAULT_BREAKER_FAILURES as DEFAULT_FAILURES;
/// The cooldown doubles after each failed probe, up to this multiple of the first one.
pub const MAX_COOLDOWN_FACTOR: u32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker; 0 never opens it.
    pub failures: u32,
    /// How long the breaker stays open before the first probe.
    pub cooldown: Duration,
    /// Cap of the cooldown as failed probes double it.
    pub max_cooldown: Duration,
    /// A probe not reported within this long counts as lost (its route was cancelled), so
    /// another may go: the breaker never stays half-open for ever.
    pub probe_timeout: Duration,
}

impl BreakerConfig {
    /// The breaker of a remote indexer whose lookups time out after `timeout`.
    pub fn new(failures: u32, cooldown: Duration, timeout: Duration) -> Self {
        Self {
            failures,
            cooldown,
            max_cooldown: cooldown.saturating_mul(MAX_COOLDOWN_FACTOR),
            probe_timeout: timeout.saturating_mul(2).max(cooldown),
        }
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self::new(
            DEFAULT_FAILURES,
            DEFAULT_COOLDOWN,
            crate::config::DEFAULT_REMOTE_TIMEOUT,
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probe_sent: Instant },
}

/// Whether a lookup may go to the serving indexers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Ask; report the outcome with this ticket.
    Ask(Ticket),
    /// The breaker is open: route on load alone without asking.
    Skip,
}

/// Admission of one lookup, handed back with its outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    epoch: u64,
    probe: bool,
}

impl Ticket {
    /// Whether this lookup is the half-open probe.
    #[cfg(test)]
    pub fn is_probe(&self) -> bool {
        self.probe
    }
}

/// A change worth logging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// `failures` in a row: lookups are skipped for `cooldown`.
    Opened { failures: u32, cooldown: Duration },
    /// The probe failed: skipped again, for `cooldown`.
    Reopened { cooldown: Duration },
    /// The probe was answered: lookups resume. `open_for` since it first opened, `skipped`
    /// lookups meanwhile.
    Closed { open_for: Duration, skipped: u64 },
}

#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    state: State,
    /// The current cooldown (doubled by failed probes, reset when the breaker closes).
    cooldown: Duration,
    /// Bumped whenever the breaker opens: tickets of an older epoch are stale.
    epoch: u64,
    opened_at: Option<Instant>,
    skipped: u64,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: State::Closed { failures: 0 },
            cooldown: config.cooldown,
            epoch: 0,
            opened_at: None,
            skipped: 0,
        }
    }

    /// Open or half-open: lookups are skipped except for the probe.
    pub fn is_open(&self) -> bool {
        !matches!(self.state, State::Closed { .. })
    }

    /// A serving indexer announced itself synced: close at once rather than wait for a probe
    /// (tickets handed out before are stale). `Some(Closed)` if it was open.
    pub fn close_now(&mut self, now: Instant) -> Option<Transition> {
        let was_open = self.is_open();
        self.epoch += 1;
        self.state = State::Closed { failures: 0 };
        self.cooldown = self.config.cooldown;
        let opened_at = self.opened_at.take();
        let skipped = std::mem::take(&mut self.skipped);
        was_open.then(|| Transition::Closed {
            open_for: opened_at.map_or(Duration::ZERO, |t| now.saturating_duration_since(t)),
            skipped,
        })
    }

    /// Whether a lookup at `now` may ask.
    pub fn admit(&mut self, now: Instant) -> Admit {
        let probe = match self.state {
            State::Closed { .. } => {
                return Admit::Ask(Ticket {
                    epoch: self.epoch,
                    probe: false,
                })
            }
            State::Open { until } => now >= until,
            State::HalfOpen { probe_sent } => {
                now.saturating_duration_since(probe_sent) >= self.config.probe_timeout
            }
        };
        if probe {
            self.state = State::HalfOpen { probe_sent: now };
            Admit::Ask(Ticket {
                epoch: self.epoch,
                probe: true,
            })
        } else {
            self.skipped += 1;
            Admit::Skip
        }
    }

    /// The lookup admitted with `ticket` was answered.
    pub fn succeeded(&mut self, ticket: Ticket, now: Instant) -> Option<Transition> {
        if ticket.epoch != self.epoch {
            return None;
        }
        match self.state {
            State::Closed { .. } => {
                self.state = State::Closed { failures: 0 };
                None
            }
            // Only the probe holds a ticket of this epoch once the breaker has opened.
            State::Open { .. } | State::HalfOpen { .. } => {
                let open_for = self
                    .opened_at
                    .take()
                    .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                self.state = State::Closed { failures: 0 };
                self.cooldown = self.config.cooldown;
                Some(Transition::Closed {
                    open_for,
                    skipped: std::mem::take(&mut self.skipped),
                })
            }
        }
    }

    /// The lookup admitted with `ticket` failed (timeout, no responders, error reply).
    pub fn failed(&mut self, ticket: Ticket, now: Instant) -> Option<Transition> {
        if ticket.epoch != self.epoch {
            return None;
        }
        match self.state {
            State::Closed { failures } => {
                let failures = failures.saturating_add(1);
                if self.config.failures == 0 || failures < self.config.failures {
                    self.state = State::Closed { failures };
                    return None;
                }
                self.open(now);
                self.opened_at = Some(now);
                self.skipped = 0;
                Some(Transition::Opened {
                    failures,
                    cooldown: self.cooldown,
                })
            }
            State::HalfOpen { .. } => {
                self.cooldown = self
                    .cooldown
                    .saturating_mul(2)
                    .min(self.config.max_cooldown)
                    .max(self.config.cooldown);
                self.open(now);
                Some(Transition::Reopened {
                    cooldown: self.cooldown,
                })
            }
            State::Open { .. } => None,
        }
    }

    fn open(&mut self, now: Instant) {
        self.epoch += 1;
        self.state = State::Open {
            until: now + self.cooldown,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    fn config() -> BreakerConfig {
        BreakerConfig {
            failures: 3,
            cooldown: 1000 * MS,
            max_cooldown: 4000 * MS,
            probe_timeout: 1000 * MS,
        }
    }

    fn ask(b: &mut Breaker, now: Instant) -> Ticket {
        match b.admit(now) {
            Admit::Ask(t) => t,
            Admit::Skip => panic!("skipped at {b:?}"),
        }
    }

    #[test]
    fn consecutive_failures_open_it_and_a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config());
        for _ in 0..2 {
            let t = ask(&mut b, t0);
            assert_eq!(b.failed(t, t0), None);
        }
        let t = ask(&mut b, t0);
        assert_eq!(b.succeeded(t, t0), None);
        for _ in 0..2 {
            let t = ask(&mut b, t0);
            assert_eq!(b.failed(t, t0), None);
        }
        assert!(!b.is_open(), "2 in a row after a success");
        let t = ask(&mut b, t0);
        assert_eq!(
            b.failed(t, t0),
            Some(Transition::Opened {
                failures: 3,
                cooldown: 1000 * MS
            })
        );
        assert!(b.is_open());
    }

    /// Each row: (ms since start, what happens, expected admission or transition).
    #[derive(Debug)]
    enum Step {
        /// admit; expect a probe (true), an ordinary ask (false) or a skip (None)
        Try(Option<bool>),
        /// report the last ticket
        Fail(Option<Transition>),
        Succeed(Option<Transition>),
    }

    #[test]
    fn table_open_half_open_probe_backoff_and_close() {
        use Step::*;
        let opened = |f| {
            Some(Transition::Opened {
                failures: f,
                cooldown: 1000 * MS,
            })
        };
        let reopened = |c| Some(Transition::Reopened { cooldown: c * MS });
        let rows: Vec<(u64, Step)> = vec![
            (0, Try(Some(false))),
            (0, Fail(None)),
            (10, Try(Some(false))),
            (10, Fail(None)),
            (20, Try(Some(false))),
            (20, Fail(opened(3))),
            (21, Try(None)),
            (500, Try(None)),
            (1019, Try(None)),
            // cooldown over: one probe, the others skip while it is out
            (1020, Try(Some(true))),
            (1021, Try(None)),
            (1030, Fail(reopened(2000))),
            (2000, Try(None)),
            (3030, Try(Some(true))),
            (3040, Fail(reopened(4000))),
            (7040, Try(Some(true))),
            (7050, Fail(reopened(4000))), // capped
            (11_049, Try(None)),
            (11_050, Try(Some(true))),
            (
                11_060,
                Succeed(Some(Transition::Closed {
                    open_for: 11_040 * MS,
                    skipped: 6,
                })),
            ),
            (11_061, Try(Some(false))),
            (11_061, Fail(None)),
            (11_062, Try(Some(false))),
            (11_062, Fail(None)),
            (11_063, Try(Some(false))),
            // the cooldown starts again from the first one
            (11_063, Fail(opened(3))),
            (12_062, Try(None)),
            (12_063, Try(Some(true))),
        ];
        let t0 = Instant::now();
        let mut b = Breaker::new(config());
        let mut last = None;
        for (i, (ms, step)) in rows.into_iter().enumerate() {
            let now = t0 + Duration::from_millis(ms);
            match step {
                Try(want) => {
                    let got = match b.admit(now) {
                        Admit::Ask(t) => {
                            last = Some(t);
                            Some(t.is_probe())
                        }
                        Admit::Skip => None,
                    };
                    assert_eq!(got, want, "row {i} at {ms} ms");
                }
                Fail(want) => assert_eq!(b.failed(last.unwrap(), now), want, "row {i}"),
                Succeed(want) => assert_eq!(b.succeeded(last.unwrap(), now), want, "row {i}"),
            }
        }
    }

    #[test]
    fn outcomes_of_lookups_from_before_it_opened_change_nothing() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config());
        let slow = ask(&mut b, t0);
        for _ in 0..3 {
            let t = ask(&mut b, t0);
            b.failed(t, t0);
        }
        assert!(b.is_open());
        // The slow lookup admitted before opening answers: still open.
        assert_eq!(b.succeeded(slow, t0 + MS), None);
        assert!(b.is_open());
        assert_eq!(b.admit(t0 + 2 * MS), Admit::Skip);
    }

    #[test]
    fn a_lost_probe_lets_another_go_after_the_probe_timeout() {
        let t0 = Instant::now();
        let mut b = Breaker::new(config());
        for _ in 0..3 {
            let t = ask(&mut b, t0);
            b.failed(t, t0);
        }
        let probe = ask(&mut b, t0 + 1000 * MS);
        assert!(probe.is_probe());
        assert_eq!(b.admit(t0 + 1999 * MS), Admit::Skip);
        let again = ask(&mut b, t0 + 2000 * MS);
        assert!(again.is_probe());
        assert!(matches!(
            b.succeeded(again, t0 + 2001 * MS),
            Some(Transition::Closed { .. })
        ));
    }

    #[test]
    fn zero_failures_never_opens() {
        let t0 = Instant::now();
        let mut b = Breaker::new(BreakerConfig {
            failures: 0,
            ..config()
        });
        for i in 0..100 {
            let t = ask(&mut b, t0 + i * MS);
            assert_eq!(b.failed(t, t0 + i * MS), None);
        }
        assert!(!b.is_open());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Admit,
        /// Report an outstanding ticket (index modulo their count).
        Report(usize, bool),
    }

    fn op() -> impl Strategy<Value = (u64, Op)> {
        (
            0u64..400,
            prop_oneof![
                3 => Just(Op::Admit),
                2 => (any::<usize>(), any::<bool>()).prop_map(|(i, ok)| Op::Report(i, ok)),
            ],
        )
    }

    proptest! {
        /// Under any interleaving of concurrent lookups and outcomes: nothing asks while the
        /// breaker is open and cooling down, at most one probe is out per probe timeout, the
        /// cooldown stays within its bounds, and `failures` current failures in a row always
        /// open it.
        #[test]
        fn invariants_hold_under_any_interleaving(ops in proptest::collection::vec(op(), 1..300)) {
            let c = config();
            let t0 = Instant::now();
            let mut now = t0;
            let mut b = Breaker::new(c);
            let mut out: Vec<Ticket> = Vec::new();
            let mut last_probe: Option<Instant> = None;
            let mut run = 0u32; // current-epoch failures in a row while closed
            for (advance, op) in ops {
                now += Duration::from_millis(advance);
                let before = b.state;
                match op {
                    Op::Admit => match b.admit(now) {
                        Admit::Ask(t) => {
                            match before {
                                State::Closed { .. } => prop_assert!(!t.is_probe()),
                                State::Open { until } => {
                                    prop_assert!(t.is_probe() && now >= until)
                                }
                                State::HalfOpen { probe_sent } => prop_assert!(
                                    t.is_probe() && now >= probe_sent + c.probe_timeout
                                ),
                            }
                            if t.is_probe() {
                                if let Some(p) = last_probe {
                                    prop_assert!(now >= p + c.probe_timeout.min(c.cooldown));
                                }
                                last_probe = Some(now);
                            }
                            out.push(t);
                        }
                        Admit::Skip => prop_assert!(b.is_open()),
                    },
                    Op::Report(i, ok) if !out.is_empty() => {
                        let t = out.remove(i % out.len());
                        let current = t.epoch == b.epoch;
                        let change = if ok { b.succeeded(t, now) } else { b.failed(t, now) };
                        if !current {
                            prop_assert_eq!(change, None);
                            prop_assert_eq!(b.state, before);
                        }
                        if current && matches!(before, State::Closed { .. }) {
                            run = if ok { 0 } else { run + 1 };
                            if run >= c.failures {
                                prop_assert!(b.is_open());
                                run = 0;
                            }
                        }
                        if current && t.is_probe() && !matches!(before, State::Closed { .. }) {
                            prop_assert_eq!(b.is_open(), !ok);
                            run = 0;
                        }
                    }
                    Op::Report(..) => {}
                }
                prop_assert!(b.cooldown >= c.cooldown && b.cooldown <= c.max_cooldown);
                if let State::Open { until } = b.state {
                    prop_assert!(until <= now + c.max_cooldown);
                }
            }
        }
    }

    #[test]
    fn an_announcement_closes_an_open_breaker_at_once() {
        let t0 = Instant::now();
        let mut b = Breaker::new(BreakerConfig::new(
            1,
            Duration::from_secs(10),
            Duration::from_millis(50),
        ));
        assert_eq!(b.close_now(t0), None, "closed already: nothing to report");
        let Admit::Ask(t) = b.admit(t0) else {
            panic!("a closed breaker asks")
        };
        assert!(b.failed(t, t0).is_some());
        assert_eq!(b.admit(t0), Admit::Skip);
        let later = t0 + Duration::from_secs(1);
        assert!(matches!(
            b.close_now(later),
            Some(Transition::Closed { skipped: 1, .. })
        ));
        assert!(
            matches!(b.admit(later), Admit::Ask(_)),
            "no cooldown left to wait"
        );
        // A ticket from before the announcement changes nothing.
        assert_eq!(b.failed(t, later), None);
        assert!(!b.is_open());
    }
}
