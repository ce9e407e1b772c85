//! The async driver of one simulated rank: a tokio task that owns a [`RankEngine`], takes
//! commands from a channel and steps the engine in (scaled) real time.
//!
//! **Clocks.** Simulated time (`sim_now`) is the sum of the step durations, plus the idle
//! time between steps. Each step ends at a wall-clock `deadline` that advances by
//! `duration / speedup` per step (a running deadline, so rounding never accumulates). While
//! the rank is idle the simulated clock follows the wall clock (× speedup), so a request's
//! TTFT counts the time it waited.
//!
//! **Ordering.** A step's KV events and outputs are delivered when its deadline passes (that
//! is when the simulated work is done). A state query or a clear arriving before that hands
//! the pending events to the publisher first, then answers: every event whose effect a
//! snapshot includes is in the publisher's channel before the snapshot is taken.

use crate::engine::{OutputKind, RankEngine, Request, SimTime, StepOutcome, SubmitError};
use crate::mock_info::MockInfo;
use kvrouter_protocol::{ErrorReply, EventId, KvEvent, RankLoad};
use kvrouter_worker::PubMsg;
use kvrouter_worker::{stopped, Snapshot};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// The longest wall or simulated span one conversion yields (keeps `Instant` arithmetic safe).
const MAX_SPAN: Duration = Duration::from_secs(365 * 24 * 3600);

/// What a rank task is asked to do.
pub(crate) enum RankCmd {
    /// Queue a request; results go to `out`. With `transferred` its prompt KV arrived by a
    /// transfer that took that long in simulated time (a decode worker's request; see
    /// [`RankEngine::submit_transferred`]): the request counts as having arrived that much
    /// earlier, so its TTFT includes the transfer.
    Submit {
        request: Request,
        transferred: Option<Duration>,
        out: mpsc::UnboundedSender<RankOut>,
    },
    /// The rank's cache as events plus its last event id.
    Snapshot {
        max_blocks: usize,
        reply: oneshot::Sender<Snapshot>,
    },
    /// Drop the prefix cache (emits `Cleared`); answers the `Cleared` event's id.
    Clear { reply: oneshot::Sender<EventId> },
}

/// What a request gets back from its rank.
#[derive(Debug)]
pub(crate) enum RankOut {
    Rejected(SubmitError),
    /// The request failed before reaching the engine (e.g. its KV never arrived).
    Failed(ErrorReply),
    Output(OutputKind),
}

/// Wall time that `sim` simulated time takes at `speedup`.
pub(crate) fn sim_to_wall(sim: Duration, speedup: f64) -> Duration {
    Duration::try_from_secs_f64(sim.as_secs_f64() / speedup)
        .unwrap_or(MAX_SPAN)
        .min(MAX_SPAN)
}

/// Simulated time that passes in `wall` wall time at `speedup`.
pub(crate) fn wall_to_sim(wall: Duration, speedup: f64) -> Duration {
    Duration::try_from_secs_f64(wall.as_secs_f64() * speedup)
        .unwrap_or(MAX_SPAN)
        .min(MAX_SPAN)
}

pub(crate) struct RankTask {
    engine: RankEngine,
    /// Index of the rank inside its worker (`dp_rank - dp_start_rank`).
    index: usize,
    info: Arc<MockInfo>,
    publisher: mpsc::UnboundedSender<PubMsg>,
    requests: FxHashMap<String, mpsc::UnboundedSender<RankOut>>,
    speedup: f64,
    /// Simulated time at the end of the current (pending) step, or now when idle.
    sim_now: SimTime,
    /// Simulated time at which the pending step started.
    step_start: SimTime,
    /// Wall time at which `sim_now` is reached.
    deadline: Instant,
    /// The step under way: delivered when `deadline` passes.
    pending: Option<StepOutcome>,
    last_load: Option<RankLoad>,
}

impl RankTask {
    pub(crate) fn new(
        engine: RankEngine,
        index: usize,
        info: Arc<MockInfo>,
        publisher: mpsc::UnboundedSender<PubMsg>,
        speedup: f64,
    ) -> Self {
        Self {
            engine,
            index,
            info,
            publisher,
            requests: FxHashMap::default(),
            speedup,
            sim_now: Duration::ZERO,
            step_start: Duration::ZERO,
            deadline: Instant::now(),
            pending: None,
            last_load: None,
        }
    }

