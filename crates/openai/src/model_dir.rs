//! A model's local Hugging Face directory: tokenizer, chat template, special tokens and the
//! longest prompt the model takes.
//!
//! Reads only local files (no Hub downloads): the operator points the frontend at the same
//! directory the engine serves from, so both tokenize and template alike.
//!
//! - `tokenizer.json` (required): the fast tokenizer.
//! - `tokenizer_config.json` (optional): `chat_template`, the special tokens
//!   (`bos_token`, `eos_token`, ...), `model_max_length`.
//! - `chat_template.jinja` (optional): where newer transformers save the template; it wins
//!   over tokenizer_config.json as in transformers. `chat_template.json` (a processor's
//!   `{"chat_template": ...}`) is the last fallback.
//! - `config.json` (optional): `max_position_embeddings` (top level or in `text_config`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::chat_template::{ChatInput, ChatTemplate, ChatTemplateError};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// transformers writes `int(1e30)` as `model_max_length` when a model sets none; anything
/// above this bound is such a sentinel, not a real limit.
pub const MAX_PLAUSIBLE_LIMIT: u64 = 1_000_000_000;

/// Special tokens transformers passes to chat templates (its `special_tokens_map`).
const SPECIAL_TOKEN_FIELDS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Why a model directory cannot be served. Every variant names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum ModelDirError {
    /// The directory does not exist or is not a directory.
    #[error("model `{model}`: {path} is not a directory")]
    NotADirectory { model: String, path: PathBuf },
    /// tokenizer.json is missing.
    #[error(
        "model `{model}`: {path} not found; the model directory needs the Hugging Face fast \
         tokenizer file tokenizer.json"
    )]
    MissingTokenizer { model: String, path: PathBuf },
    /// A file exists but cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{path} is not valid JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// A field has the wrong shape.
    #[error("{path}: `{field}` {problem}")]
    Field {
        path: PathBuf,
        field: String,
        problem: String,
    },
    /// tokenizer.json parses as JSON but not as a tokenizer.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The chat template does not compile.
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    /// No source gives a prompt limit.
    #[error(
        "model `{model}`: cannot tell the longest prompt it accepts: no prompt limit override \
         (--max-prompt-tokens), no `model_max_length` of at most {MAX_PLAUSIBLE_LIMIT} in \
         {tokenizer_config}, and no `max_position_embeddings` in {config}"
    )]
    NoPromptLimit {
        model: String,
        tokenizer_config: PathBuf,
        config: PathBuf,
    },
    /// The prompt limit override is zero.
    #[error("model `{model}`: the prompt limit override must be at least 1 token")]
    ZeroPromptLimit { model: String },
}

/// Where the prompt limit came from (for the startup log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptLimitSource {
    /// The operator's override.
    Override,
    /// `model_max_length` in tokenizer_config.json.
    ModelMaxLength,
    /// `max_position_embeddings` in config.json.
    MaxPositionEmbeddings,
}

/// The longest prompt, in tokens, the frontend accepts for a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimit {
    pub tokens: usize,
    pub source: PromptLimitSource,
}

/// The first limit that is set, in the order override, `model_max_length`,
/// `max_position_embeddings`.
pub fn resolve_prompt_limit(
    max_prompt_override: Option<usize>,
    model_max_length: Option<usize>,
    max_position_embeddings: Option<usize>,
) -> Option<PromptLimit> {
    let limit = |tokens, source| PromptLimit { tokens, source };
    max_prompt_override
        .map(|t| limit(t, PromptLimitSource::Override))
        .or_else(|| model_max_length.map(|t| limit(t, PromptLimitSource::ModelMaxLength)))
        .or_else(|| {
            max_position_embeddings.map(|t| limit(t, PromptLimitSource::MaxPositionEmbeddings))
        })
}

/// Everything the frontend needs from one model directory, loaded once at startup.
#[derive(Debug)]
pub struct ModelFiles {
    name: String,
    dir: PathBuf,
    tokenizer: Tokenizer,
    chat_template: Option<ChatTemplate>,
    special_tokens: BTreeMap<String, String>,
    prompt_limit: PromptLimit,
}

