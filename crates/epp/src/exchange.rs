//! One HTTP exchange as Envoy's ext_proc stream tells it (request headers, request body
//! chunks, response headers, response body chunks), and what the endpoint picker answers:
//! a plain state machine, no I/O. The stream's task feeds it Envoy's messages, routes when
//! it asks ([`Effect::Route`]), and carries out its effects: answers to Envoy, the booking's
//! prefill mark and its end.
//!
//! Bodies are `FULL_DUPLEX_STREAMED` both ways: Envoy forwards exactly the body chunks the
//! picker streams back, so the request body is held until the pick (the engine gets it in one
//! piece) and each response chunk is passed back as it comes.

use crate::ext_proc::{
    body_mutation, processing_request::Request, processing_response::Response, BodyMutation,
    BodyResponse, CommonResponse, HeaderMutation, HeaderValue, HeaderValueOption, HeadersResponse,
    HttpBody, HttpHeaders, HttpStatus, ImmediateResponse, Metadata, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, OVERWRITE_IF_EXISTS_OR_ADD,
};
use bytes::{Bytes, BytesMut};
use kvrouter_openai::door_metrics::CachedTokensScan;
use kvrouter_openai::ApiError;
use prost_types::{value::Kind, Struct, Value};

/// The header and `envoy.lb` metadata key naming the picked endpoint (and fallbacks).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace the gateway reads the pick from.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Where the gateway may restrict the choice: `filter_metadata[SUBSET_NAMESPACE][SUBSET_KEY]`.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Where the gateway reports the endpoint that served (after a fallback, another one).
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// What the picker decided for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    /// `ip:port`: the pick first, then fallbacks in order.
    pub endpoints: Vec<String>,
    /// Headers the engine needs beside the request's own (vLLM's rank header).
    pub headers: Vec<(String, String)>,
    /// The request body as the engine gets it.
    pub body: Bytes,
}

/// What the exchange asks of its driver.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Send this to Envoy.
    Send(ProcessingResponse),
    /// The request is whole: understand and route it, then call [`Exchange::picked`] or
    /// [`Exchange::refused`].
    Route(RouteAsk),
    /// The engine's answer started (its first body bytes): the prefill is done.
    PrefillDone,
    /// The gateway reports another endpoint served the request than the one picked.
    ServedBy(String),
    /// A successful answer ended whole, with the cached prompt tokens the engine reported
    /// in it, if any (before [`Effect::Finish`]).
    Answered(Option<u64>),
    /// The exchange is over (answered, refused or failed): end the booking if one is held.
    Finish,
}

/// A whole request, for routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteAsk {
    /// The request's path (`/v1/chat/completions`, `/v1/completions`).
    pub path: Option<String>,
    pub body: Bytes,
    /// The request's `authorization` header, if it had one (API keys).
    pub authorization: Option<String>,
    /// The gateway's subset hint: the endpoints the pick must come from (`None`: any).
    pub subset: Option<Vec<String>>,
    /// The request's `traceparent` header, as sent (the picker parses it).
    pub traceparent: Option<String>,
}

/// Where the exchange is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Headers,
    Body,
    Routing,
    Forwarded,
    Responding,
    Done,
}

/// Why the stream cannot go on (the driver ends it with an error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error("ext_proc message out of order: {got} while {phase}")]
    OutOfOrder {
        got: &'static str,
        phase: &'static str,
    },
    #[error("an ext_proc message with no request in it")]
    Empty,
}

pub struct Exchange {
    phase: Phase,
    max_body_bytes: usize,
    body: BytesMut,
    path: Option<String>,
    authorization: Option<String>,
    subset: Option<Vec<String>>,
    traceparent: Option<String>,
    picked: Option<String>,
    /// The engine's status, once its answer's headers came.
    status: Option<u16>,
    /// A successful answer's bytes, read for the engine's cached-token count.
    answer_scan: Option<CachedTokensScan>,
}

impl Exchange {
    /// `max_body_bytes`: the largest request body taken (the frontend's limit).
    pub fn new(max_body_bytes: usize) -> Self {
        Self {
            phase: Phase::Headers,
            max_body_bytes,
            body: BytesMut::new(),
            path: None,
            authorization: None,
            subset: None,
            traceparent: None,
            picked: None,
            status: None,
            answer_scan: None,
        }
    }

