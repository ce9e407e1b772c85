//! The model's tokenizer, shared by every request.
//!
//! The router matches prompts by token blocks, so the ids here must be the engine's ids.
//! vLLM and SGLang tokenize with Hugging Face's `tokenizers` (through transformers); this
//! wraps the same library and applies the two call-time settings transformers applies: no
//! truncation or padding (whatever tokenizer.json says), and `add_special_tokens` chosen
//! per endpoint (see [`Tokenizer::encode`]).

use std::path::Path;
use std::sync::Arc;

/// A tokenizer operation failed inside the `tokenizers` library.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// tokenizer.json could not be parsed or holds an unsupported component.
    #[error("cannot load tokenizer from {path}: {message}")]
    Load { path: String, message: String },
    /// Encoding a text failed (rare: a model or normalizer error).
    #[error("cannot tokenize the prompt: {0}")]
    Encode(String),
    /// Decoding ids failed (e.g. an id outside the vocabulary).
    #[error("cannot decode token ids: {0}")]
    Decode(String),
}

/// A loaded tokenizer: cheap to clone (an `Arc`), `Send + Sync`, used from any thread.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl Tokenizer {
    /// Parses tokenizer.json bytes; `path` only names the source in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, TokenizerError> {
        let mut tok =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| TokenizerError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        // transformers calls no_truncation()/no_padding() on every encode that does not ask
        // for them; a truncation left in tokenizer.json would silently cut prompts here.
        tok.with_truncation(None)
            .map_err(|e| TokenizerError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?
            .with_padding(None);
        Ok(Self {
            inner: Arc::new(tok),
        })
    }

    /// Token ids of `text`.
    ///
    /// `add_special_tokens` runs the post-processor (e.g. prepends BOS). Use `true` for a
    /// completions prompt given as text (as vLLM does) and `false` for a rendered chat
    /// template, which already contains its special tokens (vLLM's chat path).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        // encode_fast skips character offsets, which the frontend never needs.
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text of `ids`, keeping special tokens (for tests and diagnostics).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The id of a token (special or not), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A word-level tokenizer written by hand: `<s>` prepended by the post-processor,
    /// whitespace pre-tokenizer, truncation to 2 tokens in the file.
    fn tokenizer() -> Tokenizer {
        let spec = json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "again": 4}, "unk_token": "<unk>"}
        });
        Tokenizer::from_bytes(spec.to_string().as_bytes(), Path::new("mem/tokenizer.json")).unwrap()
    }

    #[test]
    fn special_tokens_follow_the_flag() {
        let tok = tokenizer();
        assert_eq!(tok.encode("hello world", true).unwrap(), vec![0, 2, 3]);
        assert_eq!(tok.encode("hello world", false).unwrap(), vec![2, 3]);
        assert_eq!(tok.encode("<s>hello", false).unwrap(), vec![0, 2]);
        assert_eq!(tok.encode("bye", false).unwrap(), vec![1]);
    }

    #[test]
    fn truncation_in_the_file_is_ignored() {
        let tok = tokenizer();
        assert_eq!(
            tok.encode("hello world again hello", false).unwrap(),
            vec![2, 3, 4, 2]
        );
    }

    #[test]
    fn decode_and_lookup() {
        let tok = tokenizer();
        assert_eq!(tok.decode(&[0, 2, 3]).unwrap(), "<s> hello world");
        assert_eq!(tok.token_to_id("world"), Some(3));
        assert_eq!(tok.vocab_size(), 5);
    }

    #[test]
    fn bad_json_names_the_file() {
        let err = Tokenizer::from_bytes(b"{not json", Path::new("/m/tokenizer.json")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/m/tokenizer.json"), "{text}");
    }

    #[test]
    fn shared_across_threads() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Tokenizer>();
        let tok = tokenizer();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let tok = tok.clone();
                std::thread::spawn(move || tok.encode("hello again", true).unwrap())
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![0, 2, 4]);
        }
    }
}
