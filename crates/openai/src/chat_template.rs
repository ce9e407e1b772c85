//! Chat templates rendered as Hugging Face transformers' `apply_chat_template` renders them.
//!
//! The engine behind the frontend (vLLM, SGLang) renders a chat request with transformers'
//! jinja2 environment and tokenizes the result. The router can only find the engine's cached
//! prefix if the frontend produces the same text, so this module copies that environment
//! with minijinja: `trim_blocks` and `lstrip_blocks` on, `keep_trailing_newline` off, loop
//! controls, Python string and dict methods (minijinja-contrib's pycompat), transformers'
//! `tojson` (plain `json.dumps`, not jinja2's HTML-safe one), the globals `raise_exception`
//! and `strftime_now`, and Python's spelling of `None`, `True`, `False` and floats in output.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{from_args, Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};

/// The name the template is stored under in its environment; it appears in error locations.
const TEMPLATE_NAME: &str = "chat_template";

/// Context variables the request sets itself; `chat_template_kwargs` may not replace them
/// (transformers would fail with "got multiple values for keyword argument").
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Why a chat template could not be compiled or rendered.
///
/// Everything but [`ChatTemplateError::Compile`] happens per request and is the client's to
/// fix (an HTTP 400); the messages are written for the client.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The model directory has no chat template and none was given with `--chat-template`.
    #[error(
        "model `{model}` has no chat template (no `chat_template` in its tokenizer_config.json \
         and no chat_template.jinja); use the completions endpoint, or start the frontend with \
         --chat-template FILE"
    )]
    Missing { model: String },
    /// The template source is not valid Jinja (found when the model is loaded).
    #[error("chat template from {origin} does not compile: {message}")]
    Compile { origin: String, message: String },
    /// The template called `raise_exception(message)`, as templates do to reject a request
    /// (roles out of order, unsupported content); the message is the template's own.
    #[error("{0}")]
    Raised(String),
    /// Rendering failed for another reason (a method the request's values lack, a bad type).
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// `chat_template_kwargs` tried to set a variable the request itself sets.
    #[error("chat_template_kwargs may not set `{0}`: it comes from the request itself")]
    ReservedKwarg(String),
    /// The rendered prompt would be longer than the frontend takes.
    #[error("the rendered chat prompt is over {0} bytes")]
    TooLong(usize),
    /// Rendering took more template steps than any real conversation needs.
    #[error("the chat template took over {RENDER_FUEL} steps to render this request")]
    TooCostly,
}

/// Template instructions one render may run: a 20,000-message conversation renders well
/// within it with the usual templates (a test checks Qwen2.5's message loop); a request
/// built to make a template loop is cut.
pub const RENDER_FUEL: u64 = 20_000_000;

/// One chat request's inputs to the template, as the client sent them.
#[derive(Debug, Clone, Copy)]
pub struct ChatInput<'a> {
    /// The `messages` array; each message is passed through as JSON (content may be a
    /// string, a list of parts or null; extra fields such as `tool_calls` stay visible).
    pub messages: &'a [serde_json::Value],
    /// Whether to end with the assistant header so the model answers.
    pub add_generation_prompt: bool,
    /// The request's `tools`, or `None` (the template then sees `none`, as in transformers).
    pub tools: Option<&'a [serde_json::Value]>,
    /// RAG `documents`, or `None`.
    pub documents: Option<&'a [serde_json::Value]>,
    /// `chat_template_kwargs`: extra template variables (e.g. `enable_thinking`); they
    /// override the special tokens but not the variables above.
    pub extra: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The longest rendered prompt accepted, in bytes ([`ChatTemplateError::TooLong`]).
    pub max_output_bytes: usize,
}

impl<'a> ChatInput<'a> {
    /// Just messages: no tools, documents or extra variables.
    pub fn new(messages: &'a [serde_json::Value], add_generation_prompt: bool) -> Self {
        Self {
            messages,
            add_generation_prompt,
            tools: None,
            documents: None,
            extra: None,
            max_output_bytes: usize::MAX,
        }
    }
}

