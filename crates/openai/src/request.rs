//! What a client asked for: an OpenAI completions or chat request, checked field by field,
//! with the fields the frontend does not interpret kept for the engine.

use crate::auth::Grants;
use crate::body::{Body, RawPrompt, CHAT_ONLY};
use crate::error::ApiError;
use kvrouter_protocol::{Pin, RouteOverrides, WorkerId};
use serde_json::{Map, Value};

/// Which OpenAI endpoint a request came to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completions => "completions",
            Self::Chat => "chat_completions",
        }
    }
}

/// A completions prompt: text to tokenize, or token ids as they are.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The per-request `kvrouter` extension object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterExt {
    pub overrides: Option<RouteOverrides>,
    pub allowed_workers: Option<Vec<WorkerId>>,
    pub pin: Option<Pin>,
    /// Seconds the request counts as having waited already if the replica must queue it.
    pub priority_jump: f64,
    /// Output tokens expected: counted as the worker's decode load from the start.
    pub expected_output_tokens: Option<u32>,
}

/// A parsed request.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientRequest {
    pub endpoint: Endpoint,
    /// The model as the client named it (a served model or a LoRA adapter).
    pub model: String,
    pub input: Input,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    pub cache_salt: Option<String>,
    pub router: RouterExt,
    /// The fields the frontend reads but passes on (e.g. `max_tokens`), for the engine.
    pub rest: Map<String, Value>,
    /// Everything else, for the engine as it came: `"key":value` members, comma-separated.
    pub passthrough: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    Prompt(Prompt),
    /// Shared so that rendering can run off the async threads.
    Chat(std::sync::Arc<Conversation>),
}

/// What a chat template renders.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Value>,
    pub add_generation_prompt: bool,
    pub tools: Option<Vec<Value>>,
    pub documents: Option<Vec<Value>>,
    /// `chat_template_kwargs`: extra template variables.
    pub template_kwargs: Map<String, Value>,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param), message)
}

/// Parses a request body for `endpoint`, from a caller with `grants`.
pub fn parse(endpoint: Endpoint, body: &[u8], grants: Grants) -> Result<ClientRequest, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(None, "the body must be a JSON object"));
    }
    let Body {
        prompt,
        mut rest,
        passthrough,
    } = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the body is not valid JSON: {e}")))?;
    // Operator knobs (pin, worker lists, queue jumps, cost settings): refused before any of
    // it is read, so a caller not granted them learns nothing of how they are checked.
    if !grants.routing_extension && rest.get("kvrouter").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::permission_denied(
            Some("kvrouter"),
            "the kvrouter request extension is not granted to this caller: the operator \
             grants it per API key (routing-extension in --api-keys-file) or to every caller \
             (--grant-routing-extension)",
        ));
    }
    let model = match rest.remove("model") {
        Some(Value::String(m)) if !m.is_empty() => m,
        Some(_) => return Err(bad("model", "model must be a non-empty string")),
        None => return Err(bad("model", "model is required")),
    };
    let stream = match rest.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => return Err(bad("stream", "stream must be a boolean")),
    };
    let include_usage = match rest.remove("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(bad(
                    "stream_options.include_usage",
                    "include_usage must be a boolean",
                ))
            }
        },
        Some(_) => return Err(bad("stream_options", "stream_options must be an object")),
    };
    let cache_salt = match rest.remove("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s),
        Some(_) => return Err(bad("cache_salt", "cache_salt must be a non-empty string")),
    };
    let router = match rest.remove("kvrouter") {
        None | Some(Value::Null) => RouterExt::default(),
        Some(v) => parse_router_ext(v)?,
    };
    let input = match endpoint {
        Endpoint::Completions => Input::Prompt(parse_prompt(prompt)?),
        Endpoint::Chat => Input::Chat(std::sync::Arc::new(parse_chat(&mut rest)?)),
    };
    Ok(ClientRequest {
        endpoint,
        model,
        input,
        stream,
        include_usage,
        cache_salt,
        router,
        rest,
        passthrough,
    })
}

fn parse_prompt(v: Option<RawPrompt>) -> Result<Prompt, ApiError> {
    let prompt = match v {
        None | Some(RawPrompt::Null) => return Err(bad("prompt", "prompt is required")),
        Some(RawPrompt::Text(s)) => Prompt::Text(s),
        Some(RawPrompt::Tokens(t)) => Prompt::Tokens(t),
        Some(RawPrompt::Bad(m)) => return Err(bad("prompt", m)),
    };
    let empty = match &prompt {
        Prompt::Text(s) => s.is_empty(),
        Prompt::Tokens(t) => t.is_empty(),
    };
    if empty {
        return Err(bad("prompt", "prompt is empty"));
    }
    Ok(prompt)
}

