//! The engine's `/v1/completions` stream, reshaped for the client: chunks passed on (as
//! chat chunks for a chat request), or gathered into one answer for a client that did not
//! ask to stream. The frontend always streams from the engine, so it sees the first token.

use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// What one engine chunk carried.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// An answer chunk; `has_output` when it carries generated text (the first one marks
    /// the end of the prefill).
    Answer { value: Value, has_output: bool },
    /// The engine reported an error in the stream.
    Error(Value),
}

/// Reads one engine event's JSON.
pub fn read_chunk(data: &str) -> Result<Chunk, String> {
    let value: Value =
        serde_json::from_str(data).map_err(|e| format!("undecodable engine chunk: {e}"))?;
    if let Some(err) = value.get("error") {
        return Ok(Chunk::Error(err.clone()));
    }
    if !value.is_object() {
        return Err("an engine chunk that is not a JSON object".into());
    }
    let has_output = value
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("text")
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                    || c.get("finish_reason").is_some_and(|f| !f.is_null())
            })
        });
    Ok(Chunk::Answer { value, has_output })
}

/// Drops the engine's count of cached prompt tokens (`usage.prompt_tokens_details`): like
/// the overlap header, it tells a caller whether a prompt, maybe another tenant's, is cached.
fn hide_cache_details(usage: &mut Value) {
    if let Some(u) = usage.as_object_mut() {
        u.remove("prompt_tokens_details");
    }
}

/// Turns engine chunks into the chunks the client asked for.
#[derive(Debug)]
pub struct ChunkShaper {
    chat: bool,
    include_usage: bool,
    hide_cache_details: bool,
    /// Chat choices that already sent their `role`.
    roles_sent: Vec<u64>,
}

impl ChunkShaper {
    pub fn new(chat: bool, include_usage: bool) -> Self {
        Self {
            chat,
            include_usage,
            hide_cache_details: false,
            roles_sent: Vec::new(),
        }
    }

    /// Usage without the cached-token count (callers not granted overlap-header).
    pub fn hiding_cache_details(mut self, hide: bool) -> Self {
        self.hide_cache_details = hide;
        self
    }

    /// The client's chunk, or `None` when nothing is left to send (a usage-only chunk
    /// nobody asked for).
    pub fn shape(&mut self, mut chunk: Value) -> Option<Value> {
        let obj = chunk.as_object_mut()?;
        if !self.include_usage {
            obj.remove("usage");
        }
        if self.hide_cache_details {
            if let Some(u) = obj.get_mut("usage") {
                hide_cache_details(u);
            }
        }
        let no_choices = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if no_choices && !obj.contains_key("usage") {
            return None;
        }
        if self.chat {
            obj.insert("object".into(), "chat.completion.chunk".into());
            chat_id(obj);
            if let Some(Value::Array(choices)) = obj.get_mut("choices") {
                for c in choices.iter_mut() {
                    let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
                    let first = !self.roles_sent.contains(&index);
                    if first {
                        self.roles_sent.push(index);
                    }
                    *c = chat_delta(c, first);
                }
            }
        }
        Some(chunk)
    }
}

fn chat_id(obj: &mut Map<String, Value>) {
    if let Some(Value::String(id)) = obj.get_mut("id") {
        if !id.starts_with("chatcmpl") {
            *id = format!("chatcmpl-{}", id.strip_prefix("cmpl-").unwrap_or(id));
        }
    }
}

fn chat_delta(c: &Value, with_role: bool) -> Value {
    let text = c.get("text").and_then(Value::as_str).unwrap_or("");
    let mut delta = Map::new();
    if with_role {
        delta.insert("role".into(), "assistant".into());
    }
    if !text.is_empty() || with_role {
        delta.insert("content".into(), text.into());
    }
    json!({
        "index": c.get("index").cloned().unwrap_or(Value::from(0)),
        "delta": delta,
        "logprobs": c.get("logprobs").cloned().unwrap_or(Value::Null),
        "finish_reason": c.get("finish_reason").cloned().unwrap_or(Value::Null),
    })
}

/// Gathers an engine stream into one answer (a client that did not ask to stream).
#[derive(Debug, Default)]
pub struct Gathered {
    head: Map<String, Value>,
    choices: BTreeMap<u64, (String, Value)>,
    usage: Option<Value>,
    hide_cache_details: bool,
}

impl Gathered {
    /// Usage without the cached-token count (callers not granted overlap-header).
    pub fn hiding_cache_details(hide: bool) -> Self {
        Self {
            hide_cache_details: hide,
            ..Self::default()
        }
    }