    /// The endpoint picked, once routed.
    pub fn picked(&self) -> Option<&str> {
        self.picked.as_deref()
    }

    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Still reading the request (its headers or body), not yet routed.
    pub fn reading_request(&self) -> bool {
        matches!(self.phase, Phase::Headers | Phase::Body)
    }

    /// One message from Envoy.
    pub fn on_message(&mut self, m: ProcessingRequest) -> Result<Vec<Effect>, ExchangeError> {
        let observe_only = m.observability_mode;
        let metadata = m.metadata_context;
        let request = m.request.ok_or(ExchangeError::Empty)?;
        if self.is_done() {
            // Answered already (an immediate response): Envoy may still send what it had in
            // flight, which needs no answer.
            return Ok(Vec::new());
        }
        let effects = match request {
            Request::RequestHeaders(h) => self.request_headers(h, metadata)?,
            Request::RequestBody(b) => self.request_body(b)?,
            Request::RequestTrailers(_) => {
                vec![send(Response::RequestTrailers(TrailersResponse::default()))]
            }
            Request::ResponseHeaders(h) => self.response_headers(h, metadata)?,
            Request::ResponseBody(b) => self.response_body(b)?,
            Request::ResponseTrailers(_) => {
                let mut out = vec![send(
                    Response::ResponseTrailers(TrailersResponse::default()),
                )];
                out.extend(self.finish());
                out
            }
        };
        // In observability mode Envoy takes no answers.
        Ok(if observe_only {
            effects
                .into_iter()
                .filter(|e| !matches!(e, Effect::Send(_)))
                .collect()
        } else {
            effects
        })
    }

