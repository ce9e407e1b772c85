//! Where a request's time goes: the phases of one request timed one after the other
//! ([`PhaseClock`]), observed into one histogram per (model, phase) ([`PhaseHistograms`]),
//! and a run-time switch ([`PhaseSwitch`]) so the timing's own cost can be measured with and
//! without it in the same run (`/debug/phase-timing?set=off`).
//!
//! On by default: a lap is one clock read and one histogram observation.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The most phases a request kind may have.
pub const MAX_PHASES: usize = 8;

/// The phases of one kind of request, in the order they happen.
pub trait Phase: Copy + Send + Sync + 'static {
    /// Every phase, in order; at most [`MAX_PHASES`].
    const ALL: &'static [Self];
    /// The `phase` label.
    fn as_str(self) -> &'static str;
    /// Its position in [`Phase::ALL`].
    fn index(self) -> usize;
}

/// The labels of a phase histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub model: String,
    pub phase: &'static str,
}

pub type PhaseFamily = Family<PhaseLabels, Histogram, fn() -> Histogram>;

/// 1 µs to ~33 s: a replica's microsecond phases and a door's seconds-long engine wait.
pub fn phase_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 26))
}

/// An empty family of phase histograms, to register.
pub fn phase_family() -> PhaseFamily {
    Family::new_with_constructor(phase_histogram as fn() -> Histogram)
}

/// Whether phases are timed (on unless switched off).
#[derive(Debug)]
pub struct PhaseSwitch(AtomicBool);

impl Default for PhaseSwitch {
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl PhaseSwitch {
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }

    /// A clock for one request, started now when timing is on.
    pub fn clock<P: Phase>(&self) -> PhaseClock<P> {
        PhaseClock::start(self.is_on())
    }

    /// The `/debug/phase-timing` page: `set=on|off` switches, and every call answers the
    /// state as `{"phase_timing": bool}`.
    pub fn debug_page(&self, query: &str) -> (u16, String) {
        match crate::query_param(query, "set") {
            None => {}
            Some("on") => self.set(true),
            Some("off") => self.set(false),
            Some(other) => {
                let why = format!("set= takes on or off, got {other:?}");
                return (400, serde_json::json!({ "error": why }).to_string());
            }
        }
        let state = serde_json::json!({ "phase_timing": self.is_on() });
        (200, state.to_string())
    }
}

/// The phases of one request, timed back to back: each [`lap`](Self::lap) ends a phase where
/// the previous one ended. A clock started off records nothing and reads no clock.
#[derive(Clone, Debug)]
pub struct PhaseClock<P> {
    mark: Option<Instant>,
    laps: [Option<Duration>; MAX_PHASES],
    _phases: PhantomData<P>,
}

impl<P: Phase> PhaseClock<P> {
    pub fn start(on: bool) -> Self {
        debug_assert!(P::ALL.len() <= MAX_PHASES);
        Self {
            mark: on.then(Instant::now),
            laps: [None; MAX_PHASES],
            _phases: PhantomData,
        }
    }

    /// A clock that records nothing.
    pub fn off() -> Self {
        Self::start(false)
    }

    /// A clock whose first phase began at `at` (e.g. when a message arrived).
    pub fn started_at(at: Option<Instant>) -> Self {
        Self {
            mark: at,
            ..Self::off()
        }
    }

    pub fn is_on(&self) -> bool {
        self.mark.is_some()
    }

    /// Ends `phase` now: the time since the last mark is added to it.
    pub fn lap(&mut self, phase: P) {
        if let Some(mark) = self.mark {
            let now = Instant::now();
            self.add(phase, now.saturating_duration_since(mark));
            self.mark = Some(now);
        }
    }

    /// Moves the mark to now without counting the time since (it belongs to no phase).
    pub fn skip(&mut self) {
        if self.mark.is_some() {
            self.mark = Some(Instant::now());
        }
    }

    /// Adds `d` to `phase` (a phase timed elsewhere, e.g. a queue wait the scheduler knows).
    pub fn add(&mut self, phase: P, d: Duration) {
        if self.mark.is_some() {
            let lap = &mut self.laps[phase.index()];
            *lap = Some(lap.unwrap_or_default() + d);
        }
    }

    /// Moves `d` of `from`'s time to `to` (a part of a lap that was another phase).
    pub fn split(&mut self, from: P, to: P, d: Duration) {
        if let Some(lap) = &mut self.laps[from.index()] {
            let d = d.min(*lap);
            *lap -= d;
            self.add(to, d);
        }
    }

