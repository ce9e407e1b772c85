//! The client's one error type.

use kvrouter_bus::BusError;
use kvrouter_protocol::{CodecError, DpRank, ErrorReply, SubjectError, WorkerId};
use std::time::Duration;

/// Everything a client call can fail with. Messages are written for an operator.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The replica answered with an error; its [`ErrorKind`](kvrouter_protocol::ErrorKind) is
    /// preserved.
    #[error("the router refused the request: {0}")]
    Router(ErrorReply),

    /// Nobody is subscribed to the endpoint.
    #[error(
        "no kvrouter replica answers on {subject}: is `kvrouter serve` running with \
         --namespace {namespace}?"
    )]
    NoRouter { namespace: String, subject: String },

    /// A replica is subscribed but did not answer in time.
    #[error(
        "no answer on {subject} within {after:?}: the kvrouter replica is overloaded, stuck \
         or slow (raise the request timeout if this is expected)"
    )]
    Timeout { subject: String, after: Duration },

    /// A generate request failed on the worker (after routing; `free` was still sent).
    #[error(
        "generate request {request_id} on worker {worker_id} rank {dp_rank} failed: {failure}"
    )]
    Worker {
        request_id: String,
        worker_id: WorkerId,
        dp_rank: DpRank,
        failure: WorkerFailure,
    },

    /// The reply could not be decoded: a peer speaking another protocol version, or garbage.
    #[error("undecodable reply on {subject}: {source}")]
    Decode {
        subject: String,
        #[source]
        source: CodecError,
    },

    /// The request itself could not be encoded.
    #[error("cannot encode the request: {0}")]
    Encode(CodecError),

    /// Any other bus failure.
    #[error(transparent)]
    Bus(BusError),

    /// The prompt is longer than a bus of this `max_payload` carries (replicas accept at most
    /// `(max_payload - 64 KiB) / 4` tokens), or the message would not fit at all.
    #[error(
        "prompt of {tokens} tokens ({bytes} bytes encoded) is too large for this bus: with a \
         max_payload of {max_payload} bytes the longest prompt is {max_tokens} tokens \
         (raise max_payload on the NATS server for longer prompts)"
    )]
    PromptTooLarge {
        tokens: usize,
        bytes: usize,
        max_payload: usize,
        max_tokens: usize,
    },

    /// The namespace or model name cannot be used in a subject.
    #[error(transparent)]
    Subject(#[from] SubjectError),
}

/// How a generate stream failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WorkerFailure {
    /// The worker answered with an error event.
    #[error("the worker reported {0}")]
    Error(ErrorReply),
    /// Nobody serves the worker's generate subject (the worker is gone).
    #[error("no worker answers on {0} (the worker left or never started)")]
    NoResponders(String),
    /// The stream stalled for longer than the idle timeout.
    #[error("no event for {0:?} (worker stuck or gone)")]
    Timeout(Duration),
    /// The stream ended without a `Done` event.
    #[error("the event stream ended before Done")]
    StreamEnded,
    /// An event could not be decoded.
    #[error("undecodable event: {0}")]
    Decode(CodecError),
    /// Any other bus failure.
    #[error("bus error: {0}")]
    Bus(BusError),
}

impl ClientError {
    /// What the failure means in the protocol's terms, for callers that answer clients of
    /// their own (HTTP statuses, a gateway's answers): a replica's refusal keeps its kind;
    /// no replica answering in time is `Unavailable`; a prompt the bus cannot carry is
    /// `PromptTooLong`; the rest are `Internal`.
    pub fn kind(&self) -> kvrouter_protocol::ErrorKind {
        use kvrouter_protocol::ErrorKind;
        match self {
            Self::Router(e) => e.kind,
            Self::NoRouter { .. } | Self::Timeout { .. } => ErrorKind::Unavailable,
            Self::PromptTooLarge { .. } => ErrorKind::PromptTooLong,
            _ => ErrorKind::Internal,
        }
    }

    /// A short snake-case label, for counting errors by kind (the router's
    /// [`ErrorKind`](kvrouter_protocol::ErrorKind) for [`ClientError::Router`]).
    pub fn kind_label(&self) -> &'static str {
        match self {
            Self::Router(e) => e.kind.as_str(),
            Self::NoRouter { .. } => "no_router",
            Self::Timeout { .. } => "timeout",
            Self::Worker { .. } => "worker",
            Self::Decode { .. } => "decode",
            Self::Encode(_) => "encode",
            Self::Bus(_) => "bus",
            Self::PromptTooLarge { .. } => "prompt_too_large",
            Self::Subject(_) => "subject",
        }
    }
}
