//! The plain core of `bench hostile`: the phases, what a phase measured, the report and its
//! invariants. No I/O.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One adversary, run alone for a phase while the honest traffic goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attack {
    /// Slow heads, half-open connections and bodies that never come, on every HTTP listener.
    Slowloris,
    /// Bodies over the limit, 1e6 nested `[`, a huge array in an unknown field.
    Bodies,
    /// Random 500 KB model names (completions and JSON API routes).
    Labels,
    /// 200,000-entry `allowed_workers` lists.
    AllowedWorkers,
    /// A malformed msgpack frame on the engine's KV event stream every second, and one left
    /// in its replay buffer.
    PoisonFrames,
    /// 1 MiB request ids (header, body, path).
    RequestIds,
    /// Another tenant of the JSON API, knowing the honest clients' request ids (not their
    /// leases): marks, extends, frees and abandons them, over HTTP and over the bus.
    LeaseTheft,
    /// A valid bridge's credentials, for a worker that does not run: registrations, events,
    /// loads and heartbeats for the running worker, on its subjects and on its own.
    ForgedWorker,
    /// A frontend's credentials: answers route and lease requests, publishes sync batches.
    FrontendImpostor,
    /// Frontend, peer and bridge credentials subscribing to every reply on the bus.
    ReplyReader,
}

impl Attack {
    /// Every attack, in the default order: the poisoned frames last, as what they break
    /// (the bridge's memory) would otherwise show in every later phase.
    pub const ALL: [Attack; 10] = [
        Attack::Slowloris,
        Attack::Bodies,
        Attack::Labels,
        Attack::AllowedWorkers,
        Attack::RequestIds,
        Attack::LeaseTheft,
        Attack::ForgedWorker,
        Attack::FrontendImpostor,
        Attack::ReplyReader,
        Attack::PoisonFrames,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Attack::Slowloris => "slowloris",
            Attack::Bodies => "bodies",
            Attack::Labels => "labels",
            Attack::AllowedWorkers => "allowed_workers",
            Attack::PoisonFrames => "poison_frames",
            Attack::RequestIds => "request_ids",
            Attack::LeaseTheft => "lease_theft",
            Attack::ForgedWorker => "forged_worker",
            Attack::FrontendImpostor => "frontend_impostor",
            Attack::ReplyReader => "reply_reader",
        }
    }

    pub fn named(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// What the attack's rate counts.
    pub fn unit(self) -> &'static str {
        match self {
            Attack::Slowloris => "conn/s",
            Attack::PoisonFrames => "frames/s",
            Attack::LeaseTheft | Attack::ForgedWorker | Attack::FrontendImpostor => "op/s",
            Attack::ReplyReader => "sub/s",
            _ => "req/s",
        }
    }

    /// Whether the attacker acts as someone it is not: each of its actions must be refused,
    /// and the refusals counted (by the fleet or by nats-server).
    pub fn impersonates(self) -> bool {
        matches!(
            self,
            Attack::LeaseTheft
                | Attack::ForgedWorker
                | Attack::FrontendImpostor
                | Attack::ReplyReader
        )
    }
}

/// The phases of a run: clean, then one per attack.
pub fn phases(attacks: &[Attack]) -> Vec<Option<Attack>> {
    std::iter::once(None)
        .chain(attacks.iter().copied().map(Some))
        .collect()
}

/// One kind of honest request in one phase.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HonestFigures {
    pub sent: u64,
    pub ok: u64,
    /// ok / sent (1 when nothing was sent, which is a failure of its own).
    pub success: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Failures by what happened: an HTTP status, "timeout", "connect", "io".
    pub failures: BTreeMap<String, u64>,
}

