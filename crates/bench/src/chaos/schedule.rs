//! [`Schedule`]: a seeded, ordered list of fault steps for a chaos run. Plain: no I/O.
//!
//! A run is a sequence of episodes, one fault each, that never overlap: the fault is
//! injected, after a down time it is undone (a killed process restarted, a paused one
//! resumed), and at once a checkpoint compares every replica with the truth. Episodes take
//! the fault kinds in seeded rounds (every kind once per round, shuffled; the engine and
//! bridge kinds only when the fleet has emulated engines), so any run of at least
//! [`FaultKind::ALL`]`.len()` episodes injects every kind.

use serde::Serialize;
use std::time::Duration;

/// What a fault does to the fleet.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a router replica, start it again (same id, same admin port).
    ReplicaKill,
    /// SIGSTOP a replica, SIGCONT it after a while.
    ReplicaPause,
    /// Stop nats-server, start it again on the same port.
    NatsRestart,
    /// SIGKILL a mocker process (several workers), start it again (same worker ids).
    MockerKill,
    /// Make a worker drop its next KV event batches (the mocker's test hook), then send it
    /// traffic so the replicas see the gap.
    EventDrop,
    /// Publish garbage bytes on every subject of the fleet.
    Garbage,
    /// SIGKILL a `kvrouter bridge` (beside an emulated engine that keeps running), start it
    /// again: its worker comes back as a new instance that must rebuild what the engine
    /// still caches.
    BridgeKill,
    /// SIGKILL an emulated engine (`mocker --emulate`), start it again on the same ports
    /// with an empty cache: its bridge must notice, and the replicas follow.
    EngineKill,
}

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::ReplicaKill,
        FaultKind::ReplicaPause,
        FaultKind::NatsRestart,
        FaultKind::MockerKill,
        FaultKind::EventDrop,
        FaultKind::Garbage,
        FaultKind::BridgeKill,
        FaultKind::EngineKill,
    ];

    /// Whether the fault needs an emulated engine and its bridge in the fleet.
    pub fn needs_engines(self) -> bool {
        matches!(self, FaultKind::BridgeKill | FaultKind::EngineKill)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::ReplicaKill => "replica_kill",
            FaultKind::ReplicaPause => "replica_pause",
            FaultKind::NatsRestart => "nats_restart",
            FaultKind::MockerKill => "mocker_kill",
            FaultKind::EventDrop => "event_drop",
            FaultKind::Garbage => "garbage",
            FaultKind::BridgeKill => "bridge_kill",
            FaultKind::EngineKill => "engine_kill",
        }
    }
}

/// One action of the runner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    KillReplica(usize),
    RestartReplica(usize),
    PauseReplica(usize),
    ResumeReplica(usize),
    StopNats,
    StartNats,
    KillMocker(usize),
    RestartMocker(usize),
    KillBridge(usize),
    RestartBridge(usize),
    /// Kill an emulated engine (its bridge keeps running).
    KillEngine(usize),
    /// Start it again on the same ports.
    RestartEngine(usize),
    /// Drop the worker's next `batches` KV event batches, then send each of its ranks
    /// `batches + 2` rounds of fresh prompts (a gap is only seen at the next event).
    DropEvents {
        worker_id: u64,
        batches: u64,
    },
    /// `messages` garbage payloads on each fleet subject.
    Garbage {
        messages: u32,
    },
    /// Pause traffic, wait for in-flight requests, poll every replica until it equals the
    /// truth; then check again once.
    Checkpoint,
}

/// A step at its time (from the start of the run), in the episode of fault `fault`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub at: Duration,
    pub fault: usize,
    pub kind: FaultKind,
    pub step: Step,
}

/// The fleet the schedule picks its victims from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetShape {
    pub replicas: usize,
    pub mockers: usize,
    /// Every worker id (of all mockers).
    pub worker_ids: Vec<u64>,
    /// Emulated engines, each with its bridge (0: no engine faults are scheduled).
    pub engines: usize,
}

/// Episode timing, in milliseconds (ranges are inclusive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Traffic alone before the first fault.
    pub warm_up_ms: u64,
    /// How long a fault lasts before it is undone.
    pub down_ms: (u64, u64),
    /// Traffic alone after a checkpoint, before the next fault.
    pub gap_ms: (u64, u64),
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            warm_up_ms: 2_000,
            down_ms: (500, 4_000),
            gap_ms: (1_000, 3_000),
        }
    }
}

/// The ordered steps of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub steps: Vec<Scheduled>,
    pub faults: usize,
}