    /// The route for [`Effect::Route`] was taken: answer the headers with the pick, and
    /// pass the body on.
    pub fn picked_route(&mut self, pick: Pick) -> Vec<Effect> {
        if self.phase != Phase::Routing {
            return Vec::new();
        }
        let destination = pick.endpoints.join(",");
        let mut set = vec![option(DESTINATION, &destination)];
        set.extend(pick.headers.iter().map(|(k, v)| option(k, v)));
        // The engine gets a body of another length when the picker rewrote it.
        set.push(option("content-length", &pick.body.len().to_string()));
        let headers = ProcessingResponse {
            response: Some(Response::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers: set,
                        remove_headers: Vec::new(),
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            })),
            dynamic_metadata: Some(lb_metadata(&destination)),
        };
        self.picked = pick.endpoints.first().cloned();
        self.phase = Phase::Forwarded;
        vec![
            Effect::Send(headers),
            send(Response::RequestBody(streamed(pick.body, true))),
        ]
    }

    /// The request cannot be routed (or is refused): answer the client now.
    pub fn refused(&mut self, e: &ApiError) -> Vec<Effect> {
        if self.is_done() {
            return Vec::new();
        }
        self.immediate(e)
    }

    /// The stream ended (Envoy or the client went away): whatever is held ends.
    pub fn broken(&mut self) -> Vec<Effect> {
        // An answer cut short reports nothing.
        self.answer_scan = None;
        self.finish()
    }

    fn request_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Result<Vec<Effect>, ExchangeError> {
        self.expect(Phase::Headers, "request headers")?;
        self.path = header(&h, ":path");
        self.authorization = header(&h, "authorization");
        self.traceparent = header(&h, "traceparent");
        self.subset = subset_hint(metadata.as_ref());
        if h.end_of_stream {
            return Ok(self.immediate(&ApiError::invalid(
                None,
                "the request has no body: a JSON OpenAI request is required",
            )));
        }
        self.phase = Phase::Body;
        Ok(Vec::new())
    }

    fn request_body(&mut self, b: HttpBody) -> Result<Vec<Effect>, ExchangeError> {
        self.expect(Phase::Body, "a request body chunk")?;
        if self.body.len() + b.body.len() > self.max_body_bytes {
            let mut e = ApiError::invalid(
                None,
                format!(
                    "the request body is over {} bytes (--max-body-bytes)",
                    self.max_body_bytes
                ),
            );
            e.status = 413;
            self.body = BytesMut::new();
            return Ok(self.immediate(&e));
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return Ok(Vec::new());
        }
        self.phase = Phase::Routing;
        Ok(vec![Effect::Route(RouteAsk {
            path: self.path.take(),
            body: std::mem::take(&mut self.body).freeze(),
            authorization: self.authorization.take(),
            subset: self.subset.take(),
            traceparent: self.traceparent.take(),
        })])
    }

    fn response_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Result<Vec<Effect>, ExchangeError> {
        self.expect(Phase::Forwarded, "response headers")?;
        self.status = header(&h, ":status").and_then(|s| s.parse().ok());
        if self.status.is_some_and(|s| (200..300).contains(&s)) {
            self.answer_scan = Some(CachedTokensScan::default());
        }
        let mut out = vec![send(Response::ResponseHeaders(HeadersResponse::default()))];
        if let Some(served) = string_in(metadata.as_ref(), LB_NAMESPACE, SERVED) {
            if self.picked.as_deref() != Some(served.as_str()) {
                out.push(Effect::ServedBy(served));
            }
        }
        self.phase = Phase::Responding;
        if h.end_of_stream {
            out.extend(self.finish());
        }
        Ok(out)
    }

    fn response_body(&mut self, b: HttpBody) -> Result<Vec<Effect>, ExchangeError> {
        self.expect(Phase::Responding, "a response body chunk")?;
        let mut out = Vec::new();
        let ok = self.status.is_some_and(|s| (200..300).contains(&s));
        if ok && !b.body.is_empty() && self.status.take().is_some() {
            // The first bytes of a successful answer: the engine has prefilled.
            out.push(Effect::PrefillDone);
        }
        let end = b.end_of_stream;
        if let Some(scan) = &mut self.answer_scan {
            scan.feed(&b.body);
        }
        out.push(send(Response::ResponseBody(streamed(b.body, end))));
        if end {
            out.extend(self.finish());
        }
        Ok(out)
    }

    fn immediate(&mut self, e: &ApiError) -> Vec<Effect> {
        let mut set = vec![option("content-type", "application/json")];
        if let Some(s) = e.retry_after {
            set.push(option("retry-after", &s.to_string()));
        }
        let answer = ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(e.status),
            }),
            headers: Some(HeaderMutation {
                set_headers: set,
                remove_headers: Vec::new(),
            }),
            body: e.to_bytes().to_vec(),
            details: format!("kvrouter_epp_{}", e.kind),
        };
        let mut out = vec![send(Response::ImmediateResponse(answer))];
        out.extend(self.finish());
        out
    }

    fn finish(&mut self) -> Vec<Effect> {
        if std::mem::replace(&mut self.phase, Phase::Done) == Phase::Done {
            return Vec::new();
        }
        let answered = self
            .answer_scan
            .take()
            .map(|s| Effect::Answered(s.finish()));
        answered.into_iter().chain([Effect::Finish]).collect()
    }

    fn expect(&self, want: Phase, got: &'static str) -> Result<(), ExchangeError> {
        if self.phase == want {
            return Ok(());
        }
        Err(ExchangeError::OutOfOrder {
            got,
            phase: match self.phase {
                Phase::Headers => "awaiting the request headers",
                Phase::Body => "reading the request body",
                Phase::Routing => "routing",
                Phase::Forwarded => "awaiting the response",
                Phase::Responding => "passing the response on",
                Phase::Done => "done",
            },
        })
    }
}

fn send(r: Response) -> Effect {
    Effect::Send(ProcessingResponse {
        response: Some(r),
        dynamic_metadata: None,
    })
}

fn streamed(body: Bytes, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

fn option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: OVERWRITE_IF_EXISTS_OR_ADD,
    }
}

/// A header's value (Envoy sends it in `raw_value`; `value` from older senders).
fn header(h: &HttpHeaders, name: &str) -> Option<String> {
    let v = h.headers.as_ref()?.headers.iter().find(|v| v.key == name)?;
    if v.raw_value.is_empty() {
        Some(v.value.clone())
    } else {
        String::from_utf8(v.raw_value.clone()).ok()
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": destination}}`.
fn lb_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION.to_string(), string_value(destination))].into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

fn field<'a>(m: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Value> {
    m?.filter_metadata.get(namespace)?.fields.get(key)
}

