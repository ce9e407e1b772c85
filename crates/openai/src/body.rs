//! A request body read in one pass: `prompt` straight into text or token ids, the fields
//! the frontend reads itself as JSON values, and every other field kept as the client wrote
//! it. An 8k-token prompt read as JSON values costs twice the time (and eight times the
//! memory) of reading it as ids; a long array in a field the frontend only passes on would
//! cost sixteen times its bytes as values, and costs its bytes as text.

use serde::de::{Deserialize, Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;

/// `prompt` as it came.
#[derive(Clone, Debug, PartialEq)]
pub enum RawPrompt {
    Null,
    Text(String),
    Tokens(Vec<u32>),
    /// A shape no prompt has; the message says what is wrong.
    Bad(String),
}

/// The fields the frontend reads (or drops) itself, with [`CHAT_ONLY`]; the others pass to
/// the engine as text.
pub const INTERPRETED: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "kvrouter",
    "messages",
    "max_tokens",
    "data_parallel_rank",
];

/// Chat fields that mean nothing to `/v1/completions` (the frontend renders the prompt).
pub const CHAT_ONLY: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "top_logprobs",
    "logprobs",
    "max_completion_tokens",
];

fn interpreted(key: &str) -> bool {
    INTERPRETED.contains(&key) || CHAT_ONLY.contains(&key)
}

/// The body: its prompt (if any), the fields the frontend reads, and the rest as text.
#[derive(Debug)]
pub struct Body {
    pub prompt: Option<RawPrompt>,
    /// The [`INTERPRETED`] fields present.
    pub rest: Map<String, Value>,
    /// Every other field as `"key":value` members, comma-separated, as the client wrote
    /// the values (keys re-escaped).
    pub passthrough: String,
}

const ONE_PROMPT: &str = "prompt must be a string or a list of token ids (one prompt per request)";

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BodyVisitor;
        impl<'de> Visitor<'de> for BodyVisitor {
            type Value = Body;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body, A::Error> {
                let mut body = Body {
                    prompt: None,
                    rest: Map::new(),
                    passthrough: String::new(),
                };
                let mut passthrough = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "prompt" {
                        body.prompt = Some(map.next_value()?);
                    } else if interpreted(&key) {
                        let v = map.next_value()?;
                        body.rest.insert(key, v);
                    } else {
                        let v: &RawValue = map.next_value()?;
                        if !passthrough.is_empty() {
                            passthrough.push(b',');
                        }
                        // A string key serializes infallibly.
                        let _ = serde_json::to_writer(&mut passthrough, &key);
                        passthrough.push(b':');
                        passthrough.extend_from_slice(v.get().as_bytes());
                    }
                }
                // JSON text from a parsed document: UTF-8 by construction.
                body.passthrough = String::from_utf8(passthrough).map_err(A::Error::custom)?;
                Ok(body)
            }
        }
        d.deserialize_map(BodyVisitor)
    }
}

/// One element of a prompt list.
enum Item {
    Id(u32),
    Text(String),
    Nested(RawPrompt),
    /// A number that is no token id, with what to say of it.
    BadNumber(String),
    Other,
}

fn not_an_id(v: impl fmt::Display) -> String {
    format!("{v} is not a token id (0..2^32)")
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id or a text")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Item, E> {
                Ok(u32::try_from(v).map_or_else(|_| Item::BadNumber(not_an_id(v)), Item::Id))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Item, E> {
                Ok(u32::try_from(v).map_or_else(|_| Item::BadNumber(not_an_id(v)), Item::Id))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Item, E> {
                Ok(Item::BadNumber(not_an_id(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Text(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Item, E> {
                Ok(Item::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
                PromptVisitor { top: false }
                    .visit_seq(seq)
                    .map(Item::Nested)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Item::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_unit<E>(self) -> Result<Item, E> {
                Ok(Item::Other)
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

/// `top`: the prompt itself, not a list inside it.
struct PromptVisitor {
    top: bool,
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = RawPrompt;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_str<E>(self, v: &str) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Text(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Text(v))
    }
    fn visit_unit<E>(self) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Null)
    }
    /// A list of ids; at the top, also a list holding one text or one list of ids.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawPrompt, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        let (mut items, mut first_other, mut bad_number) = (0usize, None, None);
        while let Some(item) = seq.next_element::<Item>()? {
            items += 1;
            match item {
                Item::Id(id) => ids.push(id),
                Item::BadNumber(m) => {
                    bad_number.get_or_insert(m);
                }
                other => {
                    first_other.get_or_insert(other);
                }
            }
        }
        Ok(match (first_other, bad_number) {
            (None, None) => RawPrompt::Tokens(ids),
            (None, Some(m)) => RawPrompt::Bad(m),
            (Some(Item::Text(s)), None) if self.top && items == 1 => RawPrompt::Text(s),
            (Some(Item::Nested(p @ (RawPrompt::Tokens(_) | RawPrompt::Bad(_)))), None)
                if self.top && items == 1 =>
            {
                p
            }
            _ => RawPrompt::Bad(ONE_PROMPT.into()),
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawPrompt, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(RawPrompt::Bad(ONE_PROMPT.into()))
    }
    fn visit_u64<E>(self, _: u64) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Bad(ONE_PROMPT.into()))
    }
    fn visit_i64<E>(self, _: i64) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Bad(ONE_PROMPT.into()))
    }
    fn visit_f64<E>(self, _: f64) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Bad(ONE_PROMPT.into()))
    }
    fn visit_bool<E>(self, _: bool) -> Result<RawPrompt, E> {
        Ok(RawPrompt::Bad(ONE_PROMPT.into()))
    }
}

impl<'de> Deserialize<'de> for RawPrompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor { top: true })
    }
}