impl HonestFigures {
    /// From each request's (ok, latency in ms, failure label).
    pub fn new(samples: &[(bool, f64, String)]) -> Self {
        let mut lat: Vec<f64> = samples.iter().filter(|s| s.0).map(|s| s.1).collect();
        lat.sort_by(f64::total_cmp);
        let ok = lat.len() as u64;
        let mut failures = BTreeMap::new();
        for (_, _, why) in samples.iter().filter(|s| !s.0) {
            *failures.entry(why.clone()).or_insert(0) += 1;
        }
        let sent = samples.len() as u64;
        Self {
            sent,
            ok,
            success: if sent == 0 {
                1.0
            } else {
                ok as f64 / sent as f64
            },
            p50_ms: percentile(&lat, 0.50),
            p99_ms: percentile(&lat, 0.99),
            failures,
        }
    }
}

/// The `q` quantile of sorted values (nearest rank); 0 for none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What the attackers did in a phase.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AttackFigures {
    /// Connections opened (slowloris), requests sent or frames injected.
    pub ops: u64,
    pub unit: String,
    pub rate: f64,
    /// CPU seconds (user + system) of the attackers' thread (`getrusage(RUSAGE_THREAD)`):
    /// every attack client runs on one current-thread runtime of its own.
    pub cpu_secs: f64,
    /// What came back, counted: an HTTP status, "cut" (the server closed a slow connection),
    /// "held" (still open at the end of the phase), "refused", "timeout", "io".
    pub outcomes: BTreeMap<String, u64>,
    /// Slowloris: the most connections open at once, per listener.
    pub peak_open: BTreeMap<String, u64>,
    /// An impersonating attacker's actions that took effect: a forged lease operation
    /// answered ok, a forged message delivered, a reply read that was not its own.
    pub breaches: u64,
    /// What each breach was (the first few).
    pub breach_examples: Vec<String>,
}

/// The outcome an attack counts for each refusal nats-server sent it.
pub const NATS_REFUSED: &str = "refused by nats-server";

/// One phase of the run.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseReport {
    /// "clean" or the attack's name.
    pub phase: String,
    pub secs: f64,
    pub attack: Option<AttackFigures>,
    /// OpenAI completions through the frontend.
    pub completions: HonestFigures,
    /// `POST /v1/route` on a replica's JSON API.
    pub routes: HonestFigures,
    /// Per process, the largest resident set sampled during the phase, MiB.
    pub peak_rss_mib: BTreeMap<String, f64>,
    /// Processes found dead during the phase.
    pub died: Vec<String>,
    /// How much each of the fleet's refusal counters grew from the phase's start until the
    /// fleet served again (`lease_refused`, `misattributed`, `http_auth_refused`,
    /// `frontend_auth_refused`), summed over the processes.
    pub refusals: BTreeMap<String, u64>,
    /// Seconds from the phase's end until the fleet served a completion and a route again
    /// (None: not within the recovery timeout).
    pub recovery_secs: Option<f64>,
}

/// One process of the fleet, over the whole run.
#[derive(Clone, Debug, Serialize)]
pub struct ProcReport {
    pub name: String,
    /// VmHWM at the end (or the largest VmRSS sampled if it died), MiB.
    pub peak_rss_mib: f64,
    /// Phase in which it died (it is not restarted), if it did.
    pub died_in: Option<String>,
    /// The bench SIGKILLed it when its resident set reached this (MiB): past the kill
    /// ceiling, it would have taken the machine with it.
    pub killed_at_mib: Option<f64>,
    /// Its --drain-timeout-secs (None: not ours, e.g. nats-server, stopped last).
    pub drain_timeout_secs: Option<f64>,
    /// Seconds from SIGTERM to its exit, None if it did not exit within the wait.
    pub exit_secs: Option<f64>,
    pub exit_code: Option<i32>,
    pub exited_in_time: bool,
}

