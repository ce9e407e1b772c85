//! One emulated worker's HTTP side, OpenAI-compatible as vLLM and SGLang serve it:
//! `/v1/completions` and `/v1/chat/completions` (with and without `stream`), `/v1/models`,
//! `/health`, `/metrics` (the engine's metric names), and the test hooks
//! `POST /kvrouter/test/drop {dp_rank, count}`, `POST /kvrouter/test/raw_frame {dp_rank,
//! hex}` (publishes the bytes as they are, a malformed frame say, as the rank's next batch:
//! it takes the next sequence number and stays in the replay buffer) and
//! `GET /kvrouter/test/traceparents` (the `traceparent` headers of the last generation
//! requests, as received, oldest first; `null` for a request without one) and
//! `POST /kvrouter/test/mute {dp_rank, muted}` (while muted, the rank's batches are numbered
//! and kept for replay but not sent: an engine that serves on and publishes nothing).

use super::wire::{BlockTokens, Emulated};
use super::zmq::RankStream;
use crate::engine::{OutputKind, Request};
use crate::engine_hash::engine_block_hashes;
use crate::mock_info::MockInfo;
use crate::rank_task::{RankCmd, RankOut};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request as HttpRequest, Response, StatusCode};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

type Body = BoxBody<Bytes, Infallible>;

/// The largest request body read.
const MAX_BODY: usize = 16 << 20;

/// One rank as the HTTP side sees it.
pub struct HttpRank {
    pub cmds: mpsc::UnboundedSender<RankCmd>,
    pub tokens: Arc<Mutex<BlockTokens>>,
    pub stream: Arc<RankStream>,
    /// Requests submitted and not finished.
    pub in_flight: AtomicU64,
}

/// Generation requests whose `traceparent` the test hook keeps.
pub const TRACEPARENTS_KEPT: usize = 64;

pub struct WorkerHttp {
    pub engine: Emulated,
    pub model: String,
    pub info: Arc<MockInfo>,
    pub engine_seed: u64,
    pub ranks: Vec<HttpRank>,
    pub next_id: AtomicU64,
    /// The test hook's raw payloads, to the publisher: (rank, payload).
    pub raw_frames: mpsc::UnboundedSender<(u32, Bytes)>,
    /// The `traceparent` of the last [`TRACEPARENTS_KEPT`] generation requests (test hook).
    pub traceparents: parking_lot::Mutex<std::collections::VecDeque<Option<String>>>,
    /// Answers carry `usage.prompt_tokens_details.cached_tokens`, as vLLM does with
    /// `--enable-prompt-tokens-details` and SGLang with `--enable-cache-report` (both off by
    /// default: the details are `null`).
    pub cache_report: bool,
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(
        status,
        &json!({"error": {"message": message.into(), "type": "invalid_request_error",
                          "code": status.as_u16()}}),
    )
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A prompt as token ids: a list of ids, a list holding one such list, or text (its UTF-8
/// bytes stand for tokens: the mocker has no tokenizer).
fn prompt_tokens(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::String(s) => Some(s.bytes().map(u32::from).collect()),
        Value::Array(a) if a.len() == 1 && a[0].is_array() => prompt_tokens(&a[0]),
        Value::Array(a) => a
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect(),
        _ => None,
    }
}

/// `"92 00 dd"` or `"9200dd"` as bytes; `None` for anything else.
fn parse_hex(s: &str) -> Option<Vec<u8>> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    digits
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
        .collect()
}

/// Chat messages rendered as a plain transcript, then as UTF-8 bytes.
fn chat_tokens(v: &Value) -> Option<Vec<u32>> {
    let mut text = String::new();
    for m in v.as_array()? {
        let role = m.get("role")?.as_str()?;
        let content = match m.get("content")? {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            _ => return None,
        };
        text.push_str(&format!("<|{role}|>{content}\n"));
    }
    text.push_str("<|assistant|>");
    Some(text.bytes().map(u32::from).collect())
}