impl ModelFiles {
    /// Loads the model `name` from `dir`.
    ///
    /// `chat_template_override` (a Jinja file, `--chat-template`) replaces any template in
    /// the directory; `max_prompt_override` replaces the limit read from the files. A model
    /// without a chat template loads (completions still work); chat requests then fail with
    /// [`ChatTemplateError::Missing`].
    pub fn load(
        name: &str,
        dir: &Path,
        chat_template_override: Option<&Path>,
        max_prompt_override: Option<usize>,
    ) -> Result<Self, ModelDirError> {
        if !dir.is_dir() {
            return Err(ModelDirError::NotADirectory {
                model: name.to_string(),
                path: dir.to_path_buf(),
            });
        }
        if max_prompt_override == Some(0) {
            return Err(ModelDirError::ZeroPromptLimit {
                model: name.to_string(),
            });
        }

        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer_bytes = match std::fs::read(&tokenizer_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ModelDirError::MissingTokenizer {
                    model: name.to_string(),
                    path: tokenizer_path,
                })
            }
            Err(source) => {
                return Err(ModelDirError::Read {
                    path: tokenizer_path,
                    source,
                })
            }
        };
        let tokenizer = Tokenizer::from_bytes(&tokenizer_bytes, &tokenizer_path)?;

        let tokenizer_config_path = dir.join("tokenizer_config.json");
        let tokenizer_config = read_json(&tokenizer_config_path)?;
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?;

        let mut special_tokens = BTreeMap::new();
        if let Some(tc) = &tokenizer_config {
            for field in SPECIAL_TOKEN_FIELDS {
                if let Some(text) = special_token(tc, field, &tokenizer_config_path)? {
                    special_tokens.insert(field.to_string(), text);
                }
            }
        }

        let model_max_length = match &tokenizer_config {
            Some(tc) => limit_field(tc, "model_max_length", &tokenizer_config_path)?,
            None => None,
        };
        let max_position_embeddings = match &config {
            Some(c) => match limit_field(c, "max_position_embeddings", &config_path)? {
                Some(n) => Some(n),
                None => match c.get("text_config") {
                    Some(text_config) => {
                        limit_field(text_config, "max_position_embeddings", &config_path)?
                    }
                    None => None,
                },
            },
            None => None,
        };
        let prompt_limit = resolve_prompt_limit(
            max_prompt_override,
            model_max_length,
            max_position_embeddings,
        )
        .ok_or_else(|| ModelDirError::NoPromptLimit {
            model: name.to_string(),
            tokenizer_config: tokenizer_config_path.clone(),
            config: config_path.clone(),
        })?;

        let template_source = match chat_template_override {
            Some(path) => Some((read_text(path)?, path.display().to_string())),
            None => find_chat_template(dir, tokenizer_config.as_ref(), &tokenizer_config_path)?,
        };
        let chat_template = match template_source {
            Some((source, origin)) => {
                Some(ChatTemplate::new(source, &origin, special_tokens.clone())?)
            }
            None => None,
        };

        Ok(Self {
            name: name.to_string(),
            dir: dir.to_path_buf(),
            tokenizer,
            chat_template,
            special_tokens,
            prompt_limit,
        })
    }

    /// The served model name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The directory the files came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer (clone it to keep a handle).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The compiled chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Special tokens by name (`bos_token` → `<s>`), from tokenizer_config.json.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// The longest prompt accepted and where that number came from.
    pub fn prompt_limit(&self) -> PromptLimit {
        self.prompt_limit
    }

    /// Renders a chat request to prompt text. Tokenize the result with
    /// `add_special_tokens = false`: the template already wrote BOS and the like.
    pub fn render_chat(&self, input: &ChatInput<'_>) -> Result<String, ChatTemplateError> {
        match &self.chat_template {
            Some(template) => template.render(input),
            None => Err(ChatTemplateError::Missing {
                model: self.name.clone(),
            }),
        }
    }
}

/// Reads an optional JSON file: `None` if it does not exist.
fn read_json(path: &Path) -> Result<Option<Json>, ModelDirError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ModelDirError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelDirError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}

fn read_text(path: &Path) -> Result<String, ModelDirError> {
    std::fs::read_to_string(path).map_err(|source| ModelDirError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn field_error(path: &Path, field: &str, problem: impl Into<String>) -> ModelDirError {
    ModelDirError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// A special token given as a string or as an AddedToken object with `content`.
fn special_token(config: &Json, field: &str, path: &Path) -> Result<Option<String>, ModelDirError> {
    match config.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(
                path,
                field,
                "is an object without a string `content`",
            )),
        },
        Some(other) => Err(field_error(
            path,
            field,
            format!("must be a string or an object with `content`, not {other}"),
        )),
    }
}

/// A token limit: a positive number; above [`MAX_PLAUSIBLE_LIMIT`] it counts as unset.
fn limit_field(config: &Json, field: &str, path: &Path) -> Result<Option<usize>, ModelDirError> {
    let value = match config.get(field) {
        None | Some(Json::Null) => return Ok(None),
        Some(Json::Number(n)) => n,
        Some(other) => {
            return Err(field_error(
                path,
                field,
                format!("must be a number, not {other}"),
            ))
        }
    };
    let tokens = match value.as_u64() {
        Some(n) => n as f64,
        None => value.as_f64().unwrap_or(f64::NAN),
    };
    if tokens.is_nan() || tokens < 1.0 {
        return Err(field_error(
            path,
            field,
            format!("must be a positive token count, not {value}"),
        ));
    }
    if tokens > MAX_PLAUSIBLE_LIMIT as f64 {
        return Ok(None);
    }
    Ok(Some(tokens as usize))
}

