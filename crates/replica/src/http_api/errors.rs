//! The JSON API's errors: the protocol's error kinds, each with its HTTP status, answered
//! as `{"error":{"kind":KIND,"message":MESSAGE}}`.

use kvrouter_admin::ApiResponse;
use kvrouter_protocol::{ErrorKind, ErrorReply};

/// Seconds a client should wait before retrying a 503 (its `Retry-After`).
pub const RETRY_AFTER_SECS: u32 = 1;

/// The HTTP status of each error kind (docs/protocol.md, "JSON API for peer routers").
pub fn status_of(kind: ErrorKind) -> u16 {
    use ErrorKind as K;
    match kind {
        K::Malformed
        | K::InvalidRequest
        | K::EmptyPrompt
        | K::PromptTooLong
        | K::UnknownWorker
        | K::InvalidRank => 400,
        K::UnknownModel | K::UnknownRequest => 404,
        K::DuplicateRequest | K::NoAllowedWorkers => 409,
        K::Overloaded | K::QueueTimeout | K::NoWorkers | K::Unavailable => 503,
        K::Internal => 500,
    }
}

/// An API failure: its kind and message, and the status it is answered with (the kind's,
/// unless a caller knows better, e.g. 504 for a forward that timed out).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub kind: ErrorKind,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            status: status_of(kind),
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    pub fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    /// The answer: the JSON error body, with `Retry-After` on a 503.
    pub fn response(&self) -> ApiResponse {
        let r = ApiResponse::error(self.status, self.kind.as_str(), &self.message);
        if self.status == 503 {
            r.with_header("retry-after", RETRY_AFTER_SECS.to_string())
        } else {
            r
        }
    }
}

impl From<ErrorReply> for ApiError {
    fn from(e: ErrorReply) -> Self {
        Self::new(e.kind, e.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_status() {
        use ErrorKind as K;
        let table = [
            (K::Malformed, 400),
            (K::InvalidRequest, 400),
            (K::EmptyPrompt, 400),
            (K::PromptTooLong, 400),
            (K::UnknownWorker, 400),
            (K::InvalidRank, 400),
            (K::UnknownModel, 404),
            (K::UnknownRequest, 404),
            (K::DuplicateRequest, 409),
            (K::NoAllowedWorkers, 409),
            (K::Overloaded, 503),
            (K::QueueTimeout, 503),
            (K::NoWorkers, 503),
            (K::Unavailable, 503),
            (K::Internal, 500),
        ];
        assert_eq!(
            table.len(),
            15,
            "every ErrorKind (docs/protocol.md lists 15)"
        );
        for (kind, status) in table {
            assert_eq!(status_of(kind), status, "{kind}");
        }
    }

    #[test]
    fn the_body_names_the_kind_and_503_says_when_to_retry() {
        let r = ApiError::new(ErrorKind::Overloaded, "all busy").response();
        assert_eq!(r.status, 503);
        assert_eq!(
            r.body,
            r#"{"error":{"kind":"overloaded","message":"all busy"}}"#
        );
        assert_eq!(r.headers, vec![("retry-after", "1".to_string())]);
        let r = ApiError::from(ErrorReply::new(ErrorKind::UnknownModel, "no \"m\"")).response();
        assert_eq!(r.status, 404);
        assert!(r.headers.is_empty());
        assert_eq!(
            r.body,
            r#"{"error":{"kind":"unknown_model","message":"no \"m\""}}"#
        );
        let r = ApiError::new(ErrorKind::Unavailable, "slow peer").with_status(504);
        assert_eq!(r.response().status, 504);
        assert!(r.response().headers.is_empty());
    }
}