impl WorkerHttp {
    pub async fn handle(self: Arc<Self>, req: HttpRequest<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_string();
        match (req.method().clone(), path.as_str()) {
            (Method::GET, "/health") => full(StatusCode::OK, "text/plain", ""),
            (Method::GET, "/v1/models") => json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": [{"id": self.model, "object": "model",
                        "created": now_secs(), "owned_by": "kvrouter-mocker"}]}),
            ),
            (Method::GET, "/metrics") => {
                full(StatusCode::OK, "text/plain; version=0.0.4", self.metrics())
            }
            (Method::GET, "/kvrouter/test/traceparents") => {
                let seen: Vec<Option<String>> = self.traceparents.lock().iter().cloned().collect();
                json_response(StatusCode::OK, &json!(seen))
            }
            (Method::GET, "/kvrouter/test/cache") => {
                let rank = req.uri().query().and_then(|q| {
                    q.split('&')
                        .filter_map(|kv| kv.split_once('='))
                        .find(|(k, _)| *k == "dp_rank")
                        .and_then(|(_, v)| v.parse::<u32>().ok())
                });
                self.cache(rank).await
            }
            (
                Method::POST,
                "/v1/completions"
                | "/v1/chat/completions"
                | "/kvrouter/test/drop"
                | "/kvrouter/test/mute"
                | "/kvrouter/test/raw_frame",
            ) => {
                let header_rank = req
                    .headers()
                    .get("x-data-parallel-rank")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u32>().ok());
                if path.starts_with("/v1/") {
                    let tp = req.headers().get("traceparent");
                    let tp = tp.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                    let mut seen = self.traceparents.lock();
                    if seen.len() == TRACEPARENTS_KEPT {
                        seen.pop_front();
                    }
                    seen.push_back(tp);
                }
                let limits = kvrouter_admin::HttpLimits::default();
                let body = match kvrouter_admin::read_body(req, MAX_BODY, limits.body_timeout).await
                {
                    Ok(b) => b,
                    Err(e) => {
                        let status =
                            StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
                        return error(status, e.to_string());
                    }
                };
                let Ok(KnownFields(v)) = serde_json::from_slice::<KnownFields>(&body) else {
                    return error(StatusCode::BAD_REQUEST, "the body is not JSON");
                };
                match path.as_str() {
                    "/kvrouter/test/drop" => self.drop_hook(&v),
                    "/kvrouter/test/mute" => self.mute_hook(&v),
                    "/kvrouter/test/raw_frame" => self.raw_frame_hook(&v),
                    p => {
                        self.generate(&v, header_rank, p == "/v1/chat/completions")
                            .await
                    }
                }
            }
            _ => error(StatusCode::NOT_FOUND, format!("no route {path}")),
        }
    }

    /// Test hook: what a rank caches, as `{"last_event_id", "blocks": [[engine_hash,
    /// parent_engine_hash, local_hash]]}` (the format of a replica's `/debug/rank`).
    async fn cache(&self, rank: Option<u32>) -> Response<Body> {
        let Some(i) = rank.and_then(|r| self.info.rank_index(r)) else {
            return error(
                StatusCode::BAD_REQUEST,
                "expected ?dp_rank=R, one of this engine's ranks",
            );
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cmd = RankCmd::Snapshot {
            max_blocks: usize::MAX,
            reply: tx,
        };
        if self.ranks[i].cmds.send(cmd).is_err() {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is shutting down",
            );
        }
        let Ok(snap) = rx.await else {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is shutting down",
            );
        };
        let mut blocks = Vec::new();
        for e in snap.events {
            if let kvrouter_protocol::KvEventData::Stored {
                parent,
                blocks: stored,
            } = e.data
            {
                let mut p = parent.map(|p| p.0);
                for b in stored {
                    blocks.push(json!([b.engine_hash.0, p, b.local_hash.0, e.tier.as_str()]));
                    p = Some(b.engine_hash.0);
                }
            }
        }
        json_response(
            StatusCode::OK,
            &json!({"last_event_id": snap.last_event_id, "blocks": blocks}),
        )
    }

    fn drop_hook(&self, v: &Value) -> Response<Body> {
        let (Some(rank), Some(count)) = (
            v.get("dp_rank").and_then(Value::as_u64),
            v.get("count").and_then(Value::as_u64),
        ) else {
            return error(
                StatusCode::BAD_REQUEST,
                "expected {\"dp_rank\": R, \"count\": N}",
            );
        };
        let Some(i) = u32::try_from(rank)
            .ok()
            .and_then(|r| self.info.rank_index(r))
        else {
            return error(StatusCode::BAD_REQUEST, format!("no rank {rank}"));
        };
        self.ranks[i].stream.drop_next(count);
        json_response(StatusCode::OK, &json!({"dropping": count, "dp_rank": rank}))
    }

    fn mute_hook(&self, v: &Value) -> Response<Body> {
        let (Some(rank), Some(muted)) = (
            v.get("dp_rank").and_then(Value::as_u64),
            v.get("muted").and_then(Value::as_bool),
        ) else {
            return error(
                StatusCode::BAD_REQUEST,
                "expected {\"dp_rank\": R, \"muted\": true|false}",
            );
        };
        let Some(i) = u32::try_from(rank)
            .ok()
            .and_then(|r| self.info.rank_index(r))
        else {
            return error(StatusCode::BAD_REQUEST, format!("no rank {rank}"));
        };
        self.ranks[i].stream.set_muted(muted);
        json_response(StatusCode::OK, &json!({"muted": muted, "dp_rank": rank}))
    }

    fn raw_frame_hook(&self, v: &Value) -> Response<Body> {
        let (Some(rank), Some(hex)) = (
            v.get("dp_rank").and_then(Value::as_u64),
            v.get("hex").and_then(Value::as_str),
        ) else {
            return error(
                StatusCode::BAD_REQUEST,
                "expected {\"dp_rank\": R, \"hex\": \"92 00 ...\"}",
            );
        };
        let Some(rank) = u32::try_from(rank)
            .ok()
            .filter(|&r| self.info.rank_index(r).is_some())
        else {
            return error(StatusCode::BAD_REQUEST, format!("no rank {rank}"));
        };
        let Some(payload) = parse_hex(hex) else {
            return error(StatusCode::BAD_REQUEST, "hex: pairs of hex digits");
        };
        let len = payload.len();
        if self.raw_frames.send((rank, Bytes::from(payload))).is_err() {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is shutting down",
            );
        }
        json_response(StatusCode::OK, &json!({"dp_rank": rank, "bytes": len}))
    }

    /// The rank a request names (vLLM: the `X-data-parallel-rank` header; SGLang: the body's
    /// `routed_dp_rank` or older `data_parallel_rank`, or the header), else the rank with the
    /// fewest requests in flight.
    fn pick_rank(&self, v: &Value, header: Option<u32>) -> Result<usize, String> {
        let body_rank = match self.engine {
            Emulated::Sglang => v
                .get("routed_dp_rank")
                .or_else(|| v.get("data_parallel_rank"))
                .and_then(Value::as_u64)
                .and_then(|r| u32::try_from(r).ok()),
            Emulated::Vllm => None,
        };
        match body_rank.or(header) {
            Some(r) => self.info.rank_index(r).ok_or_else(|| {
                format!(
                    "data-parallel rank {r} is not served here (ranks {}..{})",
                    self.info.dp_start_rank,
                    self.info.dp_start_rank + self.info.dp_size
                )
            }),
            None => Ok((0..self.ranks.len())
                .min_by_key(|&i| self.ranks[i].in_flight.load(Ordering::Relaxed))
                .unwrap_or(0)),
        }
    }

    async fn generate(
        self: &Arc<Self>,
        v: &Value,
        header_rank: Option<u32>,
        chat: bool,
    ) -> Response<Body> {
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            if m != self.model {
                return error(
                    StatusCode::NOT_FOUND,
                    format!(
                        "model {m:?} is not served here (it serves {:?})",
                        self.model
                    ),
                );
            }
        }
        let tokens = if chat {
            v.get("messages").and_then(chat_tokens)
        } else {
            v.get("prompt").and_then(prompt_tokens)
        };
        let Some(tokens) = tokens.filter(|t| !t.is_empty()) else {
            let what = if chat {
                "messages"
            } else {
                "prompt (token ids or text)"
            };
            return error(
                StatusCode::BAD_REQUEST,
                format!("a non-empty {what} is required"),
            );
        };
        let max_tokens = v
            .get("max_tokens")
            .or_else(|| v.get("max_completion_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(16)
            .min(u64::from(u32::MAX)) as u32;
        let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
        // A streamed answer carries usage only when asked, in a chunk of its own.
        let include_usage = v
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let index = match self.pick_rank(v, header_rank) {
            Ok(i) => i,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let rank = &self.ranks[index];
        let bs = self.info.block_size as usize;
        {
            let hashes = engine_block_hashes(self.engine_seed, &tokens, bs);
            let mut t = rank.tokens.lock();
            for (h, block) in hashes.iter().zip(tokens.chunks_exact(bs)) {
                t.insert(h.0, block);
            }
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" });
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_len = tokens.len();
        let request = Request {
            request_id: id.clone(),
            tokens,
            max_tokens,
        };
        if rank
            .cmds
            .send(RankCmd::Submit {
                request,
                transferred: None,
                out: tx,
            })
            .is_err()
        {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is shutting down",
            );
        }
        rank.in_flight.fetch_add(1, Ordering::Relaxed);
        let call = Call {
            http: self.clone(),
            index,
            id,
            chat,
            prompt_len,
            created: now_secs(),
            include_usage,
        };
        if stream {
            call.stream(rx)
        } else {
            call.whole(rx).await
        }
    }

    fn metrics(&self) -> String {
        let loads = self.info.loads();
        let mut out = String::new();
        let (running, waiting, usage, label) = match self.engine {
            Emulated::Vllm => (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
                "engine",
            ),
            Emulated::Sglang => (
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:token_usage",
                "dp_rank",
            ),
        };
        for (name, help) in [
            (running, "Requests running"),
            (waiting, "Requests waiting"),
            (usage, "KV cache usage (1 is full)"),
        ] {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
            for (i, rank) in self.ranks.iter().enumerate() {
                let l = loads.get(i).copied().unwrap_or_default();
                let r = self.info.dp_start_rank + i as u32;
                let value = if name == running {
                    rank.in_flight
                        .load(Ordering::Relaxed)
                        .saturating_sub(l.waiting_requests) as f64
                } else if name == waiting {
                    l.waiting_requests as f64
                } else {
                    l.active_blocks as f64 / self.info.capacity_blocks.max(1) as f64
                };
                out.push_str(&format!(
                    "{name}{{{label}=\"{r}\",model_name=\"{}\"}} {value}\n",
                    self.model
                ));
            }
        }
        out
    }
}

/// One request in flight.
struct Call {
    http: Arc<WorkerHttp>,
    index: usize,
    id: String,
    chat: bool,
    prompt_len: usize,
    created: u64,
    include_usage: bool,
}

impl Drop for Call {
    fn drop(&mut self) {
        self.http.ranks[self.index]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// The mocker has no vocabulary: every generated token reads as this.
const TOKEN_TEXT: &str = " tok";

impl Call {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    fn choice(&self, text: &str, finish: Option<&str>, chunk: bool) -> Value {
        if self.chat {
            let key = if chunk { "delta" } else { "message" };
            json!({"index": 0, key: {"role": "assistant", "content": text},
                   "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        }
    }

    fn usage(&self, completion: u32, cached_blocks: usize) -> Value {
        let cached = cached_blocks * self.http.info.block_size as usize;
        let details = match self.http.cache_report {
            true => json!({"cached_tokens": cached}),
            false => Value::Null,
        };
        json!({"prompt_tokens": self.prompt_len, "completion_tokens": completion,
               "total_tokens": self.prompt_len + completion as usize,
               "prompt_tokens_details": details})
    }

    fn envelope(&self, choice: Value, chunk: bool, usage: Option<Value>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(chunk), "created": self.created,
                           "model": self.http.model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    async fn whole(self, mut rx: mpsc::UnboundedReceiver<RankOut>) -> Response<Body> {
        let mut cached = 0;
        loop {
            match rx.recv().await {
                Some(RankOut::Output(OutputKind::PrefillDone { cached_blocks, .. })) => {
                    cached = cached_blocks;
                }
                Some(RankOut::Output(OutputKind::Token { .. })) => {}
                Some(RankOut::Output(OutputKind::Finished { output_tokens, .. })) => {
                    let text = TOKEN_TEXT.repeat(output_tokens as usize);
                    let v = self.envelope(
                        self.choice(&text, Some("length"), false),
                        false,
                        Some(self.usage(output_tokens, cached)),
                    );
                    return json_response(StatusCode::OK, &v);
                }
                Some(RankOut::Rejected(e)) => return error(StatusCode::BAD_REQUEST, e.to_string()),
                Some(RankOut::Failed(e)) => {
                    return error(StatusCode::SERVICE_UNAVAILABLE, e.message)
                }
                None => {
                    return error(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped");
                }
            }
        }
    }

    /// Server-sent events: one chunk per token, a last chunk with the finish reason, a
    /// usage chunk (no choices) when the request asked `stream_options.include_usage`, then
    /// `[DONE]`.
    fn stream(self, mut rx: mpsc::UnboundedReceiver<RankOut>) -> Response<Body> {
        let (tx, body_rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(async move {
            let send = |v: Value| Bytes::from(format!("data: {v}\n\n"));
            let mut cached = 0;
            loop {
                let chunk = match rx.recv().await {
                    Some(RankOut::Output(OutputKind::PrefillDone { cached_blocks, .. })) => {
                        cached = cached_blocks;
                        send(self.envelope(self.choice(TOKEN_TEXT, None, true), true, None))
                    }
                    Some(RankOut::Output(OutputKind::Token { .. })) => {
                        send(self.envelope(self.choice(TOKEN_TEXT, None, true), true, None))
                    }
                    Some(RankOut::Output(OutputKind::Finished { output_tokens, .. })) => {
                        let last = self.envelope(self.choice("", Some("length"), true), true, None);
                        let _ = tx.send(send(last)).await;
                        if self.include_usage {
                            let mut usage = self.envelope(Value::Null, true, None);
                            usage["choices"] = json!([]);
                            usage["usage"] = self.usage(output_tokens, cached);
                            let _ = tx.send(send(usage)).await;
                        }
                        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                        return;
                    }
                    Some(RankOut::Rejected(e)) => {
                        send(json!({"error": {"message": e.to_string()}}))
                    }
                    Some(RankOut::Failed(e)) => send(json!({"error": {"message": e.message}})),
                    None => send(json!({"error": {"message": "the engine stopped"}})),
                };
                let end = chunk.starts_with(b"data: {\"error\"");
                if tx.send(chunk).await.is_err() || end {
                    return;
                }
            }
        });
        let stream = futures_util::stream::unfold(body_rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        let mut r = Response::new(StreamBody::new(stream).boxed());
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        r
    }
}

/// The top-level fields the emulated engine reads, as JSON values; every other field is
/// stepped over unparsed, so a client's long array in a field no engine reads costs a scan,
/// not a tree of values (a real engine's parser is its own business; this one must not be
/// the weak point of a hostile run).
struct KnownFields(Value);

const KNOWN_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "data_parallel_rank",
    "routed_dp_rank",
    "dp_rank",
    "count",
    "hex",
    "muted",
];

impl<'de> serde::Deserialize<'de> for KnownFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = KnownFields;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<KnownFields, A::Error> {
                let mut out = serde_json::Map::new();
                while let Some(key) = map.next_key::<String>()? {
                    if KNOWN_FIELDS.contains(&key.as_str()) {
                        out.insert(key, map.next_value()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(KnownFields(Value::Object(out)))
            }
        }
        d.deserialize_map(Fields)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_hex;

    #[test]
    fn hex_frames() {
        assert_eq!(
            parse_hex("92 00 dd ff ff ff ff c0"),
            Some(vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0])
        );
        assert_eq!(parse_hex("9200"), Some(vec![0x92, 0x00]));
        assert_eq!(parse_hex(""), Some(vec![]));
        assert_eq!(parse_hex("920"), None);
        assert_eq!(parse_hex("zz"), None);
    }
}