/// The template text and where it came from, by transformers' precedence.
fn find_chat_template(
    dir: &Path,
    tokenizer_config: Option<&Json>,
    tokenizer_config_path: &Path,
) -> Result<Option<(String, String)>, ModelDirError> {
    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.is_file() {
        return Ok(Some((
            read_text(&jinja_path)?,
            jinja_path.display().to_string(),
        )));
    }
    if let Some(config) = tokenizer_config {
        if let Some(found) = template_field(config, tokenizer_config_path)? {
            return Ok(Some(found));
        }
    }
    let processor_path = dir.join("chat_template.json");
    if let Some(config) = read_json(&processor_path)? {
        return template_field(&config, &processor_path);
    }
    Ok(None)
}

/// `chat_template` as a string, or HF's list of named templates (the one named `default`).
fn template_field(config: &Json, path: &Path) -> Result<Option<(String, String)>, ModelDirError> {
    const FIELD: &str = "chat_template";
    let origin = path.display().to_string();
    match config.get(FIELD) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some((s.clone(), origin))),
        Some(Json::Array(items)) => {
            let mut names = Vec::new();
            for item in items {
                let (Some(Json::String(name)), Some(Json::String(template))) =
                    (item.get("name"), item.get("template"))
                else {
                    return Err(field_error(
                        path,
                        FIELD,
                        "list entries must be objects with string `name` and `template`",
                    ));
                };
                if name == "default" {
                    return Ok(Some((
                        template.clone(),
                        format!("{origin} (template `default`)"),
                    )));
                }
                names.push(name.as_str());
            }
            Err(field_error(
                path,
                FIELD,
                format!(
                    "lists templates {names:?} but none named `default`; choose one with \
                     --chat-template FILE"
                ),
            ))
        }
        Some(other) => Err(field_error(
            path,
            FIELD,
            format!(
                "must be a string or a list of {{name, template}} objects, not {}",
                kind(other)
            ),
        )),
    }
}