fn parse_chat(rest: &mut Map<String, Value>) -> Result<Conversation, ApiError> {
    let messages = match rest.remove("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(bad("messages", "messages is empty")),
        Some(_) => return Err(bad("messages", "messages must be a list of messages")),
        None => return Err(bad("messages", "messages is required")),
    };
    for (i, m) in messages.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(bad(
                &format!("messages[{i}].role"),
                "every message needs a string role",
            ));
        }
    }
    let add_generation_prompt = match rest.get("add_generation_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "add_generation_prompt",
                "add_generation_prompt must be a boolean",
            ))
        }
    };
    let template_kwargs = match rest.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(bad(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object",
            ))
        }
    };
    if rest.get("chat_template").is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "chat_template",
            "a per-request chat_template is not accepted; the model directory's (or \
             --chat-template) is used",
        ));
    }
    let list = |rest: &Map<String, Value>, key: &str| match rest.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.clone())),
        Some(_) => Err(bad(key, format!("{key} must be a list"))),
    };
    let tools = list(rest, "tools")?;
    let documents = list(rest, "documents")?;
    // Chat's max_completion_tokens and logprobs are completions' max_tokens and logprobs.
    if let Some(n) = rest.get("max_completion_tokens").filter(|v| !v.is_null()) {
        let n = n.clone();
        rest.entry("max_tokens").or_insert(n);
    }
    let logprobs = match rest.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => {
            Some(rest.get("top_logprobs").cloned().unwrap_or(Value::from(0)))
        }
        Some(_) => return Err(bad("logprobs", "logprobs must be a boolean")),
    };
    for key in CHAT_ONLY {
        rest.remove(*key);
    }
    if let Some(n) = logprobs {
        rest.insert("logprobs".into(), n);
    }
    Ok(Conversation {
        messages,
        add_generation_prompt,
        tools,
        documents,
        template_kwargs,
    })
}