/// The thresholds the run is judged by.
#[derive(Clone, Debug, Serialize)]
pub struct Thresholds {
    /// Every phase's honest success rate (completions and routes) at least this.
    pub min_success: f64,
    /// Every process's peak resident set at most this many MiB.
    pub max_rss_mib: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct HostileReport {
    pub seed: u64,
    pub phase_secs: f64,
    pub slow_connections: usize,
    pub thresholds: Thresholds,
    pub phases: Vec<PhaseReport>,
    pub processes: Vec<ProcReport>,
    pub wall_secs: f64,
    /// The invariants broken (empty: passed).
    pub failures: Vec<String>,
}

impl HostileReport {
    /// Fills in `failures` from the figures.
    pub fn evaluate(&mut self) {
        let t = &self.thresholds;
        let mut f = Vec::new();
        for p in &self.phases {
            let counted: u64 = p.refusals.values().sum();
            match &p.attack {
                None if counted > 0 => f.push(format!(
                    "{}: the fleet refused honest traffic: {:?}",
                    p.phase, p.refusals
                )),
                Some(a) if a.breaches > 0 => f.push(format!(
                    "{}: {} of the attacker's actions took effect, e.g. {:?}",
                    p.phase, a.breaches, a.breach_examples
                )),
                Some(a)
                    if Attack::named(&p.phase).is_some_and(Attack::impersonates)
                        && a.ops > 0
                        && counted + a.outcomes.get(NATS_REFUSED).copied().unwrap_or(0) == 0 =>
                {
                    f.push(format!(
                        "{}: {} forged actions, and no refusal counted anywhere",
                        p.phase, a.ops
                    ))
                }
                _ => {}
            }
            if p.recovery_secs.is_none() {
                f.push(format!(
                    "{}: the fleet did not serve again after the phase",
                    p.phase
                ));
            }
            for (what, h) in [("completions", &p.completions), ("routes", &p.routes)] {
                if h.sent == 0 {
                    f.push(format!("{}: no honest {what} were sent", p.phase));
                } else if h.success < t.min_success {
                    f.push(format!(
                        "{}: honest {what} succeeded {:.1}% < {:.1}% ({:?})",
                        p.phase,
                        100.0 * h.success,
                        100.0 * t.min_success,
                        h.failures
                    ));
                }
            }
        }
        for p in &self.processes {
            match (&p.died_in, p.killed_at_mib) {
                (Some(ph), Some(m)) => f.push(format!(
                    "{} grew to {m:.0} MiB during {ph} and was killed",
                    p.name
                )),
                (Some(ph), None) => f.push(format!("{} died during {ph}", p.name)),
                _ => {}
            }
            if p.peak_rss_mib > t.max_rss_mib {
                f.push(format!(
                    "{} peaked at {:.0} MiB > {:.0} MiB",
                    p.name, p.peak_rss_mib, t.max_rss_mib
                ));
            }
            if p.died_in.is_none() && p.drain_timeout_secs.is_some() && !p.exited_in_time {
                f.push(match p.exit_secs {
                    Some(s) => format!(
                        "{} took {s:.2} s to exit on SIGTERM (drain timeout {:.1} s)",
                        p.name,
                        p.drain_timeout_secs.unwrap_or(0.0)
                    ),
                    None => format!("{} did not exit on SIGTERM", p.name),
                });
            }
        }
        self.failures = f;
    }

    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// The text table.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let clean = self.phases.first();
        let ratio = |v: f64, base: Option<f64>| match base {
            Some(b) if b > 0.0 => format!("{:.1}x", v / b),
            _ => "-".into(),
        };
        let _ = writeln!(
            s,
            "hostile run: {} phases of {:.0} s, seed {}, {} slow connections per listener ({:.0} s wall)",
            self.phases.len(),
            self.phase_secs,
            self.seed,
            self.slow_connections,
            self.wall_secs
        );
        let _ = writeln!(
            s,
            "{:<16} {:>14} {:>8} | {:>7} {:>8} {:>8} {:>6} | {:>7} {:>8} {:>8} {:>6} | {:>20}",
            "phase",
            "attack rate",
            "atk cpu",
            "compl",
            "p50 ms",
            "p99 ms",
            "p99/c",
            "routes",
            "p50 ms",
            "p99 ms",
            "p99/c",
            "top RSS MiB"
        );
        for p in &self.phases {
            let (rate, cpu) = match &p.attack {
                Some(a) => (
                    format!("{:.0} {}", a.rate, a.unit),
                    format!("{:.2} s", a.cpu_secs),
                ),
                None => ("-".into(), "-".into()),
            };
            let (top, max_rss) =
                p.peak_rss_mib
                    .iter()
                    .fold(("-", 0.0), |m, (k, &v)| if v > m.1 { (k, v) } else { m });
            let _ = writeln!(
                s,
                "{:<16} {:>14} {:>8} | {:>6.1}% {:>8.1} {:>8.1} {:>6} | {:>6.1}% {:>8.2} {:>8.2} {:>6} | {:>20}",
                p.phase,
                rate,
                cpu,
                100.0 * p.completions.success,
                p.completions.p50_ms,
                p.completions.p99_ms,
                ratio(p.completions.p99_ms, clean.map(|c| c.completions.p99_ms)),
                100.0 * p.routes.success,
                p.routes.p50_ms,
                p.routes.p99_ms,
                ratio(p.routes.p99_ms, clean.map(|c| c.routes.p99_ms)),
                format!("{max_rss:.0} {top}")
            );
        }
        let _ = writeln!(s, "attack outcomes:");
        for p in &self.phases {
            if let Some(a) = &p.attack {
                let back = p
                    .recovery_secs
                    .map_or("not within the wait".into(), |r| format!("{r:.1} s"));
                let _ = writeln!(
                    s,
                    "  {:<16} {:?}; served again after {back}",
                    p.phase, a.outcomes
                );
                if !a.peak_open.is_empty() {
                    let _ = writeln!(s, "  {:<16} open at once: {:?}", "", a.peak_open);
                }
                if !p.refusals.is_empty() || a.breaches > 0 {
                    let _ = writeln!(
                        s,
                        "  {:<16} the fleet counted {:?}; took effect: {}",
                        "", p.refusals, a.breaches
                    );
                }
            }
            for (what, h) in [("completions", &p.completions), ("routes", &p.routes)] {
                if !h.failures.is_empty() {
                    let _ = writeln!(
                        s,
                        "  {:<16} honest {what} failed: {:?}",
                        p.phase, h.failures
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "{:<14} {:>10} {:>14} {:>10} {:>10} {:>6}",
            "process", "peak MiB", "died", "drain s", "exit s", "code"
        );
        for p in &self.processes {
            let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
            let _ = writeln!(
                s,
                "{:<14} {:>10.1} {:>14} {:>10} {:>10} {:>6}",
                p.name,
                p.peak_rss_mib,
                p.died_in.as_deref().unwrap_or("-"),
                opt(p.drain_timeout_secs),
                opt(p.exit_secs),
                p.exit_code.map_or("-".into(), |c| c.to_string())
            );
        }
        if self.failures.is_empty() {
            let _ = writeln!(
                s,
                "passed: honest success >= {:.1}% in every phase, no crash, peak RSS <= {:.0} MiB, every exit on SIGTERM within its drain timeout",
                100.0 * self.thresholds.min_success,
                self.thresholds.max_rss_mib
            );
        } else {
            for f in &self.failures {
                let _ = writeln!(s, "FAILED: {f}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ok: bool, ms: f64) -> (bool, f64, String) {
        (ok, ms, if ok { String::new() } else { "503".into() })
    }

    #[test]
    fn percentiles_and_success() {
        let s: Vec<_> = (1..=100).map(|i| sample(i != 7, i as f64)).collect();
        let h = HonestFigures::new(&s);
        assert_eq!((h.sent, h.ok), (100, 99));
        assert_eq!(h.failures["503"], 1);
        assert_eq!(h.p50_ms, 51.0);
        assert_eq!(h.p99_ms, 100.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
    }

    #[test]
    fn phases_start_clean() {
        let p = phases(&Attack::ALL);
        assert_eq!(p.len(), 11);
        assert_eq!(p[0], None);
        for a in Attack::ALL {
            assert_eq!(Attack::named(a.as_str()), Some(a));
        }
    }

    #[test]
    fn invariants() {
        let phase = |name: &str, ok: bool| PhaseReport {
            phase: name.into(),
            secs: 1.0,
            attack: None,
            completions: HonestFigures::new(&[sample(true, 1.0), sample(ok, 1.0)]),
            routes: HonestFigures::new(&[sample(true, 1.0)]),
            peak_rss_mib: BTreeMap::new(),
            died: vec![],
            refusals: BTreeMap::new(),
            recovery_secs: Some(0.1),
        };
        let proc = |name: &str, rss: f64, died: Option<&str>, in_time: bool| ProcReport {
            name: name.into(),
            peak_rss_mib: rss,
            died_in: died.map(String::from),
            killed_at_mib: None,
            drain_timeout_secs: Some(5.0),
            exit_secs: Some(1.0),
            exit_code: Some(0),
            exited_in_time: in_time,
        };
        let mut r = HostileReport {
            seed: 1,
            phase_secs: 1.0,
            slow_connections: 10,
            thresholds: Thresholds {
                min_success: 0.99,
                max_rss_mib: 100.0,
            },
            phases: vec![phase("clean", true), phase("labels", true)],
            processes: vec![proc("r0", 50.0, None, true)],
            wall_secs: 1.0,
            failures: vec![],
        };
        r.evaluate();
        assert!(r.passed(), "{:?}", r.failures);
        assert!(r.render().contains("passed"));
        r.phases[1] = phase("labels", false);
        r.processes.push(proc("bridge", 500.0, None, false));
        r.processes
            .push(proc("frontend", 5.0, Some("bodies"), false));
        r.evaluate();
        assert_eq!(r.failures.len(), 4, "{:?}", r.failures);
        assert!(r.render().contains("FAILED: frontend died during bodies"));
    }

    #[test]
    fn an_impostor_must_be_refused_and_counted() {
        let phase =
            |name: &str, refusals: &[(&str, u64)], attack: Option<AttackFigures>| PhaseReport {
                phase: name.into(),
                secs: 1.0,
                attack,
                completions: HonestFigures::new(&[sample(true, 1.0)]),
                routes: HonestFigures::new(&[sample(true, 1.0)]),
                peak_rss_mib: BTreeMap::new(),
                died: vec![],
                refusals: refusals.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                recovery_secs: Some(0.1),
            };
        let attack = |ops: u64, server_refused: u64, breaches: u64| AttackFigures {
            ops,
            outcomes: [(NATS_REFUSED.to_string(), server_refused)]
                .into_iter()
                .filter(|o| o.1 > 0)
                .collect(),
            breaches,
            breach_examples: vec!["free answered 200".into(); breaches.min(1) as usize],
            ..AttackFigures::default()
        };
        let judge = |phases: Vec<PhaseReport>| {
            let mut r = HostileReport {
                seed: 1,
                phase_secs: 1.0,
                slow_connections: 0,
                thresholds: Thresholds {
                    min_success: 0.99,
                    max_rss_mib: 100.0,
                },
                phases,
                processes: vec![],
                wall_secs: 1.0,
                failures: vec![],
            };
            r.evaluate();
            r.failures
        };
        // Refused and counted, by the fleet or by nats-server: passed.
        let ok = judge(vec![
            phase("clean", &[], None),
            phase(
                "lease_theft",
                &[("lease_refused", 40)],
                Some(attack(40, 0, 0)),
            ),
            phase("reply_reader", &[], Some(attack(10, 10, 0))),
        ]);
        assert!(ok.is_empty(), "{ok:?}");
        // One forged action went through; another attack's were refused silently; honest
        // traffic was refused in the clean phase.
        let failed = judge(vec![
            phase("clean", &[("http_auth_refused", 1)], None),
            phase(
                "lease_theft",
                &[("lease_refused", 39)],
                Some(attack(40, 0, 1)),
            ),
            phase("forged_worker", &[], Some(attack(12, 0, 0))),
            // Not an impersonation: nothing needs counting.
            phase("labels", &[], Some(attack(12, 0, 0))),
        ]);
        assert_eq!(failed.len(), 3, "{failed:?}");
        assert!(failed[0].contains("refused honest traffic"));
        assert!(failed[1].contains("1 of the attacker's actions took effect"));
        assert!(failed[2].contains("no refusal counted"));
    }
}
