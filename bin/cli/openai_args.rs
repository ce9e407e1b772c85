//! The flags of the doors OpenAI requests come through (`frontend`, `epp`): the models
//! served, and who may call.

use super::renamed_env;
use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use kvrouter_openai::auth::MAX_KEYS_FILE_BYTES;
use kvrouter_openai::{Access, ApiKeys, Grants, ModelFiles, RankConvention};
use std::collections::HashMap;
use std::path::PathBuf;

/// The engines behind the router (how they take a data-parallel rank).
#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum EngineArg {
    Vllm,
    Sglang,
}

impl EngineArg {
    pub fn ranks(self) -> RankConvention {
        match self {
            Self::Vllm => RankConvention::Vllm,
            Self::Sglang => RankConvention::Sglang,
        }
    }
}

/// How a door routes what it takes.
#[derive(Args)]
pub struct DoorArgs {
    /// How the engines take a data-parallel rank: vllm (header X-data-parallel-rank) or
    /// sglang (the body's data_parallel_rank).
    #[arg(long, env = "KVROUTER_ENGINE", value_enum, default_value = "vllm")]
    pub engine: EngineArg,
    /// How long the router replicas may take to answer a route.
    #[arg(long, env = "KVROUTER_ROUTE_TIMEOUT_MS", default_value_t = 2000)]
    pub route_timeout_ms: u64,
    /// Largest request body accepted (larger: 413).
    #[arg(long, env = "KVROUTER_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
}

#[derive(Args)]
pub struct ModelArgs {
    /// A served model, NAME=MODEL_DIR (repeatable): NAME as the router and the engines know
    /// it; the directory holds tokenizer.json (and tokenizer_config.json for chat).
    #[arg(long = "model", env = renamed_env::env("KVROUTER_MODEL_DIRS"), value_delimiter = ',', required = true, value_parser = parse_pair)]
    pub models: Vec<(String, String)>,
    /// A LoRA adapter, ADAPTER=MODEL (repeatable): clients ask for it by the adapter's name.
    #[arg(long = "lora", env = renamed_env::env("KVROUTER_LORA_ADAPTERS"), value_delimiter = ',', value_parser = parse_pair)]
    pub loras: Vec<(String, String)>,
    /// A chat template file for every model, or NAME=FILE for one (repeatable), in place of
    /// the directory's.
    #[arg(
        long = "chat-template",
        env = "KVROUTER_CHAT_TEMPLATE",
        value_delimiter = ','
    )]
    pub chat_templates: Vec<String>,
    /// Longest prompt in tokens [default: the model's model_max_length or
    /// max_position_embeddings].
    #[arg(long, env = "KVROUTER_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,
}

#[derive(Args)]
pub struct AccessArgs {
    /// An API key clients must send as `Authorization: Bearer KEY` (at least 16 bytes; an
    /// empty key is refused). With --api-keys-file, one more key.
    #[arg(long, env = "KVROUTER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file of API keys: one a line, each optionally followed by its grants
    /// (routing-extension, overlap-header; comma-separated); `#` starts a comment.
    #[arg(long, env = "KVROUTER_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Let every caller use the `kvrouter` request extension (pin, allowed_workers,
    /// priority_jump, cost settings): for trusted clients only.
    #[arg(long, env = "KVROUTER_GRANT_ROUTING_EXTENSION")]
    pub grant_routing_extension: bool,
    /// Send every caller the x-kvrouter-* answer headers (worker, replica, cached blocks):
    /// for trusted clients only, since they reveal whether others' prompts are cached.
    #[arg(long, env = "KVROUTER_GRANT_OVERLAP_HEADER")]
    pub grant_overlap_header: bool,
}

fn read_keys_file(path: &std::path::Path) -> anyhow::Result<ApiKeys> {
    let text = kvrouter_admin::secret::read_file(path, MAX_KEYS_FILE_BYTES)?;
    Ok(ApiKeys::from_file(&text)?)
}

pub fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
            Ok((k.trim().to_string(), v.trim().to_string()))
        }
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

impl AccessArgs {
    /// The API keys and grants. An empty key or a keys file with none fails the start:
    /// neither may be read as "no authentication".
    pub fn access(&self) -> anyhow::Result<Access> {
        let flag = self
            .api_key
            .as_deref()
            .map(ApiKeys::from_flag)
            .transpose()
            .context("cannot use the API key (--api-key, KVROUTER_API_KEY)")?;
        let file = match &self.api_keys_file {
            None => None,
            Some(path) => Some(read_keys_file(path).with_context(|| {
                format!(
                    "cannot use the API keys file {} (--api-keys-file, KVROUTER_API_KEYS_FILE)",
                    path.display()
                )
            })?),
        };
        let keys = match (flag, file) {
            (Some(a), Some(b)) => Some(a.merge(b).context("cannot use the API keys")?),
            (a, b) => a.or(b),
        };
        let everyone = Grants {
            routing_extension: self.grant_routing_extension,
            overlap_header: self.grant_overlap_header,
        };
        match &keys {
            Some(k) => tracing::info!(
                keys = k.len(),
                keys_with_grants = k.with_grants(),
                granted_to_every_caller = %everyone,
                "API keys required"
            ),
            None => tracing::warn!(
                granted_to_every_caller = %everyone,
                "no API keys (--api-key, --api-keys-file): every caller is served"
            ),
        }
        Ok(Access::new(keys, everyone))
    }
}

impl ModelArgs {
    /// The LoRA adapters, adapter name → the model it applies to.
    pub fn loras(&self) -> HashMap<String, String> {
        self.loras.iter().cloned().collect()
    }

    /// Loads every model directory (before anything connects: a bad directory fails fast).
    pub fn load_models(&self) -> anyhow::Result<Vec<ModelFiles>> {
        let mut shared = None;
        let mut per_model = HashMap::new();
        for t in &self.chat_templates {
            match t.split_once('=') {
                Some((name, file)) => {
                    per_model.insert(name.to_string(), PathBuf::from(file));
                }
                None if shared.is_none() => shared = Some(PathBuf::from(t)),
                None => {
                    bail!("--chat-template: one file for every model at most (NAME=FILE for one)")
                }
            }
        }
        for name in per_model.keys() {
            if !self.models.iter().any(|(m, _)| m == name) {
                bail!("--chat-template {name}=...: no --model {name}=DIR");
            }
        }
        let mut out = Vec::new();
        for (name, dir) in &self.models {
            if out.iter().any(|m: &ModelFiles| m.name() == name) {
                bail!("--model {name} is given twice");
            }
            let template = per_model.get(name).or(shared.as_ref());
            let m = ModelFiles::load(
                name,
                std::path::Path::new(dir),
                template.map(PathBuf::as_path),
                self.max_prompt_tokens,
            )
            .with_context(|| format!("cannot load model {name} from {dir}"))?;
            tracing::info!(
                model = name,
                dir,
                max_prompt_tokens = m.prompt_limit().tokens,
                chat = m.chat_template().is_some(),
                "model loaded"
            );
            out.push(m);
        }
        Ok(out)
    }
}