fn kind(json: &Json) -> &'static str {
    match json {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TOKENIZER: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hi": 2}, "unk_token": "<unk>"}
    }"#;

    fn model_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    fn load(dir: &Path) -> Result<ModelFiles, ModelDirError> {
        ModelFiles::load("m", dir, None, None)
    }

    #[test]
    fn limit_order_is_override_then_model_max_length_then_positions() {
        use PromptLimitSource::*;
        let l = |tokens, source| Some(PromptLimit { tokens, source });
        assert_eq!(
            resolve_prompt_limit(Some(5), Some(6), Some(7)),
            l(5, Override)
        );
        assert_eq!(
            resolve_prompt_limit(None, Some(6), Some(7)),
            l(6, ModelMaxLength)
        );
        assert_eq!(
            resolve_prompt_limit(None, None, Some(7)),
            l(7, MaxPositionEmbeddings)
        );
        assert_eq!(resolve_prompt_limit(None, None, None), None);
    }

    #[test]
    fn missing_tokenizer_names_the_path() {
        let dir = model_dir(&[("config.json", r#"{"max_position_embeddings": 8}"#)]);
        let err = load(dir.path()).unwrap_err();
        assert!(
            matches!(err, ModelDirError::MissingTokenizer { .. }),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .contains(&*dir.path().join("tokenizer.json").to_string_lossy()));
    }

    #[test]
    fn not_a_directory() {
        let err = load(Path::new("/nonexistent/model")).unwrap_err();
        assert!(matches!(err, ModelDirError::NotADirectory { .. }), "{err}");
    }

    #[test]
    fn bad_json_carries_serde_message_and_path() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", "{\"a\": "),
        ]);
        let err = load(dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ModelDirError::Json { .. }), "{err:?}");
        assert!(text.contains("tokenizer_config.json"), "{text}");
        assert!(text.contains("line 1"), "{text}");
    }

    #[test]
    fn sentinel_model_max_length_falls_through_to_config() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            (
                "tokenizer_config.json",
                r#"{"model_max_length": 1000000000000000019884624838656}"#,
            ),
            (
                "config.json",
                r#"{"text_config": {"max_position_embeddings": 32768}}"#,
            ),
        ]);
        let files = load(dir.path()).unwrap();
        assert_eq!(
            files.prompt_limit(),
            PromptLimit {
                tokens: 32768,
                source: PromptLimitSource::MaxPositionEmbeddings
            }
        );
    }

    #[test]
    fn no_limit_is_an_error_naming_all_sources() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", "{}"),
        ]);
        let text = load(dir.path()).unwrap_err().to_string();
        for needle in [
            "--max-prompt-tokens",
            "model_max_length",
            "max_position_embeddings",
            "config.json",
        ] {
            assert!(text.contains(needle), "{needle} missing in: {text}");
        }
        let files = ModelFiles::load("m", dir.path(), None, Some(100)).unwrap();
        assert_eq!(files.prompt_limit().tokens, 100);
        assert!(matches!(
            ModelFiles::load("m", dir.path(), None, Some(0)),
            Err(ModelDirError::ZeroPromptLimit { .. })
        ));
    }

    #[test]
    fn bad_limit_types_are_field_errors() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("config.json", r#"{"max_position_embeddings": "4096"}"#),
        ]);
        let text = load(dir.path()).unwrap_err().to_string();
        assert!(
            text.contains("config.json: `max_position_embeddings` must be a number"),
            "{text}"
        );
    }

    #[test]
    fn special_tokens_as_strings_or_added_token_objects() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            (
                "tokenizer_config.json",
                r#"{"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"},
                    "pad_token": null, "model_max_length": 2048}"#,
            ),
        ]);
        let files = load(dir.path()).unwrap();
        assert_eq!(files.special_tokens().get("bos_token").unwrap(), "<s>");
        assert_eq!(files.special_tokens().get("eos_token").unwrap(), "</s>");
        assert!(!files.special_tokens().contains_key("pad_token"));
        assert_eq!(
            files.prompt_limit().source,
            PromptLimitSource::ModelMaxLength
        );
    }

    #[test]
    fn no_template_loads_but_chat_fails_at_render() {
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("config.json", r#"{"max_position_embeddings": 8}"#),
        ]);
        let files = load(dir.path()).unwrap();
        assert!(files.chat_template().is_none());
        let msgs = vec![json!({"role": "user", "content": "hi"})];
        let err = files.render_chat(&ChatInput::new(&msgs, true)).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Missing { .. }));
        assert!(err.to_string().contains("--chat-template"), "{err}");
        assert_eq!(files.tokenizer().encode("hi", false).unwrap(), vec![2]);
    }

    #[test]
    fn named_templates_pick_default_or_fail_listing_names() {
        let config = json!({
            "model_max_length": 64,
            "bos_token": "<s>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages | length }}"}
            ]
        });
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", &config.to_string()),
        ]);
        let files = load(dir.path()).unwrap();
        let msgs = vec![json!({"role": "user", "content": "hi"})];
        assert_eq!(
            files.render_chat(&ChatInput::new(&msgs, false)).unwrap(),
            "<s>1"
        );

        let config =
            json!({"model_max_length": 64, "chat_template": [{"name": "rag", "template": "x"}]});
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", &config.to_string()),
        ]);
        let text = load(dir.path()).unwrap_err().to_string();
        assert!(
            text.contains("\"rag\"") && text.contains("default"),
            "{text}"
        );
    }

    #[test]
    fn template_precedence_override_then_jinja_file_then_config_then_processor() {
        let config = json!({"model_max_length": 64, "chat_template": "config"});
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", &config.to_string()),
            ("chat_template.jinja", "jinja file\n"),
            ("chat_template.json", r#"{"chat_template": "processor"}"#),
            ("override.jinja", "override"),
        ]);
        let render = |files: &ModelFiles| files.render_chat(&ChatInput::new(&[], false)).unwrap();
        let p = dir.path();
        assert_eq!(
            render(&ModelFiles::load("m", p, Some(&p.join("override.jinja")), None).unwrap()),
            "override"
        );
        // keep_trailing_newline is off, as in transformers.
        assert_eq!(render(&load(p).unwrap()), "jinja file");
        std::fs::remove_file(p.join("chat_template.jinja")).unwrap();
        assert_eq!(render(&load(p).unwrap()), "config");
        std::fs::write(
            p.join("tokenizer_config.json"),
            r#"{"model_max_length": 64}"#,
        )
        .unwrap();
        assert_eq!(render(&load(p).unwrap()), "processor");

        let err = ModelFiles::load("m", p, Some(&p.join("missing.jinja")), None).unwrap_err();
        assert!(
            matches!(err, ModelDirError::Read { .. }) && err.to_string().contains("missing.jinja")
        );
    }

    #[test]
    fn broken_template_fails_at_load_naming_the_file() {
        let config = json!({"model_max_length": 64, "chat_template": "{% if %}"});
        let dir = model_dir(&[
            ("tokenizer.json", TOKENIZER),
            ("tokenizer_config.json", &config.to_string()),
        ]);
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(
            err,
            ModelDirError::ChatTemplate(ChatTemplateError::Compile { .. })
        ));
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    }
}
