//! `kvrouter frontend`: an OpenAI-compatible HTTP server that tokenizes each request, asks
//! the router replicas where it should run and streams it from that engine.

use super::lifecycle::Lifecycle;
use super::nats_args::NatsArgs;
use super::renamed_env;
use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use kvrouter_client::KvRouterClient;
use kvrouter_frontend::{Frontend, FrontendConfig, FrontendServer, RankConvention};
use kvrouter_openai::auth::MAX_KEYS_FILE_BYTES;
use kvrouter_openai::{Access, ApiKeys, Grants, ModelFiles};
use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Copy, Clone, Debug, ValueEnum)]
enum EngineArg {
    Vllm,
    Sglang,
}

#[derive(Args)]
pub struct FrontendArgs {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    http: super::http_args::HttpArgs,
    /// Where clients connect.
    #[arg(long, env = "KVROUTER_LISTEN", default_value = "0.0.0.0:8000")]
    listen: SocketAddr,
    /// A served model, NAME=MODEL_DIR (repeatable): NAME as the router and the engines know
    /// it; the directory holds tokenizer.json (and tokenizer_config.json for chat).
    #[arg(long = "model", env = renamed_env::env("KVROUTER_MODEL_DIRS"), value_delimiter = ',', required = true, value_parser = parse_pair)]
    models: Vec<(String, String)>,
    /// A LoRA adapter, ADAPTER=MODEL (repeatable): clients ask for it by the adapter's name.
    #[arg(long = "lora", env = renamed_env::env("KVROUTER_LORA_ADAPTERS"), value_delimiter = ',', value_parser = parse_pair)]
    loras: Vec<(String, String)>,
    /// A chat template file for every model, or NAME=FILE for one (repeatable), in place of
    /// the directory's.
    #[arg(
        long = "chat-template",
        env = "KVROUTER_CHAT_TEMPLATE",
        value_delimiter = ','
    )]
    chat_templates: Vec<String>,
    /// Longest prompt in tokens [default: the model's model_max_length or
    /// max_position_embeddings].
    #[arg(long, env = "KVROUTER_MAX_PROMPT_TOKENS")]
    max_prompt_tokens: Option<usize>,
    /// Requests answered at once; more are refused with 503 and Retry-After.
    #[arg(long, env = "KVROUTER_MAX_INFLIGHT", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_inflight: u64,
    /// Longest a request may take, arrival to the answer's last byte.
    #[arg(long, env = renamed_env::env("KVROUTER_ENGINE_TIMEOUT_SECS"), default_value_t = 600.0)]
    request_timeout_secs: f64,
    /// Times a request is routed again around an engine that failed it before answering.
    #[arg(long, env = "KVROUTER_ROUTE_RETRIES", default_value_t = 2)]
    route_retries: u32,
    /// An API key clients must send as `Authorization: Bearer KEY` (at least 16 bytes; an
    /// empty key is refused). With --api-keys-file, one more key.
    #[arg(long, env = "KVROUTER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A file of API keys: one a line, each optionally followed by its grants
    /// (routing-extension, overlap-header; comma-separated); `#` starts a comment.
    #[arg(long, env = "KVROUTER_API_KEYS_FILE")]
    api_keys_file: Option<PathBuf>,
    /// Let every caller use the `kvrouter` request extension (pin, allowed_workers,
    /// priority_jump, cost settings): for trusted clients only.
    #[arg(long, env = "KVROUTER_GRANT_ROUTING_EXTENSION")]
    grant_routing_extension: bool,
    /// Send every caller the x-kvrouter-* answer headers (worker, replica, cached blocks):
    /// for trusted clients only, since they reveal whether others' prompts are cached.
    #[arg(long, env = "KVROUTER_GRANT_OVERLAP_HEADER")]
    grant_overlap_header: bool,
    /// How the engines take a data-parallel rank: vllm (header X-data-parallel-rank) or
    /// sglang (the body's data_parallel_rank).
    #[arg(long, env = "KVROUTER_ENGINE", value_enum, default_value = "vllm")]
    engine: EngineArg,
    /// How long the router replicas may take to answer a route.
    #[arg(long, env = "KVROUTER_ROUTE_TIMEOUT_MS", default_value_t = 2000)]
    route_timeout_ms: u64,
    /// Largest request body accepted.
    #[arg(long, env = "KVROUTER_MAX_BODY_BYTES", default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Request body bytes held at once over all client connections (read, not yet
    /// parsed); a body that finds them spent gets 503 with Retry-After.
    #[arg(long, env = "KVROUTER_MAX_BUFFERED_BODY_BYTES", default_value_t = 512 << 20)]
    max_buffered_body_bytes: usize,
    /// Seconds a shutdown may take: requests in flight finish within it.
    #[arg(long, env = "KVROUTER_DRAIN_TIMEOUT_SECS", default_value_t = 10.0)]
    drain_timeout_secs: f64,
}

fn read_keys_file(path: &std::path::Path) -> anyhow::Result<ApiKeys> {
    let text = kvrouter_admin::secret::read_file(path, MAX_KEYS_FILE_BYTES)?;
    Ok(ApiKeys::from_file(&text)?)
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
            Ok((k.trim().to_string(), v.trim().to_string()))
        }
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

impl FrontendArgs {
    fn config(&self) -> anyhow::Result<FrontendConfig> {
        Ok(FrontendConfig {
            max_inflight: self.max_inflight as usize,
            request_timeout: super::serve::secs("request-timeout-secs", self.request_timeout_secs)?,
            route_retries: self.route_retries,
            access: self.access()?,
            ranks: match self.engine {
                EngineArg::Vllm => RankConvention::Vllm,
                EngineArg::Sglang => RankConvention::Sglang,
            },
            max_body_bytes: self.max_body_bytes,
            http_limits: self.http.limits()?,
            max_buffered_body_bytes: self.max_buffered_body_bytes,
            ..FrontendConfig::default()
        })
    }

    /// The API keys and grants. An empty key or a keys file with none fails the start:
    /// neither may be read as "no authentication".
    fn access(&self) -> anyhow::Result<Access> {
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

    /// Loads every model directory (before anything connects: a bad directory fails fast).
    fn load_models(&self) -> anyhow::Result<Vec<ModelFiles>> {
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

pub async fn run(args: FrontendArgs) -> anyhow::Result<()> {
    renamed_env::log_warnings();
    let config = args.config()?;
    let models = args.load_models()?;
    let loras: HashMap<String, String> = args.loras.iter().cloned().collect();
    let drain_timeout = super::serve::secs("drain-timeout-secs", args.drain_timeout_secs)?;
    let mut life = Lifecycle::install("frontend", drain_timeout)?;
    let server = life
        .startup(async {
            let bus = args.nats.connect("kvrouter-frontend").await?;
            let client = KvRouterClient::new(bus, &args.nats.namespace)?
                .with_timeout(Duration::from_millis(args.route_timeout_ms.max(1)));
            let frontend =
                Frontend::new(models, loras, client, config).map_err(anyhow::Error::msg)?;
            FrontendServer::start(args.listen, frontend)
                .await
                .with_context(|| format!("cannot listen on {}", args.listen))
        })
        .await?;
    tracing::info!(listen = %server.addr, "frontend serving");
    {
        let line = serde_json::json!({ "listen": server.addr.to_string() });
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").context("cannot write to stdout")?;
        out.flush().context("cannot write to stdout")?;
    }
    life.wait().await;
    let drain_budget = life.drain_budget();
    life.shutdown(|| "finishing requests in flight".to_string(), async {
        server.shutdown_within(drain_budget).await;
        Ok(())
    })
    .await
}