    pub fn add(&mut self, chunk: &Value) {
        let Some(obj) = chunk.as_object() else { return };
        if self.head.is_empty() {
            for key in ["id", "created", "model", "system_fingerprint"] {
                if let Some(v) = obj.get(key) {
                    self.head.insert(key.into(), v.clone());
                }
            }
        }
        if let Some(u) = obj.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        for c in obj
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let entry = self
                .choices
                .entry(index)
                .or_insert((String::new(), Value::Null));
            if let Some(t) = c.get("text").and_then(Value::as_str) {
                entry.0.push_str(t);
            }
            if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
                entry.1 = f.clone();
            }
        }
    }

    /// The answer: a `text_completion`, or a `chat.completion` with assistant messages.
    pub fn finish(self, chat: bool) -> Value {
        let mut obj = self.head;
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, (text, finish))| {
                if chat {
                    json!({"index": index, "message": {"role": "assistant", "content": text},
                           "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
                }
            })
            .collect();
        if chat {
            chat_id(&mut obj);
        }
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        obj.insert("object".into(), object.into());
        obj.insert("choices".into(), choices.into());
        let mut usage = self.usage.unwrap_or(Value::Null);
        if self.hide_cache_details {
            hide_cache_details(&mut usage);
        }
        obj.insert("usage".into(), usage);
        Value::Object(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine_chunk(text: &str, finish: Option<&str>, usage: bool) -> Value {
        let mut v = json!({"id": "cmpl-7", "object": "text_completion", "created": 5, "model": "m",
                           "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]});
        if usage {
            v["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
        }
        v
    }

    #[test]
    fn chunks_with_output_mark_the_first_token() {
        let c = read_chunk(&engine_chunk("", None, false).to_string()).unwrap();
        assert!(matches!(
            c,
            Chunk::Answer {
                has_output: false,
                ..
            }
        ));
        let c = read_chunk(&engine_chunk(" a", None, false).to_string()).unwrap();
        assert!(matches!(
            c,
            Chunk::Answer {
                has_output: true,
                ..
            }
        ));
        let e = read_chunk(r#"{"error": {"message": "boom"}}"#).unwrap();
        assert_eq!(e, Chunk::Error(json!({"message": "boom"})));
        assert!(read_chunk("{").is_err());
        assert!(read_chunk("[1]").is_err());
    }

    #[test]
    fn chat_chunks_carry_the_role_once_and_the_text_as_content() {
        let mut s = ChunkShaper::new(true, false);
        let first = s.shape(engine_chunk(" a", None, false)).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["id"], "chatcmpl-7");
        assert_eq!(
            first["choices"][0]["delta"],
            json!({"role": "assistant", "content": " a"})
        );
        let next = s.shape(engine_chunk(" b", None, false)).unwrap();
        assert_eq!(next["choices"][0]["delta"], json!({"content": " b"}));
        let last = s.shape(engine_chunk("", Some("length"), true)).unwrap();
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last.get("usage").is_none(), "usage nobody asked for");
    }

    #[test]
    fn the_cached_token_count_goes_only_to_granted_callers() {
        let usage = json!({"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66,
                           "prompt_tokens_details": {"cached_tokens": 48}});
        let chunk = json!({"id": "cmpl-7", "object": "text_completion", "created": 5,
                           "model": "m", "choices": [{"index": 0, "text": "a",
                           "finish_reason": "length"}], "usage": usage});
        let plain = json!({"prompt_tokens": 64, "completion_tokens": 2, "total_tokens": 66});
        for (hide, want) in [(true, &plain), (false, &usage)] {
            let shaped = ChunkShaper::new(false, true)
                .hiding_cache_details(hide)
                .shape(chunk.clone())
                .unwrap();
            assert_eq!(&shaped["usage"], want);
            let mut g = Gathered::hiding_cache_details(hide);
            g.add(&chunk);
            assert_eq!(&g.finish(true)["usage"], want);
        }
    }

    #[test]
    fn usage_only_chunks_go_out_only_when_asked_for() {
        let usage_only = json!({"id": "cmpl-7", "object": "text_completion", "created": 5,
                                "model": "m", "choices": [], "usage": {"total_tokens": 5}});
        assert_eq!(
            ChunkShaper::new(false, false).shape(usage_only.clone()),
            None
        );
        let kept = ChunkShaper::new(false, true)
            .shape(usage_only.clone())
            .unwrap();
        assert_eq!(kept, usage_only);
    }

    #[test]
    fn a_gathered_stream_is_one_answer() {
        for chat in [false, true] {
            let mut g = Gathered::default();
            for c in [
                engine_chunk(" a", None, false),
                engine_chunk(" b", None, false),
                engine_chunk("", Some("stop"), true),
            ] {
                g.add(&c);
            }
            let v = g.finish(chat);
            if chat {
                assert_eq!(v["object"], "chat.completion");
                assert_eq!(v["id"], "chatcmpl-7");
                assert_eq!(
                    v["choices"][0]["message"],
                    json!({"role": "assistant", "content": " a b"})
                );
            } else {
                assert_eq!(v["object"], "text_completion");
                assert_eq!(v["choices"][0]["text"], " a b");
            }
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert_eq!(v["usage"]["total_tokens"], 5);
            assert_eq!(v["model"], "m");
        }
    }
}