fn string_in(m: Option<&Metadata>, namespace: &str, key: &str) -> Option<String> {
    match field(m, namespace, key)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// The gateway's subset hint: a list of `ip:port` strings (a comma-separated string is
/// taken too).
fn subset_hint(m: Option<&Metadata>) -> Option<Vec<String>> {
    match field(m, SUBSET_NAMESPACE, SUBSET_KEY)?.kind.as_ref()? {
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ext_proc::{processing_request, HeaderMap};
    use prost_types::ListValue;
    use std::collections::HashMap;

    fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        value: String::new(),
                        raw_value: v.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            end_of_stream,
        }
    }

    fn msg(r: processing_request::Request, metadata: Option<Metadata>) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(r),
            metadata_context: metadata,
            observability_mode: false,
        }
    }

    fn req_headers(pairs: &[(&str, &str)], metadata: Option<Metadata>) -> ProcessingRequest {
        msg(Request::RequestHeaders(headers(pairs, false)), metadata)
    }

    fn body(r: fn(HttpBody) -> Request, b: &str, end_of_stream: bool) -> ProcessingRequest {
        msg(
            r(HttpBody {
                body: Bytes::copy_from_slice(b.as_bytes()),
                end_of_stream,
            }),
            None,
        )
    }

    fn metadata(namespace: &str, key: &str, v: Value) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                namespace.to_string(),
                Struct {
                    fields: [(key.to_string(), v)].into(),
                },
            )]),
        }
    }

    fn list(items: &[&str]) -> Value {
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: items.iter().map(|s| string_value(s)).collect(),
            })),
        }
    }

    fn sent(effects: &[Effect]) -> Vec<&Response> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(p) => p.response.as_ref(),
                _ => None,
            })
            .collect()
    }

    fn streamed_body(r: &Response) -> (Bytes, bool) {
        let b = match r {
            Response::RequestBody(b) | Response::ResponseBody(b) => b,
            other => panic!("{other:?}"),
        };
        match b
            .response
            .as_ref()
            .unwrap()
            .body_mutation
            .as_ref()
            .unwrap()
            .mutation
            .as_ref()
        {
            Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
            other => panic!("{other:?}"),
        }
    }

    fn immediate(effects: &[Effect]) -> &ImmediateResponse {
        match sent(effects).first() {
            Some(Response::ImmediateResponse(i)) => i,
            other => panic!("{other:?}"),
        }
    }

    /// The whole exchange: the body held until the pick, the pick in the header and the
    /// `envoy.lb` metadata, the body passed on whole, the answer passed back chunk by chunk,
    /// the prefill marked at its first bytes and the booking ended at its end, once.
    #[test]
    fn a_request_is_held_until_picked_and_its_answer_passed_back() {
        let mut x = Exchange::new(1 << 20);
        let hint = metadata(
            SUBSET_NAMESPACE,
            SUBSET_KEY,
            list(&["10.0.0.1:8000", "10.0.0.2:8000"]),
        );
        let auth = ("authorization", "Bearer k");
        let path = (":path", "/v1/completions");
        let trace = (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        assert_eq!(
            x.on_message(req_headers(&[path, auth, trace], Some(hint)))
                .unwrap(),
            []
        );
        assert_eq!(
            x.on_message(body(Request::RequestBody, "{\"a\":", false))
                .unwrap(),
            []
        );
        let e = x
            .on_message(body(Request::RequestBody, "1}", true))
            .unwrap();
        assert_eq!(
            e,
            [Effect::Route(RouteAsk {
                path: Some("/v1/completions".into()),
                body: Bytes::from_static(b"{\"a\":1}"),
                authorization: Some("Bearer k".into()),
                subset: Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()]),
                traceparent: Some(trace.1.into()),
            })]
        );
        let e = x.picked_route(Pick {
            endpoints: vec!["10.0.0.2:8000".into(), "10.0.0.1:8000".into()],
            headers: vec![("x-data-parallel-rank".into(), "1".into())],
            body: Bytes::from_static(b"{\"a\":2}"),
        });
        assert_eq!(x.picked(), Some("10.0.0.2:8000"));
        let Effect::Send(first) = &e[0] else { panic!() };
        let Some(Response::RequestHeaders(h)) = &first.response else {
            panic!()
        };
        let common = h.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let set: Vec<(String, String)> = common
            .header_mutation
            .as_ref()
            .unwrap()
            .set_headers
            .iter()
            .map(|o| {
                let h = o.header.as_ref().unwrap();
                (
                    h.key.clone(),
                    String::from_utf8(h.raw_value.clone()).unwrap(),
                )
            })
            .collect();
        assert!(
            set.contains(&(DESTINATION.into(), "10.0.0.2:8000,10.0.0.1:8000".into())),
            "{set:?}"
        );
        assert!(set.contains(&("x-data-parallel-rank".into(), "1".into())));
        assert!(set.contains(&("content-length".into(), "7".into())));
        let lb = &first.dynamic_metadata.as_ref().unwrap().fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!()
        };
        assert_eq!(
            lb.fields[DESTINATION],
            string_value("10.0.0.2:8000,10.0.0.1:8000")
        );
        assert_eq!(
            streamed_body(sent(&e)[1]),
            (Bytes::from_static(b"{\"a\":2}"), true)
        );

        let e = x
            .on_message(msg(
                Request::ResponseHeaders(headers(&[(":status", "200")], false)),
                None,
            ))
            .unwrap();
        assert!(matches!(sent(&e)[..], [Response::ResponseHeaders(_)]));
        let e = x
            .on_message(body(Request::ResponseBody, "data: 1\n\n", false))
            .unwrap();
        assert_eq!(e[0], Effect::PrefillDone);
        assert_eq!(
            streamed_body(sent(&e)[0]),
            (Bytes::from_static(b"data: 1\n\n"), false)
        );
        let usage =
            r#"data: {"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":48}}}"#;
        let e = x
            .on_message(body(Request::ResponseBody, usage, false))
            .unwrap();
        assert!(
            !e.contains(&Effect::PrefillDone),
            "the prefill marked twice"
        );
        let e = x
            .on_message(body(Request::ResponseBody, "\n\ndata: [DONE]\n\n", true))
            .unwrap();
        assert_eq!(
            e[e.len() - 2..],
            [Effect::Answered(Some(48)), Effect::Finish],
            "the engine's cached tokens, then the end"
        );
        assert!(x.is_done());
        assert_eq!(x.broken(), [], "finished twice");
    }

    /// Only a successful answer that ended whole reports cached tokens.
    #[test]
    fn failed_or_broken_answers_report_no_cached_tokens() {
        let answered = |status: &str, end: bool| {
            let mut x = Exchange::new(1 << 20);
            x.on_message(req_headers(&[(":path", "/v1/completions")], None))
                .unwrap();
            x.on_message(body(Request::RequestBody, "{}", true))
                .unwrap();
            x.picked_route(Pick {
                endpoints: vec!["10.0.0.1:8000".into()],
                headers: vec![],
                body: Bytes::from_static(b"{}"),
            });
            x.on_message(msg(
                Request::ResponseHeaders(headers(&[(":status", status)], false)),
                None,
            ))
            .unwrap();
            let whole = r#"{"usage":{"prompt_tokens_details":{"cached_tokens":16}}}"#;
            let mut e = x
                .on_message(body(Request::ResponseBody, whole, end))
                .unwrap();
            if !end {
                e.extend(x.broken());
            }
            e.into_iter()
                .filter(|e| matches!(e, Effect::Answered(_)))
                .collect::<Vec<_>>()
        };
        assert_eq!(answered("200", true), [Effect::Answered(Some(16))]);
        assert_eq!(answered("500", true), []);
        assert_eq!(answered("200", false), [], "cut short");
    }

    #[test]
    fn a_body_over_the_limit_is_a_413_and_ends_the_exchange() {
        let mut x = Exchange::new(8);
        x.on_message(req_headers(&[], None)).unwrap();
        assert_eq!(
            x.on_message(body(Request::RequestBody, "12345", false))
                .unwrap(),
            []
        );
        let e = x
            .on_message(body(Request::RequestBody, "6789", false))
            .unwrap();
        assert_eq!(immediate(&e).status.as_ref().unwrap().code, 413);
        assert_eq!(e.last(), Some(&Effect::Finish));
        // What Envoy had in flight needs no answer.
        assert_eq!(
            x.on_message(body(Request::RequestBody, "0", true)),
            Ok(vec![])
        );
        assert_eq!(
            x.on_message(ProcessingRequest::default()),
            Err(ExchangeError::Empty)
        );
    }

    #[test]
    fn refusals_answer_at_once_with_the_openai_error() {
        let mut x = Exchange::new(1 << 10);
        x.on_message(req_headers(&[], None)).unwrap();
        x.on_message(body(Request::RequestBody, "{}", true))
            .unwrap();
        let e = x.refused(&ApiError::overloaded("no room"));
        let i = immediate(&e);
        assert_eq!(i.status.as_ref().unwrap().code, 503);
        let set = &i.headers.as_ref().unwrap().set_headers;
        assert!(set
            .iter()
            .any(|o| o.header.as_ref().unwrap().key == "retry-after"));
        let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        assert_eq!(body["error"]["message"], "no room");
        assert_eq!(e.last(), Some(&Effect::Finish));
        // A pick arriving after the refusal changes nothing.
        assert_eq!(
            x.picked_route(Pick {
                endpoints: vec!["a:1".into()],
                headers: vec![],
                body: Bytes::new()
            }),
            []
        );
    }

    #[test]
    fn a_request_without_a_body_is_refused() {
        let mut x = Exchange::new(1 << 10);
        let e = x
            .on_message(msg(Request::RequestHeaders(headers(&[], true)), None))
            .unwrap();
        assert_eq!(immediate(&e).status.as_ref().unwrap().code, 400);
    }

    /// A failed answer marks no prefill; a fallback endpoint that served is reported; a
    /// stream broken mid-answer ends the booking once.
    #[test]
    fn failures_fallbacks_and_broken_streams() {
        let mut x = Exchange::new(1 << 10);
        x.on_message(req_headers(&[], None)).unwrap();
        x.on_message(body(Request::RequestBody, "{}", true))
            .unwrap();
        x.picked_route(Pick {
            endpoints: vec!["a:1".into(), "b:2".into()],
            headers: vec![],
            body: Bytes::new(),
        });
        let served = metadata(LB_NAMESPACE, SERVED, string_value("b:2"));
        let e = x
            .on_message(msg(
                Request::ResponseHeaders(headers(&[(":status", "500")], false)),
                Some(served),
            ))
            .unwrap();
        assert!(e.contains(&Effect::ServedBy("b:2".into())));
        let e = x
            .on_message(body(Request::ResponseBody, "oops", false))
            .unwrap();
        assert!(!e.contains(&Effect::PrefillDone));
        assert_eq!(x.broken(), [Effect::Finish]);
        assert_eq!(x.broken(), []);
    }

    #[test]
    fn observability_mode_takes_no_answers() {
        let mut x = Exchange::new(1 << 10);
        let mut m = req_headers(&[], None);
        m.observability_mode = true;
        assert_eq!(x.on_message(m).unwrap(), []);
        let mut m = body(Request::RequestBody, "{}", true);
        m.observability_mode = true;
        assert!(matches!(x.on_message(m).unwrap()[..], [Effect::Route(_)]));
    }

    #[test]
    fn the_subset_hint_takes_a_list_or_a_comma_separated_string() {
        let hint = |v| subset_hint(Some(&metadata(SUBSET_NAMESPACE, SUBSET_KEY, v)));
        assert_eq!(
            hint(list(&["a:1", " b:2"])),
            Some(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(
            hint(string_value("a:1, b:2,")),
            Some(vec!["a:1".into(), "b:2".into()])
        );
        assert_eq!(hint(list(&[])), Some(vec![]));
        assert_eq!(subset_hint(None), None);
    }

    proptest::proptest! {
        /// However Envoy cuts the request body, the route gets it whole; however the answer
        /// is cut, every byte goes back, in order, the last chunk marked as the end.
        #[test]
        fn chunking_changes_nothing(
            request in proptest::collection::vec(proptest::collection::vec(0u8..=255, 0..20), 1..8),
            answer in proptest::collection::vec(proptest::collection::vec(0u8..=255, 0..20), 1..8),
        ) {
            let mut x = Exchange::new(1 << 20);
            x.on_message(req_headers(&[], None)).unwrap();
            let mut routed = None;
            for (i, c) in request.iter().enumerate() {
                let m = msg(Request::RequestBody(HttpBody { body: Bytes::from(c.clone()), end_of_stream: i + 1 == request.len() }), None);
                for e in x.on_message(m).unwrap() {
                    if let Effect::Route(r) = e { routed = Some(r.body); }
                }
            }
            proptest::prop_assert_eq!(routed.unwrap().to_vec(), request.concat());
            x.picked_route(Pick { endpoints: vec!["a:1".into()], headers: vec![], body: Bytes::new() });
            x.on_message(msg(Request::ResponseHeaders(headers(&[(":status", "200")], false)), None)).unwrap();
            let mut back = Vec::new();
            let mut ended = false;
            for (i, c) in answer.iter().enumerate() {
                let last = i + 1 == answer.len();
                let m = msg(Request::ResponseBody(HttpBody { body: Bytes::from(c.clone()), end_of_stream: last }), None);
                for r in sent(&x.on_message(m).unwrap()) {
                    let (b, end) = streamed_body(r);
                    back.extend_from_slice(&b);
                    ended = end;
                }
            }
            proptest::prop_assert_eq!(back, answer.concat());
            proptest::prop_assert!(ended && x.is_done());
        }
    }
}