/// A `Vec` that refuses to grow past its limit (the render stops at the first write over).
struct Bounded {
    buf: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("over the limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template plus the special tokens it is rendered with.
///
/// Compiled once when the model is loaded; rendering takes `&self`, so one instance serves
/// every request thread.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as transformers' `special_tokens_map` passes them.
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `origin` names where it came from (a file path) for the error;
    /// `special_tokens` maps names such as `bos_token` to their text.
    pub fn new(
        source: String,
        origin: &str,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("default delimiters are valid");
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ChatTemplateError::Compile {
                origin: origin.to_string(),
                message: e.to_string(),
            })?;
        Ok(Self {
            env,
            special_tokens,
        })
    }

    /// The special tokens the template sees (e.g. `bos_token` → `<s>`).
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// Renders one request to the prompt text the engine would build.
    pub fn render(&self, input: &ChatInput<'_>) -> Result<String, ChatTemplateError> {
        let mut ctx: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        if let Some(extra) = input.extra {
            for (key, value) in extra {
                if RESERVED.contains(&key.as_str()) {
                    return Err(ChatTemplateError::ReservedKwarg(key.clone()));
                }
                ctx.insert(key.clone(), json_to_value(value));
            }
        }
        ctx.insert("messages".into(), json_list(input.messages));
        ctx.insert(
            "tools".into(),
            input.tools.map_or(Value::from(()), json_list),
        );
        ctx.insert(
            "documents".into(),
            input.documents.map_or(Value::from(()), json_list),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added in new()");
        let mut out = Bounded {
            buf: Vec::new(),
            limit: input.max_output_bytes,
            over: false,
        };
        match template.render_captured_to(Value::from(ctx), &mut out) {
            Ok(_) => String::from_utf8(out.buf)
                .map_err(|_| ChatTemplateError::Render("the output is not UTF-8".into())),
            Err(_) if out.over => Err(ChatTemplateError::TooLong(input.max_output_bytes)),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(ChatTemplateError::TooCostly),
            Err(e) => Err(render_error(e)),
        }
    }
}

/// The marker `raise_exception` attaches so its message comes back unchanged.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn render_error(err: Error) -> ChatTemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return ChatTemplateError::Raised(raised.0.clone());
        }
        source = e.source();
    }
    ChatTemplateError::Render(err.to_string())
}

fn json_list(items: &[serde_json::Value]) -> Value {
    items.iter().map(json_to_value).collect()
}

/// JSON as the template sees it: what `json.loads` would give Python.
pub(crate) fn json_to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => json_list(items),
        serde_json::Value::Object(map) => Value::from(
            map.iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect::<BTreeMap<String, Value>>(),
        ),
    }
}

/// Writes values as Python's `str()` does where minijinja's spelling differs.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::None => "None".to_string(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_string(),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => python_float(f),
            Err(_) => return minijinja::escape_formatter(out, state, value),
        },
        ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value)?;
            text
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text).map_err(Error::from)
}