fn parse_router_ext(v: Value) -> Result<RouterExt, ApiError> {
    let Value::Object(o) = v else {
        return Err(bad("kvrouter", "kvrouter must be an object"));
    };
    let mut ext = RouterExt::default();
    let mut overrides = RouteOverrides::default();
    for (key, v) in o {
        let param = format!("kvrouter.{key}");
        match key.as_str() {
            "overlap_credit"
            | "temperature"
            | "host_cache_hit_weight"
            | "disk_cache_hit_weight"
            | "shared_cache_hit_weight" => {
                let x = v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| bad(&param, format!("{param} must be a number >= 0")))?;
                let slot = match key.as_str() {
                    "overlap_credit" => &mut overrides.overlap_credit,
                    "temperature" => &mut overrides.temperature,
                    "host_cache_hit_weight" => &mut overrides.host_cache_hit_weight,
                    "disk_cache_hit_weight" => &mut overrides.disk_cache_hit_weight,
                    _ => &mut overrides.shared_cache_hit_weight,
                };
                *slot = Some(x);
            }
            "priority_jump" => {
                ext.priority_jump = v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| {
                        bad(&param, format!("{param} must be a number of seconds >= 0"))
                    })?;
            }
            "expected_output_tokens" => {
                let n = v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(&param, format!("{param} must be a whole number of tokens"))
                    })?;
                ext.expected_output_tokens = Some(n);
            }
            "allowed_workers" => {
                let ids = v
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
                    .ok_or_else(|| bad(&param, "allowed_workers must be a list of worker ids"))?;
                let most = kvrouter_protocol::limits::MAX_WORKER_LIST_LEN;
                if ids.len() > most {
                    return Err(bad(
                        &param,
                        format!(
                            "allowed_workers has {} entries, over the limit of {most}",
                            ids.len()
                        ),
                    ));
                }
                ext.allowed_workers = Some(ids);
            }
            "pin" => {
                let s = v
                    .as_str()
                    .ok_or_else(|| bad(&param, "pin must be a string WORKER:RANK or WORKER"))?;
                ext.pin = Some(s.parse().map_err(|e| {
                    bad(
                        &param,
                        format!("pin {s:?} is not WORKER:RANK or WORKER: {e}"),
                    )
                })?);
            }
            _ => {
                return Err(bad(
                    &param,
                    format!(
                        "unknown field {param} (known: overlap_credit, temperature, \
                         host_cache_hit_weight, disk_cache_hit_weight, \
                         shared_cache_hit_weight, allowed_workers, pin, priority_jump, \
                         expected_output_tokens)"
                    ),
                ))
            }
        }
    }
    if overrides != RouteOverrides::default() {
        ext.overrides = Some(overrides);
    }
    Ok(ext)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const GRANTED: Grants = Grants {
        routing_extension: true,
        overlap_header: false,
    };

    #[test]
    fn the_extension_is_refused_unless_granted() {
        let plain = |v: Value| {
            parse(
                Endpoint::Completions,
                v.to_string().as_bytes(),
                Grants::default(),
            )
        };
        for ext in [
            json!({"pin": "1:0"}),
            json!({"allowed_workers": [1]}),
            json!({}),
            json!({"temperature": -1}),
            json!("not even an object"),
        ] {
            let e = plain(json!({"model": "m", "prompt": "x", "kvrouter": ext})).unwrap_err();
            assert_eq!(
                (e.status, e.code),
                (403, Some("permission_denied")),
                "{ext}"
            );
            assert_eq!(e.param.as_deref(), Some("kvrouter"));
            assert!(
                e.message.contains("--grant-routing-extension"),
                "{}",
                e.message
            );
        }
        for ok in [
            json!({"model": "m", "prompt": "x"}),
            json!({"model": "m", "prompt": "x", "kvrouter": null}),
        ] {
            assert_eq!(plain(ok).unwrap().router, RouterExt::default());
        }
        // The overlap-header grant alone does not grant the extension.
        let header_only = Grants {
            routing_extension: false,
            overlap_header: true,
        };
        let body = json!({"model": "m", "prompt": "x", "kvrouter": {"pin": "1"}}).to_string();
        let e = parse(Endpoint::Completions, body.as_bytes(), header_only).unwrap_err();
        assert_eq!(e.status, 403);
        let r = parse(Endpoint::Completions, body.as_bytes(), GRANTED).unwrap();
        assert_eq!(r.router.pin.map(|p| p.worker_id), Some(1));
    }

    /// What goes to the engine besides the prompt: the fields read, then the rest.
    fn fields(r: &ClientRequest) -> Value {
        let mut all = r.rest.clone();
        let Value::Object(rest) = serde_json::from_str(&format!("{{{}}}", r.passthrough)).unwrap()
        else {
            unreachable!()
        };
        all.extend(rest);
        Value::Object(all)
    }

    fn completions(v: Value) -> Result<ClientRequest, ApiError> {
        parse(Endpoint::Completions, v.to_string().as_bytes(), GRANTED)
    }

    fn chat(v: Value) -> Result<ClientRequest, ApiError> {
        parse(Endpoint::Chat, v.to_string().as_bytes(), GRANTED)
    }

    fn param_of(r: Result<ClientRequest, ApiError>) -> Option<String> {
        r.unwrap_err().param
    }

    #[test]
    fn prompts_in_every_accepted_shape() {
        let text = completions(json!({"model": "m", "prompt": "hi"})).unwrap();
        assert_eq!(text.input, Input::Prompt(Prompt::Text("hi".into())));
        for p in [json!([1, 2, 3]), json!([[1, 2, 3]])] {
            let r = completions(json!({"model": "m", "prompt": p})).unwrap();
            assert_eq!(r.input, Input::Prompt(Prompt::Tokens(vec![1, 2, 3])));
        }
        let one = completions(json!({"model": "m", "prompt": ["hi"]})).unwrap();
        assert_eq!(one.input, Input::Prompt(Prompt::Text("hi".into())));
        for bad in [
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([1, -2]),
            json!([1, 4294967296u64]),
            json!([1.5]),
            json!(""),
            json!([]),
            json!(7),
        ] {
            let r = completions(json!({"model": "m", "prompt": bad}));
            assert_eq!(param_of(r).as_deref(), Some("prompt"), "{bad}");
        }
        assert_eq!(
            param_of(completions(json!({"model": "m"}))).as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn the_fields_named_in_errors() {
        assert_eq!(
            param_of(completions(json!({"prompt": "x"}))).as_deref(),
            Some("model")
        );
        assert_eq!(
            param_of(completions(json!({"model": 3, "prompt": "x"}))).as_deref(),
            Some("model")
        );
        assert_eq!(
            param_of(completions(
                json!({"model": "m", "prompt": "x", "stream": "yes"})
            ))
            .as_deref(),
            Some("stream")
        );
        let r = completions(json!({"model": "m", "prompt": "x", "kvrouter": {"temperature": -1}}));
        assert_eq!(param_of(r).as_deref(), Some("kvrouter.temperature"));
        let r = completions(json!({"model": "m", "prompt": "x", "kvrouter": {"tmp": 1}}));
        assert_eq!(param_of(r).as_deref(), Some("kvrouter.tmp"));
        let r =
            completions(json!({"model": "m", "prompt": "x", "kvrouter": {"priority_jump": -1}}));
        assert_eq!(param_of(r).as_deref(), Some("kvrouter.priority_jump"));
        let r = completions(
            json!({"model": "m", "prompt": "x", "kvrouter": {"expected_output_tokens": 1.5}}),
        );
        assert_eq!(
            param_of(r).as_deref(),
            Some("kvrouter.expected_output_tokens")
        );
        let r = completions(json!({"model": "m", "prompt": "x", "kvrouter": {"pin": "a:b"}}));
        assert_eq!(param_of(r).as_deref(), Some("kvrouter.pin"));
        let r = parse(Endpoint::Completions, b"{\"model\": ", GRANTED);
        assert!(r.unwrap_err().message.contains("not valid JSON"));
        let r = parse(Endpoint::Completions, b"[1]", GRANTED);
        assert!(r.unwrap_err().message.contains("object"));
        let r = chat(json!({"model": "m", "messages": [{"content": "x"}]}));
        assert_eq!(param_of(r).as_deref(), Some("messages[0].role"));
        let r = chat(json!({"model": "m", "messages": []}));
        assert_eq!(param_of(r).as_deref(), Some("messages"));
    }

    #[test]
    fn router_extension_and_pass_through() {
        let r = completions(json!({
            "model": "m", "prompt": [5], "max_tokens": 7, "temperature": 0.5, "seed": 3,
            "stream": true, "stream_options": {"include_usage": true}, "cache_salt": "s",
            "kvrouter": {"overlap_credit": 0.5, "temperature": 1, "allowed_workers": [4, 5], "pin": "4:1",
                         "priority_jump": 2.5, "expected_output_tokens": 300}
        }))
        .unwrap();
        assert!(r.stream && r.include_usage);
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(
            r.router,
            RouterExt {
                overrides: Some(RouteOverrides {
                    disk_cache_hit_weight: None,
                    host_cache_hit_weight: None,
                    shared_cache_hit_weight: None,
                    overlap_credit: Some(0.5),
                    temperature: Some(1.0)
                }),
                allowed_workers: Some(vec![4, 5]),
                pin: Some(Pin {
                    worker_id: 4,
                    dp_rank: Some(1)
                }),
                priority_jump: 2.5,
                expected_output_tokens: Some(300),
            }
        );
        // The sampling temperature is the engine's, not the router's.
        assert_eq!(
            fields(&r),
            json!({"max_tokens": 7, "temperature": 0.5, "seed": 3})
        );
        assert_eq!(
            "9".parse::<Pin>().ok(),
            Some(Pin {
                worker_id: 9,
                dp_rank: None
            })
        );
    }

    #[test]
    fn chat_fields_become_completions_fields() {
        let r = chat(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 2,
            "tools": [{"type": "function"}], "tool_choice": "auto", "n": 1,
            "chat_template_kwargs": {"enable_thinking": false}
        }))
        .unwrap();
        let Input::Chat(c) = &r.input else {
            panic!("not chat")
        };
        assert!(c.add_generation_prompt);
        assert_eq!(c.tools, Some(vec![json!({"type": "function"})]));
        assert_eq!(
            c.template_kwargs.get("enable_thinking"),
            Some(&json!(false))
        );
        assert_eq!(fields(&r), json!({"max_tokens": 9, "logprobs": 2, "n": 1}));
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "add_generation_prompt": false, "logprobs": false}),
        )
        .unwrap();
        let Input::Chat(c) = &r.input else {
            panic!("not chat")
        };
        assert!(!c.add_generation_prompt);
        assert_eq!(fields(&r), json!({}));
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "chat_template": "{{ x }}"}),
        );
        assert_eq!(param_of(r).as_deref(), Some("chat_template"));
    }

    /// Bytes a parse may allocate per body byte, at worst (objects of one short field in
    /// `messages`, each a map node); fields the frontend only passes on cost about one.
    const PARSE_ALLOC_PER_BYTE: u64 = 64;
    const PASSTHROUGH_ALLOC_PER_BYTE: u64 = 3;

    fn repeat(head: &str, item: &str, n: usize, tail: &str) -> Vec<u8> {
        let mut b = head.to_string();
        for i in 0..n {
            if i > 0 {
                b.push(',');
            }
            b.push_str(item);
        }
        b.push_str(tail);
        b.into_bytes()
    }

    fn allocated(endpoint: Endpoint, body: &[u8]) -> u64 {
        let (r, bytes) = kvrouter_testkit::allocated_during(|| parse(endpoint, body, GRANTED));
        drop(r);
        bytes
    }

    #[test]
    fn a_worker_list_over_the_limit_is_refused() {
        let most = kvrouter_protocol::limits::MAX_WORKER_LIST_LEN;
        let ok = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "kvrouter": {"allowed_workers": vec![1; most]}});
        assert!(chat(ok).is_ok());
        let over = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "kvrouter": {"allowed_workers": vec![1; 200_000]}});
        assert_eq!(
            param_of(chat(over)).as_deref(),
            Some("kvrouter.allowed_workers")
        );
    }

    #[test]
    fn parsing_allocates_a_bounded_multiple_of_the_body() {
        let n = 200_000;
        let passthrough = [
            repeat(r#"{"model":"m","prompt":"x","junk":["#, "0", n, "]}"),
            repeat(r#"{"model":"m","prompt":"x","junk":["#, "[]", n, "]}"),
            repeat(r#"{"model":"m","prompt":"x","junk":["#, "{}", n, "]}"),
            repeat(r#"{"model":"m","prompt":"x","#, r#""k":0"#, n, "}"),
        ];
        for body in &passthrough {
            let bytes = allocated(Endpoint::Completions, body);
            let limit = PASSTHROUGH_ALLOC_PER_BYTE * body.len() as u64 + 4096;
            assert!(
                bytes <= limit,
                "{bytes} bytes for a {} byte body",
                body.len()
            );
        }
        let interpreted = [
            (
                Endpoint::Chat,
                repeat(r#"{"model":"m","messages":["#, r#"{"role":"u"}"#, n, "]}"),
            ),
            (
                Endpoint::Chat,
                repeat(
                    r#"{"model":"m","messages":[{"role":"u","content":["#,
                    "{}",
                    n,
                    "]}]}",
                ),
            ),
            (
                Endpoint::Chat,
                repeat(
                    r#"{"model":"m","messages":[{"role":"u"}],"tools":["#,
                    "0",
                    n,
                    "]}",
                ),
            ),
            (
                Endpoint::Completions,
                repeat(r#"{"model":"m","prompt":["#, "1", n, "]}"),
            ),
            (
                Endpoint::Completions,
                repeat(
                    r#"{"model":"m","prompt":"x","kvrouter":{"allowed_workers":["#,
                    "1",
                    n,
                    "]}}",
                ),
            ),
        ];
        for (endpoint, body) in &interpreted {
            let bytes = allocated(*endpoint, body);
            let limit = PARSE_ALLOC_PER_BYTE * body.len() as u64 + 4096;
            assert!(
                bytes <= limit,
                "{bytes} bytes for a {} byte body",
                body.len()
            );
        }
        // Nesting past serde_json's depth limit is refused, not followed.
        let deep = repeat(r#"{"model":"m","prompt":"x","junk":"#, "[", 100_000, "");
        assert!(parse(Endpoint::Completions, &deep, GRANTED).is_err());
        assert!(allocated(Endpoint::Completions, &deep) <= 64 * deep.len() as u64);
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_parse_within_the_bound(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048)) {
            let bytes = allocated(Endpoint::Chat, &body);
            proptest::prop_assert!(bytes <= PARSE_ALLOC_PER_BYTE * body.len() as u64 + 4096);
        }

        #[test]
        fn any_json_parses_within_the_bound(v in json_value(4)) {
            let body = serde_json::to_vec(&json!({"model": "m", "messages": [{"role": "user", "content": v.clone()}], "x": v})).unwrap();
            let bytes = allocated(Endpoint::Chat, &body);
            proptest::prop_assert!(bytes <= PARSE_ALLOC_PER_BYTE * body.len() as u64 + 4096);
        }
    }

    fn json_value(depth: u32) -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(depth, 256, 16, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..16).prop_map(Value::from),
                proptest::collection::btree_map("[a-z]{1,4}", inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