/// The body for the engine: `fields`, then the `passthrough` members as they came, with
/// `"prompt"` set to `tokens` (written as ids, not through JSON values).
pub fn with_token_prompt(
    fields: &Map<String, Value>,
    passthrough: &str,
    tokens: &[u32],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(tokens.len() * 7 + passthrough.len() + 256);
    out.extend_from_slice(b"{\"prompt\":");
    // Writing to a Vec and serializing u32s and JSON values cannot fail.
    let _ = serde_json::to_writer(&mut out, tokens);
    for (k, v) in fields.iter().filter(|(k, _)| *k != "prompt") {
        out.push(b',');
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        let _ = serde_json::to_writer(&mut out, v);
    }
    if !passthrough.is_empty() {
        out.push(b',');
        out.extend_from_slice(passthrough.as_bytes());
    }
    out.push(b'}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn prompt(v: Value) -> RawPrompt {
        let b: Body = serde_json::from_str(&json!({"prompt": v, "x": 1}).to_string()).unwrap();
        assert!(b.rest.is_empty());
        assert_eq!(b.passthrough, r#""x":1"#);
        b.prompt.unwrap()
    }

    #[test]
    fn every_prompt_shape() {
        assert_eq!(prompt(json!("hi")), RawPrompt::Text("hi".into()));
        assert_eq!(prompt(json!(["hi"])), RawPrompt::Text("hi".into()));
        assert_eq!(prompt(json!(null)), RawPrompt::Null);
        assert_eq!(prompt(json!([1, 2, 3])), RawPrompt::Tokens(vec![1, 2, 3]));
        assert_eq!(prompt(json!([[1, 2, 3]])), RawPrompt::Tokens(vec![1, 2, 3]));
        assert_eq!(prompt(json!([])), RawPrompt::Tokens(vec![]));
        assert_eq!(
            prompt(json!([4294967295u64])),
            RawPrompt::Tokens(vec![u32::MAX])
        );
        let bad = |v: Value| match prompt(v.clone()) {
            RawPrompt::Bad(m) => m,
            other => panic!("{v} read as {other:?}"),
        };
        assert_eq!(
            bad(json!([1, 4294967296u64])),
            "4294967296 is not a token id (0..2^32)"
        );
        assert_eq!(bad(json!([1, -1])), "-1 is not a token id (0..2^32)");
        assert_eq!(bad(json!([1.5])), "1.5 is not a token id (0..2^32)");
        assert_eq!(bad(json!([[1, -2]])), "-2 is not a token id (0..2^32)");
        for v in [
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([1, "a"]),
            json!([{"a": 1}]),
            json!([true]),
            json!([null]),
            json!([[[1]]]),
            json!([["a"]]),
            json!({"a": [1]}),
            json!(7),
            json!(false),
        ] {
            assert_eq!(bad(v), ONE_PROMPT);
        }
    }

    #[test]
    fn the_other_fields_and_errors() {
        let b: Body =
            serde_json::from_str(r#"{"a": [1, {"b":null}],"model":"m","q\"":2}"#).unwrap();
        assert_eq!(b.prompt, None);
        assert_eq!(b.rest, *json!({"model": "m"}).as_object().unwrap());
        // Values as written; keys re-escaped.
        assert_eq!(b.passthrough, r#""a":[1, {"b":null}],"q\"":2"#);
        assert!(serde_json::from_str::<Body>("[1]").is_err());
        assert!(serde_json::from_str::<Body>(r#"{"prompt":[1,2"#).is_err());
        assert!(serde_json::from_str::<Body>(r#"{"prompt":[1,2]} x"#).is_err());
    }

    #[test]
    fn the_engine_body_round_trips() {
        let fields = json!({"model": "m", "prompt": "replaced", "stream": true});
        let out = with_token_prompt(
            fields.as_object().unwrap(),
            r#""n": [1, "x"]"#,
            &[5, 0, u32::MAX],
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            json!({"model": "m", "prompt": [5, 0, 4294967295u64], "stream": true, "n": [1, "x"]})
        );
        let empty = with_token_prompt(&Map::new(), "", &[1]);
        assert_eq!(empty, br#"{"prompt":[1]}"#);
    }
}