    pub(crate) async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<RankCmd>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        self.update_load();
        loop {
            if self.pending.is_none() && !self.engine.is_idle() {
                if let Some(out) = self.engine.step(self.sim_now) {
                    self.step_start = self.sim_now;
                    self.sim_now = self.sim_now.saturating_add(out.duration);
                    let wall = sim_to_wall(out.duration, self.speedup);
                    self.deadline = self
                        .deadline
                        .checked_add(wall)
                        .unwrap_or_else(|| Instant::now() + MAX_SPAN);
                    self.pending = Some(out);
                }
            }
            if self.pending.is_none() {
                // Idle: wait for work; simulated time follows the wall clock meanwhile.
                tokio::select! {
                    biased;
                    _ = stopped(&mut shutdown) => break,
                    cmd = commands.recv() => match cmd {
                        None => break,
                        Some(cmd) => {
                            self.catch_up();
                            self.handle(cmd);
                        }
                    },
                }
                continue;
            }
            tokio::select! {
                biased;
                _ = stopped(&mut shutdown) => break,
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(cmd) => self.handle(cmd),
                },
                _ = tokio::time::sleep_until(self.deadline) => self.finish_step(),
            }
        }
        // Requests still in flight see their channel close: the worker answers Unavailable.
        self.flush_pending_events();
    }

    /// After an idle spell: move simulated time forward by the wall time that passed.
    fn catch_up(&mut self) {
        let now = Instant::now();
        if now > self.deadline {
            let idle = now - self.deadline;
            self.sim_now = self.sim_now.saturating_add(wall_to_sim(idle, self.speedup));
            self.deadline = now;
        }
    }

    /// The simulated time now (inside the pending step, if any).
    fn sim_at_now(&self) -> SimTime {
        if self.pending.is_none() {
            return self.sim_now;
        }
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        self.sim_now
            .saturating_sub(wall_to_sim(remaining, self.speedup))
            .max(self.step_start)
    }

    fn handle(&mut self, cmd: RankCmd) {
        match cmd {
            RankCmd::Submit {
                request,
                transferred,
                out,
            } => {
                let now = self.sim_at_now();
                let id = request.request_id.clone();
                let submitted = match transferred {
                    Some(took) => self
                        .engine
                        .submit_transferred(request, now.saturating_sub(took)),
                    None => self.engine.submit(request, now),
                };
                match submitted {
                    Ok(()) => {
                        self.requests.insert(id, out);
                        self.update_load();
                    }
                    Err(e) => {
                        let _ = out.send(RankOut::Rejected(e));
                    }
                }
            }
            RankCmd::Snapshot { max_blocks, reply } => {
                self.flush_pending_events();
                let (events, last_event_id) = self.engine.state_events(max_blocks);
                let _ = reply.send(Snapshot {
                    events,
                    last_event_id,
                });
            }
            RankCmd::Clear { reply } => {
                self.flush_pending_events();
                let ev = self.engine.clear();
                let id = ev.event_id;
                self.send_events(vec![ev]);
                self.update_load();
                let _ = reply.send(id);
            }
        }
    }

    /// Hands the pending step's events to the publisher (once).
    fn flush_pending_events(&mut self) {
        if let Some(p) = self.pending.as_mut() {
            let events = std::mem::take(&mut p.events);
            self.send_events(events);
        }
    }

    fn send_events(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // Fails only when the publisher has stopped (shutdown): nothing to do then.
            let _ = self.publisher.send(PubMsg::Events(events));
        }
    }

    /// The pending step's wall time has passed: deliver its events and outputs.
    fn finish_step(&mut self) {
        let Some(step) = self.pending.take() else {
            return;
        };
        self.send_events(step.events);
        for output in step.outputs {
            let finished = matches!(output.kind, OutputKind::Finished { .. });
            let Some(tx) = self.requests.get(&output.request_id) else {
                continue;
            };
            if tx.send(RankOut::Output(output.kind)).is_err() {
                // The request's stream is gone: stop computing for nobody.
                self.requests.remove(&output.request_id);
                self.engine.abort(&output.request_id);
                continue;
            }
            if finished {
                self.requests.remove(&output.request_id);
            }
        }
        self.update_load();
    }

    /// Stores the rank's load for the publisher and wakes it when it changed.
    fn update_load(&mut self) {
        let l = self.engine.load();
        let load = RankLoad {
            dp_rank: self.info.dp_start_rank + self.index as u32,
            active_blocks: l.active_blocks as u64,
            waiting_requests: l.waiting_requests as u64,
        };
        if self.last_load != Some(load) {
            self.last_load = Some(load);
            self.info.set_load(self.index, load);
        }
    }
}
