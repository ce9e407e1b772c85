//! Errors as OpenAI clients read them: `{"error": {"message", "type", "param", "code"}}`
//! with the HTTP status the SDKs map to their exception types.

use bytes::Bytes;
use kvrouter_protocol::ErrorKind;
use serde_json::json;

/// A request that failed, as the client will see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's `type`: `invalid_request_error`, `not_found_error`, ...
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503s).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400, naming the field at fault when there is one.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_string),
            ..Self::new(400, "invalid_request_error", message)
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                401,
                "authentication_error",
                "a valid API key is required (Authorization: Bearer KEY)",
            )
        }
    }

    /// 403: the caller is known but not granted what it asked for.
    pub fn permission_denied(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_string),
            code: Some("permission_denied"),
            ..Self::new(403, "permission_error", message)
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "not_found_error", message)
    }

    pub fn model_not_found(model: &str, served: &[&str]) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::not_found(format!(
                "the model {model:?} does not exist here (served: {})",
                served.join(", ")
            ))
        }
    }

    pub fn prompt_too_long(param: &str, tokens: usize, limit: usize) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            ..Self::invalid(
                Some(param),
                format!(
                    "this model's maximum context length is {limit} tokens; the prompt has \
                     {tokens} tokens"
                ),
            )
        }
    }

    /// 503 with `Retry-After`: the router or the frontend has no room now.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            code: Some("overloaded"),
            ..Self::new(503, "service_unavailable", message)
        }
    }

    /// 429 with `Retry-After`: the request was shed (a queue full or waited out, too many
    /// open at once) and may come back shortly. What a gateway's endpoint picker answers
    /// where the frontend answers 503 ([`ApiError::overloaded`]); no capacity at all stays
    /// a 503.
    pub fn shed(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            code: Some("overloaded"),
            ..Self::new(429, "rate_limit_exceeded", message)
        }
    }

    /// 502: the engines failed the request.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(502, "upstream_error", message)
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, "timeout", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(self.body().to_string())
    }

    /// A route failure, as the client should see it: the router's refusals keep their
    /// meaning (overload and no capacity are 503s a client retries). `kind` is the failure's
    /// kind in the protocol's terms (`kvrouter_client::ClientError::kind`).
    pub fn from_route(kind: ErrorKind, message: impl Into<String>) -> Self {
        let m = message.into();
        match kind {
            ErrorKind::Overloaded
            | ErrorKind::QueueTimeout
            | ErrorKind::NoWorkers
            | ErrorKind::Unavailable => Self::overloaded(m),
            ErrorKind::UnknownModel => Self {
                param: Some("model".into()),
                code: Some("model_not_found"),
                ..Self::not_found(m)
            },
            ErrorKind::PromptTooLong | ErrorKind::EmptyPrompt => Self::invalid(Some("prompt"), m),
            ErrorKind::UnknownWorker
            | ErrorKind::InvalidRank
            | ErrorKind::NoAllowedWorkers
            | ErrorKind::InvalidRequest
            | ErrorKind::Malformed
            | ErrorKind::DuplicateRequest => Self::invalid(Some("kvrouter"), m),
            ErrorKind::UnknownRequest | ErrorKind::Internal => Self::internal(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_refusals_keep_their_meaning() {
        let router = |kind| ApiError::from_route(kind, "x");
        assert_eq!(router(ErrorKind::Overloaded).status, 503);
        assert_eq!(router(ErrorKind::Overloaded).retry_after, Some(1));
        assert_eq!(router(ErrorKind::QueueTimeout).status, 503);
        assert_eq!(router(ErrorKind::NoWorkers).status, 503);
        assert_eq!(router(ErrorKind::Unavailable).status, 503);
        assert_eq!(router(ErrorKind::UnknownModel).status, 404);
        assert_eq!(router(ErrorKind::InvalidRank).status, 400);
        assert_eq!(router(ErrorKind::Internal).status, 500);
    }

    #[test]
    fn the_body_is_openai_shaped() {
        let e = ApiError::invalid(Some("prompt"), "bad");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "prompt", "code": null}})
        );
    }
}
