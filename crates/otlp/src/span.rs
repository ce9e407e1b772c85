//! A span being recorded: its place in the trace, its timing and attributes, and what is
//! passed on to the next hop. Plain data; the [`crate::Tracer`] decides whether a span
//! records and takes it when it ends.

use crate::proto::{self, KeyValue, Value};
use kvrouter_protocol::TraceContext;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Now in Unix nanoseconds, on the monotonic clock from one wall-clock reading per process:
/// a child span never starts before or ends after its parent, whatever the wall clock does.
fn unix_nanos(at: Instant) -> u64 {
    static ANCHOR: OnceLock<(Instant, u128)> = OnceLock::new();
    let (anchor, anchor_unix) = *ANCHOR.get_or_init(|| {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (Instant::now(), unix.as_nanos())
    });
    let since = at.saturating_duration_since(anchor).as_nanos();
    u64::try_from(anchor_unix + since).unwrap_or(u64::MAX)
}

/// What a span stands for, as OTLP's `SpanKind` says it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    /// Serving a call from another process (a door's HTTP request, the replica's route).
    Server = 2,
    /// Calling another process (the route call on the bus, the engine's HTTP request).
    Client = 3,
}

/// The W3C `sampled` trace flag.
pub const SAMPLED: u8 = 0x01;

/// A new random span id (never all zero).
pub(crate) fn new_span_id() -> [u8; 8] {
    loop {
        let id = fastrand::u64(..).to_le_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// A new random trace id (never all zero).
pub(crate) fn new_trace_id() -> [u8; 16] {
    loop {
        let id = fastrand::u128(..).to_le_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Str(String),
    Int(i64),
    Double(f64),
    Bool(bool),
}

impl From<&str> for AttrValue {
    fn from(v: &str) -> Self {
        Self::Str(v.to_string())
    }
}
impl From<String> for AttrValue {
    fn from(v: String) -> Self {
        Self::Str(v)
    }
}
impl From<bool> for AttrValue {
    fn from(v: bool) -> Self {
        Self::Bool(v)
    }
}
impl From<f64> for AttrValue {
    fn from(v: f64) -> Self {
        Self::Double(v)
    }
}
impl From<u32> for AttrValue {
    fn from(v: u32) -> Self {
        Self::Int(i64::from(v))
    }
}
impl From<u16> for AttrValue {
    fn from(v: u16) -> Self {
        Self::Int(i64::from(v))
    }
}
impl From<u64> for AttrValue {
    /// Saturates at `i64::MAX` (OTLP integers are signed).
    fn from(v: u64) -> Self {
        Self::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<usize> for AttrValue {
    fn from(v: usize) -> Self {
        Self::from(v as u64)
    }
}

impl From<AttrValue> for Value {
    fn from(v: AttrValue) -> Self {
        match v {
            AttrValue::Str(s) => Value::String(s),
            AttrValue::Int(i) => Value::Int(i),
            AttrValue::Double(d) => Value::Double(d),
            AttrValue::Bool(b) => Value::Bool(b),
        }
    }
}

/// A sampled span's record until it ends.
#[derive(Debug)]
pub(crate) struct Recording {
    pub(crate) proto: proto::Span,
}

impl Recording {
    pub(crate) fn new(
        name: &'static str,
        kind: SpanKind,
        context: TraceContext,
        parent: Option<TraceContext>,
    ) -> Self {
        let started = Instant::now();
        let remote = match parent {
            Some(_) => proto::FLAG_HAS_IS_REMOTE | proto::FLAG_IS_REMOTE,
            None => 0,
        };
        Self {
            proto: proto::Span {
                trace_id: context.trace_id.to_vec(),
                span_id: context.parent_id.to_vec(),
                parent_span_id: parent.map(|p| p.parent_id.to_vec()).unwrap_or_default(),
                name: name.to_string(),
                kind: kind as i32,
                start_time_unix_nano: unix_nanos(started),
                end_time_unix_nano: 0,
                attributes: Vec::new(),
                status: None,
                flags: u32::from(context.flags) | remote,
            },
        }
    }

    /// The finished span, ending now.
    pub(crate) fn finish(mut self) -> proto::Span {
        self.proto.end_time_unix_nano = unix_nanos(Instant::now());
        self.proto
    }
}

/// A span of kvrouter's: what the current hop does in a distributed trace.
///
/// It ends when dropped (or at [`Span::end`]); only a sampled span on an exporting tracer
/// records and is exported. Every span knows the context to pass on to the next hop
/// ([`Span::context`]), so a hop that does not export still carries the caller's trace.
#[derive(Debug)]
#[must_use = "a span measures the time until it is dropped"]
pub struct Span {
    pub(crate) context: Option<TraceContext>,
    pub(crate) recording: Option<(Recording, crate::sink::Sink)>,
}

impl Span {
    /// A span that records nothing and passes `context` on unchanged.
    pub fn passthrough(context: Option<TraceContext>) -> Self {
        Self {
            context,
            recording: None,
        }
    }

    /// What the next hop's `traceparent` is: this span as the parent when it exists in a
    /// trace (`None` when no trace is known and none was started).
    pub fn context(&self) -> Option<TraceContext> {
        self.context
    }

    /// Whether attributes set on this span are exported.
    pub fn is_recording(&self) -> bool {
        self.recording.is_some()
    }

    /// Sets an attribute (nothing when not recording). Keys are the `kvrouter.*` names
    /// docs/operations.md lists; values never come from a client's free text.
    pub fn set(&mut self, key: &'static str, value: impl Into<AttrValue>) {
        if let Some((r, _)) = &mut self.recording {
            r.proto
                .attributes
                .push(KeyValue::new(key, value.into().into()));
        }
    }

    /// Marks the span failed, with a short reason.
    pub fn fail(&mut self, message: impl Into<String>) {
        if let Some((r, _)) = &mut self.recording {
            r.proto.status = Some(proto::Status {
                message: message.into(),
                code: proto::STATUS_ERROR,
            });
        }
    }

    /// Ends the span now (dropping it does the same).
    pub fn end(self) {}
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((r, sink)) = self.recording.take() {
            sink.push(r.finish());
        }
    }
}
