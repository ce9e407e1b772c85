//! The part of Envoy's external processing protocol an endpoint picker speaks, as prost
//! messages written from Envoy's protos (envoy/service/ext_proc/v3/external_processor.proto,
//! envoy/config/core/v3/base.proto, envoy/type/v3/http_status.proto): the field numbers and
//! types are the wire contract; fields an endpoint picker never reads or sets are left out
//! (prost skips unknown fields).

use prost::Message;
use prost_types::Struct;
use std::collections::HashMap;

/// The gRPC method Envoy calls.
pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
/// The service's full name (gRPC health reports it).
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// `envoy.config.core.v3.HeaderValue`: Envoy sends values in `raw_value`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    /// `HeaderAppendAction`: 2 is OVERWRITE_IF_EXISTS_OR_ADD.
    #[prost(int32, tag = "3")]
    pub append_action: i32,
}

/// `HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD`.
pub const OVERWRITE_IF_EXISTS_OR_ADD: i32 = 2;

/// `envoy.config.core.v3.Metadata`.
#[derive(Clone, PartialEq, Message)]
pub struct Metadata {
    #[prost(map = "string, message", tag = "1")]
    pub filter_metadata: HashMap<String, Struct>,
}

/// `HttpHeaders`: the request's or the response's headers.
#[derive(Clone, PartialEq, Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

/// `HttpBody`: a chunk of a body.
#[derive(Clone, PartialEq, Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `HttpTrailers`.
#[derive(Clone, PartialEq, Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

/// What Envoy sends, one message per event of the HTTP exchange.
#[derive(Clone, PartialEq, Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Request>,
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    #[prost(bool, tag = "10")]
    pub observability_mode: bool,
}

pub mod processing_request {
    use super::*;

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "2")]
        RequestHeaders(HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(HttpBody),
        #[prost(message, tag = "6")]
        RequestTrailers(HttpTrailers),
        #[prost(message, tag = "7")]
        ResponseTrailers(HttpTrailers),
    }
}

/// `HeaderMutation`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

/// `StreamedBodyResponse`: a body chunk passed on in FULL_DUPLEX_STREAMED mode.
#[derive(Clone, PartialEq, Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `BodyMutation`.
#[derive(Clone, PartialEq, Message)]
pub struct BodyMutation {
    #[prost(oneof = "body_mutation::Mutation", tags = "1, 2, 3")]
    pub mutation: Option<body_mutation::Mutation>,
}

pub mod body_mutation {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Mutation {
        #[prost(bytes, tag = "1")]
        Body(Vec<u8>),
        #[prost(bool, tag = "2")]
        ClearBody(bool),
        #[prost(message, tag = "3")]
        StreamedResponse(super::StreamedBodyResponse),
    }
}

/// `CommonResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct CommonResponse {
    /// 0 CONTINUE, 1 CONTINUE_AND_REPLACE.
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

/// `HeadersResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `BodyResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `TrailersResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `envoy.type.v3.HttpStatus`: the code is the HTTP status.
#[derive(Clone, PartialEq, Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

/// `ImmediateResponse`: answer the client now, without an upstream.
#[derive(Clone, PartialEq, Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// What the endpoint picker answers.
#[derive(Clone, PartialEq, Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<processing_response::Response>,
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<Struct>,
}

pub mod processing_response {
    use super::*;

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        RequestHeaders(HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(TrailersResponse),
        #[prost(message, tag = "7")]
        ImmediateResponse(ImmediateResponse),
    }
}