/// Python's `repr()` of a value inside a printed list or dict (`['a', None, {'k': 1.0}]`).
fn python_repr(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => {
            out.push_str(&python_float(f64::try_from(value.clone())?))
        }
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; escapes for
/// backslash, the quote, `\n`, `\r`, `\t` and non-printable characters. Printability is
/// approximated by control characters plus the common non-space separators and format
/// characters (Python consults its full Unicode tables).
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control()
                || matches!(c, '\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}'
                    | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{2064}' | '\u{3000}'
                    | '\u{feff}') =>
            {
                let n = c as u32;
                let _ = if n <= 0xff {
                    write!(out, "\\x{n:02x}")
                } else if n <= 0xffff {
                    write!(out, "\\u{n:04x}")
                } else {
                    write!(out, "\\U{n:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: the shortest round-trip digits, scientific below 1e-4 and from
/// 1e16 on, always with a `.0` or an exponent.
pub(crate) fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    // `{:e}` gives the shortest round-trip digits as d.ddde±x.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1;
    if -4 < decpt && decpt <= 16 {
        let n = digits.len() as i32;
        if decpt <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= n {
            format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
        } else {
            let (int, frac) = digits.split_at(decpt as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{dot}e{exp_sign}{:02}", exp.abs())
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, arguments positional or by keyword.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    // Four optional parameters plus keywords exceed minijinja's function arity: split here.
    let args: Vec<Value> = args.0.into_iter().map(Value::from).collect();
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    ) = from_args(&args)?;
    let arg = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        match positional {
            Some(v) => Ok(Some(v)),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = arg(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => match v.as_i64() {
                Some(n) => " ".repeat(n.max(0) as usize),
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ))
                }
            },
        }),
    };
    let (item_sep, key_sep) = match arg(separators, "separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = arg(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let dumper = PyJson {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    dumper.write(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` over template values.
struct PyJson {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let f = f64::try_from(value.clone())?;
                out.push_str(&if f.is_nan() {
                    "NaN".to_string()
                } else if f.is_infinite() {
                    if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
                } else {
                    python_float(f)
                });
            }
            ValueKind::String => self.write_str(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, depth, '[', ']', &items, |out, item| {
                    self.write(out, item, depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((self.key_text(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, depth, '{', '}', &entries, |out, (key, item)| {
                    self.write_str(out, key);
                    out.push_str(&self.key_sep);
                    self.write(out, item, depth + 1)
                })?;
            }
            kind => {
                let what = if kind == ValueKind::Undefined {
                    "Undefined".to_string()
                } else {
                    kind.to_string()
                };
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {what} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    fn write_container<T>(
        &self,
        out: &mut String,
        depth: usize,
        open: char,
        close: char,
        items: &[T],
        mut each: impl FnMut(&mut String, &T) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth + 1));
            }
            each(out, item)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
        out.push(close);
        Ok(())
    }

    /// Dict keys as `json.dumps` turns them into strings.
    fn key_text(&self, key: &Value) -> Result<String, Error> {
        Ok(match key.kind() {
            ValueKind::String => key.as_str().unwrap_or_default().to_string(),
            ValueKind::None => "null".into(),
            ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
            ValueKind::Number if key.is_integer() => key.to_string(),
            ValueKind::Number => python_float(f64::try_from(key.clone())?),
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("keys must be str, int, float, bool or None, not {kind}"),
                ))
            }
        })
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `strftime_now(format)`: the current time formatted as Python's `datetime.strftime`
/// formats it. The time is UTC (Python uses the local time, which is UTC on servers).
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime_utc(&format, now)))
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats `unix_seconds` (UTC, as a naive datetime) like Python's `datetime.strftime` on
/// glibc in the C locale. Supports the common directives and glibc's `-` (no padding) flag;
/// `%z`/`%Z` are empty as for a naive datetime; anything else is copied as glibc does.
/// Public so the parity test can compare it with Python at a fixed time.
pub fn strftime_utc(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7); // 1970-01-01 was a Thursday; 0 = Sunday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUMULATIVE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUMULATIVE[(month - 1) as usize] + day - 1 + i64::from(leap && month > 2);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |n: i64, width: usize| {
            if no_pad {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let Some(d) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let text = match d {
            'a' => DAYS[weekday as usize][..3].to_string(),
            'A' => DAYS[weekday as usize].to_string(),
            'b' | 'h' => MONTHS[(month - 1) as usize][..3].to_string(),
            'B' => MONTHS[(month - 1) as usize].to_string(),
            'd' => num(day, 2),
            'e' => {
                if no_pad {
                    day.to_string()
                } else {
                    format!("{day:2}")
                }
            }
            'H' => num(hour, 2),
            'I' => num(hour12, 2),
            'j' => num(yday + 1, 3),
            'm' => num(month, 2),
            'M' => num(minute, 2),
            'S' => num(second, 2),
            'p' => if hour < 12 { "AM" } else { "PM" }.to_string(),
            'y' => num(year.rem_euclid(100), 2),
            'Y' => year.to_string(),
            'C' => num(year.div_euclid(100), 2),
            'u' => (if weekday == 0 { 7 } else { weekday }).to_string(),
            'w' => weekday.to_string(),
            'U' => num((yday + 7 - weekday) / 7, 2),
            'W' => num((yday + 7 - (weekday + 6) % 7) / 7, 2),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'R' => format!("{hour:02}:{minute:02}"),
            'D' | 'x' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'X' => format!("{hour:02}:{minute:02}:{second:02}"),
            'c' => format!(
                "{} {} {day:2} {hour:02}:{minute:02}:{second:02} {year}",
                &DAYS[weekday as usize][..3],
                &MONTHS[(month - 1) as usize][..3]
            ),
            'n' => "\n".to_string(),
            't' => "\t".to_string(),
            'z' | 'Z' => String::new(),
            '%' => "%".to_string(),
            other => {
                if no_pad {
                    format!("%-{other}")
                } else {
                    format!("%{other}")
                }
            }
        };
        out.push_str(&text);
    }
    out
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(source: &str) -> ChatTemplate {
        let special = BTreeMap::from([
            ("bos_token".to_string(), "<s>".to_string()),
            ("eos_token".to_string(), "</s>".to_string()),
        ]);
        ChatTemplate::new(source.to_string(), "test", special).unwrap()
    }

    fn messages(v: serde_json::Value) -> Vec<serde_json::Value> {
        v.as_array().unwrap().clone()
    }

    #[test]
    fn whitespace_follows_transformers() {
        // trim_blocks eats the newline after a block tag, lstrip_blocks the indentation
        // before it; an expression keeps its newline; the final newline is dropped.
        let t = template(
            "{{ bos_token }}\n    {% for m in messages %}\n{{ m['content'] }}\n    {% endfor %}\nend\n",
        );
        let msgs = messages(json!([{"role": "user", "content": "a"}, {"content": "b"}]));
        assert_eq!(
            t.render(&ChatInput::new(&msgs, false)).unwrap(),
            "<s>\na\nb\nend"
        );
    }

    #[test]
    fn python_methods_and_spellings() {
        let t = template(
            "{{ messages[0].content.strip() }}|{{ messages[0].content.upper().split() }}|\
             {{ add_generation_prompt }}|{{ tools }}|{{ 1.0 }}|{{ 0.5 }}|{{ 3 }}|{{ x }}",
        );
        let msgs = messages(json!([{"content": "  hi there "}]));
        assert_eq!(
            t.render(&ChatInput::new(&msgs, true)).unwrap(),
            r#"hi there|['HI', 'THERE']|True|None|1.0|0.5|3|"#
        );
    }

    #[test]
    fn raise_exception_message_is_returned_unchanged() {
        let t = template(
            "{% for m in messages %}{% if m.role == 'bad' %}\
             {{ raise_exception('Conversation roles must alternate user/assistant') }}\
             {% endif %}{% endfor %}ok",
        );
        let msgs = messages(json!([{"role": "bad"}]));
        match t.render(&ChatInput::new(&msgs, false)) {
            Err(ChatTemplateError::Raised(m)) => {
                assert_eq!(m, "Conversation roles must alternate user/assistant")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
        let ok = messages(json!([{"role": "user"}]));
        assert_eq!(t.render(&ChatInput::new(&ok, false)).unwrap(), "ok");
    }

    #[test]
    fn other_render_errors_are_typed_with_minijinja_message() {
        let t = template("{{ messages[0].content.nosuchmethod() }}");
        let msgs = messages(json!([{"content": "x"}]));
        let err = t.render(&ChatInput::new(&msgs, false)).unwrap_err();
        let ChatTemplateError::Render(message) = &err else {
            panic!("expected Render, got {err:?}");
        };
        assert!(message.contains("nosuchmethod"), "{message}");
    }

    #[test]
    fn syntax_errors_fail_at_compile_time_naming_the_origin() {
        let err = ChatTemplate::new(
            "{% for %}".into(),
            "/m/tokenizer_config.json",
            BTreeMap::new(),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ChatTemplateError::Compile { .. }));
        assert!(text.contains("/m/tokenizer_config.json"), "{text}");
        assert!(text.contains("syntax error"), "{text}");
    }

    #[test]
    fn loop_controls_and_namespace() {
        let t = template(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m == 2 %}{% continue %}\
             {% endif %}{% if m == 4 %}{% break %}{% endif %}{% set ns.n = ns.n + m %}{% endfor %}\
             {{ ns.n }}",
        );
        let msgs = messages(json!([1, 2, 3, 4, 5]));
        assert_eq!(t.render(&ChatInput::new(&msgs, false)).unwrap(), "4");
    }

    #[test]
    fn extra_kwargs_override_special_tokens_but_not_request_fields() {
        let t = template("{{ bos_token }}{{ enable_thinking }}");
        let msgs = messages(json!([]));
        let extra = json!({"bos_token": "<B>", "enable_thinking": false});
        let mut input = ChatInput::new(&msgs, false);
        input.extra = extra.as_object();
        assert_eq!(t.render(&input).unwrap(), "<B>False");
        let bad = json!({"messages": []});
        input.extra = bad.as_object();
        assert!(matches!(
            t.render(&input),
            Err(ChatTemplateError::ReservedKwarg(k)) if k == "messages"
        ));
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = template(
            "{{ tools[0] | tojson }}\n{{ tools[0] | tojson(indent=2) }}\n\
             {{ tools[0] | tojson(ensure_ascii=True, separators=[',', ':']) }}\n{{ [] | tojson(indent=4) }}",
        );
        let msgs = messages(json!([]));
        let tools = messages(json!([{"a": [1, 2.5, null, true], "b": "é\n\"<>&\u{1}🚀"}]));
        let mut input = ChatInput::new(&msgs, false);
        input.tools = Some(&tools);
        let expected = concat!(
            "{\"a\": [1, 2.5, null, true], \"b\": \"é\\n\\\"<>&\\u0001🚀\"}\n",
            "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": \"é\\n\\\"<>&\\u0001🚀\"\n}\n",
            "{\"a\":[1,2.5,null,true],\"b\":\"\\u00e9\\n\\\"<>&\\u0001\\ud83d\\ude80\"}\n",
            "[]"
        );
        assert_eq!(t.render(&input).unwrap(), expected);
    }

    #[test]
    fn long_real_conversations_render_within_the_fuel() {
        // Qwen2.5's message loop, the costliest of the usual templates per message.
        let t = template(concat!(
            "{%- for message in messages %}",
            "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}",
            "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
            "{%- elif message.role == \"tool\" %}",
            "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}",
            "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}",
            "{%- endif %}",
            "{%- endfor %}",
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        ));
        let turns: Vec<serde_json::Value> = (0..20_000)
            .map(|i| {
                let role = ["user", "assistant", "tool"][i % 3];
                json!({"role": role, "content": format!("turn {i}")})
            })
            .collect();
        let out = t.render(&ChatInput::new(&turns, true)).unwrap();
        assert!(out.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn a_render_is_bounded_in_output_and_in_steps() {
        let msgs = messages(json!([{"role": "user", "content": "hello"}]));
        let t = template("{% for m in messages %}{{ m.content * 1000 }}{% endfor %}");
        let mut input = ChatInput::new(&msgs, false);
        assert_eq!(t.render(&input).unwrap().len(), 5000);
        input.max_output_bytes = 4999;
        assert!(matches!(
            t.render(&input),
            Err(ChatTemplateError::TooLong(4999))
        ));
        // A loop no real conversation needs runs out of fuel instead of holding a thread.
        let t = template(
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x",
        );
        let err = t.render(&ChatInput::new(&msgs, false)).unwrap_err();
        assert!(matches!(err, ChatTemplateError::TooCostly), "{err}");
        assert!(err.to_string().contains("steps"), "{err}");
    }

    #[test]
    fn tojson_rejects_undefined_like_python() {
        let t = template("{{ nothing | tojson }}");
        let msgs = messages(json!([]));
        let err = t.render(&ChatInput::new(&msgs, false)).unwrap_err();
        assert!(err.to_string().contains("not JSON serializable"), "{err}");
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (2.5, "2.5"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e17, "1.5e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-1.25e-7, "-1.25e-07"),
            (123456.789, "123456.789"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(python_float(f), s, "{f}");
        }
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday in a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc(
                "%Y-%m-%d %H:%M:%S %a %A %b %B %j %p %I %y %e %-d %u %w %%",
                t
            ),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 PM 01 24 29 29 4 4 %"
        );
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime_utc("%F %T", -1), "1969-12-31 23:59:59");
        assert_eq!(strftime_utc("%Q%", 0), "%Q%");
    }

    #[test]
    fn strftime_now_renders_a_date() {
        let t = template("{{ strftime_now('%Y') }}");
        let msgs = messages(json!([]));
        let year: i64 = t
            .render(&ChatInput::new(&msgs, false))
            .unwrap()
            .parse()
            .unwrap();
        assert!(year >= 2024, "{year}");
    }

    #[test]
    fn chat_template_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }
}