impl Schedule {
    /// Episodes from the warm-up until `duration`: each fits whole before it (an episode
    /// that would end later is left out).
    pub fn generate(seed: u64, duration: Duration, shape: &FleetShape, timing: &Timing) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let end = duration.as_millis() as u64;
        let mut t = timing.warm_up_ms;
        let mut steps = Vec::new();
        let mut round: Vec<FaultKind> = Vec::new();
        let mut fault = 0;
        loop {
            if round.is_empty() {
                round = FaultKind::ALL
                    .into_iter()
                    .filter(|k| shape.engines > 0 || !k.needs_engines())
                    .collect();
                rng.shuffle(&mut round);
            }
            let kind = round[round.len() - 1];
            let down = rng.u64(timing.down_ms.0..=timing.down_ms.1);
            let gap = rng.u64(timing.gap_ms.0..=timing.gap_ms.1);
            let (inject, undo) = match kind {
                FaultKind::ReplicaKill => {
                    let r = rng.usize(0..shape.replicas.max(1));
                    (vec![Step::KillReplica(r)], vec![Step::RestartReplica(r)])
                }
                FaultKind::ReplicaPause => {
                    let r = rng.usize(0..shape.replicas.max(1));
                    (vec![Step::PauseReplica(r)], vec![Step::ResumeReplica(r)])
                }
                FaultKind::NatsRestart => (vec![Step::StopNats], vec![Step::StartNats]),
                FaultKind::MockerKill => {
                    let m = rng.usize(0..shape.mockers.max(1));
                    (vec![Step::KillMocker(m)], vec![Step::RestartMocker(m)])
                }
                FaultKind::EventDrop => {
                    let w = if shape.worker_ids.is_empty() {
                        0
                    } else {
                        shape.worker_ids[rng.usize(0..shape.worker_ids.len())]
                    };
                    let batches = rng.u64(1..=3);
                    (
                        vec![Step::DropEvents {
                            worker_id: w,
                            batches,
                        }],
                        vec![],
                    )
                }
                FaultKind::Garbage => (
                    vec![Step::Garbage {
                        messages: rng.u32(1..=5),
                    }],
                    vec![],
                ),
                FaultKind::BridgeKill => {
                    let b = rng.usize(0..shape.engines.max(1));
                    (vec![Step::KillBridge(b)], vec![Step::RestartBridge(b)])
                }
                FaultKind::EngineKill => {
                    let e = rng.usize(0..shape.engines.max(1));
                    (vec![Step::KillEngine(e)], vec![Step::RestartEngine(e)])
                }
            };
            // Instant faults have no down time: their checkpoint follows them.
            let down = if undo.is_empty() { 0 } else { down };
            if t + down > end {
                break;
            }
            round.pop();
            let at = |ms: u64| Duration::from_millis(ms);
            for step in inject {
                steps.push(Scheduled {
                    at: at(t),
                    fault,
                    kind,
                    step,
                });
            }
            for step in undo {
                steps.push(Scheduled {
                    at: at(t + down),
                    fault,
                    kind,
                    step,
                });
            }
            steps.push(Scheduled {
                at: at(t + down),
                fault,
                kind,
                step: Step::Checkpoint,
            });
            fault += 1;
            t += down + gap;
        }
        Self {
            steps,
            faults: fault,
        }
    }

    /// The kind of each fault, in order.
    pub fn kinds(&self) -> Vec<FaultKind> {
        let mut kinds = Vec::with_capacity(self.faults);
        for s in &self.steps {
            if kinds.len() == s.fault {
                kinds.push(s.kind);
            }
        }
        kinds
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn shape() -> FleetShape {
        FleetShape {
            replicas: 3,
            mockers: 2,
            worker_ids: vec![100, 101, 102, 103],
            engines: 2,
        }
    }

    fn gen(seed: u64, secs: u64) -> Schedule {
        Schedule::generate(
            seed,
            Duration::from_secs(secs),
            &shape(),
            &Timing::default(),
        )
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        assert_eq!(gen(7, 120), gen(7, 120));
        assert_ne!(gen(7, 120), gen(8, 120));
    }

    #[test]
    fn a_long_enough_run_injects_every_kind() {
        for seed in 0..50 {
            let s = gen(seed, 60);
            let kinds: BTreeSet<_> = s.kinds().into_iter().collect();
            assert_eq!(kinds.len(), FaultKind::ALL.len(), "seed {seed}: {kinds:?}");
        }
    }

    #[test]
    fn steps_are_ordered_and_within_the_duration() {
        for seed in 0..50 {
            let s = gen(seed, 90);
            assert!(s.steps.windows(2).all(|w| w[0].at <= w[1].at));
            assert!(s.steps.iter().all(|x| x.at <= Duration::from_secs(90)));
            assert!(s.steps.last().is_some_and(|x| x.step == Step::Checkpoint));
        }
    }

    #[test]
    fn restarts_follow_kills_and_resumes_follow_pauses_before_the_checkpoint() {
        for seed in 0..100 {
            let s = gen(seed, 120);
            let mut replica_down: Option<usize> = None;
            let mut replica_paused: Option<usize> = None;
            let mut mocker_down: Option<usize> = None;
            let mut bridge_down: Option<usize> = None;
            let mut engine_down: Option<usize> = None;
            let mut nats_down = false;
            for x in &s.steps {
                match x.step {
                    Step::KillReplica(r) => {
                        assert!(replica_down.is_none());
                        replica_down = Some(r);
                    }
                    Step::RestartReplica(r) => assert_eq!(replica_down.take(), Some(r)),
                    Step::PauseReplica(r) => {
                        assert!(replica_paused.is_none());
                        replica_paused = Some(r);
                    }
                    Step::ResumeReplica(r) => assert_eq!(replica_paused.take(), Some(r)),
                    Step::KillMocker(m) => {
                        assert!(mocker_down.is_none());
                        mocker_down = Some(m);
                    }
                    Step::RestartMocker(m) => assert_eq!(mocker_down.take(), Some(m)),
                    Step::KillBridge(b) => {
                        assert!(bridge_down.is_none() && engine_down.is_none());
                        assert!(b < shape().engines);
                        bridge_down = Some(b);
                    }
                    Step::RestartBridge(b) => assert_eq!(bridge_down.take(), Some(b)),
                    Step::KillEngine(e) => {
                        assert!(bridge_down.is_none() && engine_down.is_none());
                        assert!(e < shape().engines);
                        engine_down = Some(e);
                    }
                    Step::RestartEngine(e) => assert_eq!(engine_down.take(), Some(e)),
                    Step::StopNats => {
                        assert!(!nats_down);
                        nats_down = true;
                    }
                    Step::StartNats => {
                        assert!(nats_down);
                        nats_down = false;
                    }
                    Step::Checkpoint => {
                        assert!(
                            replica_down.is_none()
                                && replica_paused.is_none()
                                && mocker_down.is_none()
                                && bridge_down.is_none()
                                && engine_down.is_none()
                                && !nats_down,
                            "seed {seed}: a checkpoint with a fault still on"
                        );
                    }
                    Step::DropEvents { worker_id, batches } => {
                        assert!(shape().worker_ids.contains(&worker_id));
                        assert!((1..=3).contains(&batches));
                    }
                    Step::Garbage { .. } => {}
                }
            }
            assert!(replica_down.is_none() && replica_paused.is_none() && mocker_down.is_none());
            assert!(bridge_down.is_none() && engine_down.is_none() && !nats_down);
        }
    }

    #[test]
    fn each_fault_has_exactly_one_checkpoint() {
        let s = gen(3, 200);
        let checkpoints = s
            .steps
            .iter()
            .filter(|x| x.step == Step::Checkpoint)
            .count();
        assert_eq!(checkpoints, s.faults);
        assert_eq!(s.kinds().len(), s.faults);
    }

    #[test]
    fn every_engine_is_a_victim_of_both_engine_kinds_over_a_long_run() {
        let s = gen(5, 600);
        for e in 0..shape().engines {
            assert!(s.steps.iter().any(|x| x.step == Step::KillBridge(e)), "{e}");
            assert!(s.steps.iter().any(|x| x.step == Step::KillEngine(e)), "{e}");
        }
    }

    #[test]
    fn a_fleet_without_engines_gets_no_engine_faults_and_every_other_kind() {
        let shape = FleetShape {
            engines: 0,
            ..shape()
        };
        for seed in 0..20 {
            let s = Schedule::generate(seed, Duration::from_secs(60), &shape, &Timing::default());
            let kinds: BTreeSet<_> = s.kinds().into_iter().collect();
            assert!(kinds.iter().all(|k| !k.needs_engines()), "{kinds:?}");
            assert_eq!(
                kinds.len(),
                FaultKind::ALL.len() - 2,
                "seed {seed}: {kinds:?}"
            );
        }
    }

    #[test]
    fn kind_names_are_distinct_snake_case() {
        let names: BTreeSet<_> = FaultKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), FaultKind::ALL.len());
        for k in FaultKind::ALL {
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
        }
    }

    #[test]
    fn a_run_too_short_for_any_episode_is_empty() {
        let s = gen(1, 1);
        assert_eq!(s.faults, 0);
        assert!(s.steps.is_empty());
    }
}