    /// The phases timed so far, in order.
    pub fn laps(&self) -> impl Iterator<Item = (P, Duration)> + '_ {
        P::ALL
            .iter()
            .filter_map(|&p| self.laps[p.index()].map(|d| (p, d)))
    }
}

/// One model's phase histograms, looked up once (a request observes without a label
/// lookup).
pub struct PhaseHistograms<P> {
    by_phase: Vec<Histogram>,
    _phases: PhantomData<P>,
}

impl<P: Phase> PhaseHistograms<P> {
    /// `model`'s histograms in `family` (made now, so every phase shows from the start).
    pub fn new(family: &PhaseFamily, model: &str) -> Self {
        let by_phase = P::ALL
            .iter()
            .map(|p| {
                family
                    .get_or_create(&PhaseLabels {
                        model: model.to_string(),
                        phase: p.as_str(),
                    })
                    .clone()
            })
            .collect();
        Self {
            by_phase,
            _phases: PhantomData,
        }
    }

    pub fn observe(&self, phase: P, d: Duration) {
        self.by_phase[phase.index()].observe(d.as_secs_f64());
    }

    /// Observes every phase the clock timed.
    pub fn record(&self, clock: &PhaseClock<P>) {
        for (phase, d) in clock.laps() {
            self.observe(phase, d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Copy, Clone, Debug, PartialEq)]
    enum P {
        A,
        B,
        C,
    }

    impl Phase for P {
        const ALL: &'static [Self] = &[P::A, P::B, P::C];
        fn as_str(self) -> &'static str {
            match self {
                P::A => "a",
                P::B => "b",
                P::C => "c",
            }
        }
        fn index(self) -> usize {
            self as usize
        }
    }

    #[test]
    fn laps_follow_each_other_and_splits_move_time() {
        let mut c = PhaseClock::<P>::start(true);
        std::thread::sleep(Duration::from_millis(2));
        c.lap(P::A);
        c.add(P::C, Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(3));
        c.lap(P::B);
        c.split(P::B, P::C, Duration::from_millis(1));
        let laps: Vec<(P, Duration)> = c.laps().collect();
        assert_eq!(
            laps.iter().map(|l| l.0).collect::<Vec<_>>(),
            [P::A, P::B, P::C]
        );
        assert!(laps[0].1 >= Duration::from_millis(2));
        assert!(
            laps[1].1 >= Duration::from_millis(2),
            "3 ms less the 1 moved"
        );
        assert!(laps[1].1 < Duration::from_millis(3) + Duration::from_millis(200));
        assert_eq!(laps[2].1, Duration::from_millis(6));
        // A split never moves more than the lap holds.
        c.split(P::A, P::C, Duration::from_secs(9));
        assert_eq!(c.laps().next().map(|l| l.1), Some(Duration::ZERO));
    }

    #[test]
    fn a_clock_that_is_off_records_nothing() {
        let mut c = PhaseClock::<P>::off();
        c.lap(P::A);
        c.add(P::B, Duration::from_secs(1));
        c.skip();
        assert_eq!(c.laps().count(), 0);
        let switch = PhaseSwitch::default();
        assert!(switch.clock::<P>().is_on());
        switch.set(false);
        assert!(!switch.clock::<P>().is_on());
    }

    #[test]
    fn histograms_count_each_phase_under_its_model() {
        let family = phase_family();
        let h = PhaseHistograms::<P>::new(&family, "m");
        let mut c = PhaseClock::<P>::start(true);
        c.lap(P::B);
        c.lap(P::B);
        h.record(&c);
        h.observe(P::C, Duration::from_micros(3));
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register("phase_seconds", "x", family);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        let count = |phase: &str| {
            let key = format!("phase_seconds_count{{model=\"m\",phase=\"{phase}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&key))
                .unwrap_or_else(|| panic!("no {key} in {text}"))
                .to_string()
        };
        assert_eq!(count("a"), "0", "every phase shows from the start");
        assert_eq!(count("b"), "1", "two laps of one phase are one observation");
        assert_eq!(count("c"), "1");
    }

    #[test]
    fn the_debug_page_switches_and_answers_the_state() {
        let s = PhaseSwitch::default();
        assert_eq!(s.debug_page("").1, r#"{"phase_timing":true}"#);
        assert_eq!(s.debug_page("set=off").1, r#"{"phase_timing":false}"#);
        assert!(!s.is_on());
        assert_eq!(s.debug_page("set=maybe").0, 400);
        assert!(!s.is_on(), "a bad value changes nothing");
        assert_eq!(s.debug_page("x=1&set=on").1, r#"{"phase_timing":true}"#);
    }
}
