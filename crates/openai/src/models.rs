//! What a request asks of the models served: the served model and LoRA adapter its `model`
//! names, its prompt's token ids as the engine will make them (chat template, tokenizer),
//! checked against the model's limits, and the route request for the replicas.

use crate::chat_template::ChatInput;
use crate::door_metrics::{DoorClock, DoorPhase};
use crate::error::ApiError;
use crate::model_dir::ModelFiles;
use crate::request::{ClientRequest, Endpoint, Input, Prompt};
use kvrouter_protocol::{PromptExtras, RouteRequest};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prompts longer than this are tokenized off the async threads.
const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

/// The `model` label of requests for a model that is not served: one label for every
/// unknown name, so clients cannot grow `/metrics`.
pub const UNKNOWN_MODEL_LABEL: &str = "_other";

/// How the engines behind the router take a data-parallel rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RankConvention {
    /// vLLM: the `X-data-parallel-rank` header.
    Vllm,
    /// SGLang: the body's `data_parallel_rank` (the header is sent too).
    Sglang,
}

/// The served models and the LoRA adapters that apply to them.
pub struct Models {
    models: HashMap<String, Arc<ModelFiles>>,
    /// LoRA adapter name → the served model it applies to.
    loras: HashMap<String, String>,
    /// The longest prompt a chat template may render.
    max_rendered_bytes: usize,
}

/// A request understood: its model, adapter and prompt tokens, within the model's limits.
pub struct Understood {
    pub model: Arc<ModelFiles>,
    pub lora: Option<String>,
    pub tokens: Vec<u32>,
}

impl Models {
    /// `max_body_bytes`: the largest request body taken; a chat template may render twice
    /// that and 1 MiB (templates add markup around what the client sent, they do not
    /// multiply it).
    pub fn new(
        models: Vec<ModelFiles>,
        loras: HashMap<String, String>,
        max_body_bytes: usize,
    ) -> Result<Self, String> {
        let models: HashMap<_, _> = models
            .into_iter()
            .map(|m| (m.name().to_string(), Arc::new(m)))
            .collect();
        for (adapter, base) in &loras {
            if !models.contains_key(base) {
                return Err(format!(
                    "LoRA adapter {adapter:?} names model {base:?}, which is not served (--model)"
                ));
            }
            if models.contains_key(adapter) {
                return Err(format!(
                    "LoRA adapter {adapter:?} has a served model's name"
                ));
            }
        }
        Ok(Self {
            models,
            loras,
            max_rendered_bytes: max_body_bytes.saturating_mul(2).saturating_add(1 << 20),
        })
    }

    /// Model names as clients may ask for them: served models, then LoRA adapters.
    pub fn names(&self) -> Vec<(&str, &ModelFiles)> {
        let mut out: Vec<_> = self
            .models
            .iter()
            .map(|(n, m)| (n.as_str(), &**m))
            .collect();
        out.sort_by_key(|(n, _)| *n);
        let mut adapters: Vec<_> = self
            .loras
            .iter()
            .filter_map(|(a, b)| Some((a.as_str(), &**self.models.get(b)?)))
            .collect();
        adapters.sort_by_key(|(n, _)| *n);
        out.extend(adapters);
        out
    }

    /// The metric label for a model as a client named it: the served model it resolves
    /// to, else [`UNKNOWN_MODEL_LABEL`].
    pub fn label_for(&self, name: &str) -> String {
        self.resolve(name).map_or_else(
            |_| UNKNOWN_MODEL_LABEL.to_string(),
            |(m, _)| m.name().to_string(),
        )
    }

    /// The served model and LoRA adapter a request names.
    pub fn resolve(&self, name: &str) -> Result<(Arc<ModelFiles>, Option<String>), ApiError> {
        if let Some(m) = self.models.get(name) {
            return Ok((m.clone(), None));
        }
        if let Some(m) = self.loras.get(name).and_then(|b| self.models.get(b)) {
            return Ok((m.clone(), Some(name.to_string())));
        }
        let names: Vec<&str> = self.names().into_iter().map(|(n, _)| n).collect();
        Err(ApiError::model_not_found(name, &names))
    }

    /// The request's model, adapter and prompt tokens, as the engine would make them, or
    /// why not (an unknown model, an empty prompt, one over the model's context). A chat
    /// template's render and a long text's encoding run on the blocking pool, not on the
    /// async threads. `clock` times the template and the tokenizer.
    pub async fn understand(
        &self,
        req: &ClientRequest,
        clock: &mut DoorClock,
    ) -> Result<Understood, ApiError> {
        let (model, lora) = self.resolve(&req.model)?;
        let timed = clock.is_on();
        let (tokens, template) =
            Self::tokenize(&model, req, self.max_rendered_bytes, timed).await?;
        clock.lap(DoorPhase::Tokenize);
        if let Some(t) = template {
            clock.split(DoorPhase::Tokenize, DoorPhase::Template, t);
        }
        if tokens.is_empty() {
            return Err(ApiError::invalid(
                Some("prompt"),
                "the prompt has no tokens",
            ));
        }
        if tokens.len() > model.prompt_limit().tokens {
            let param = match req.endpoint {
                Endpoint::Chat => "messages",
                Endpoint::Completions => "prompt",
            };
            return Err(ApiError::prompt_too_long(
                param,
                tokens.len(),
                model.prompt_limit().tokens,
            ));
        }
        Ok(Understood {
            model,
            lora,
            tokens,
        })
    }

    /// The prompt's tokens and, for a chat timed when `timed`, how long its template took.
    async fn tokenize(
        model: &Arc<ModelFiles>,
        req: &ClientRequest,
        max_rendered_bytes: usize,
        timed: bool,
    ) -> Result<(Vec<u32>, Option<Duration>), ApiError> {
        type Job = Box<dyn FnOnce() -> Result<(Vec<u32>, Option<Duration>), ApiError> + Send>;
        let job: Job = match &req.input {
            Input::Prompt(Prompt::Tokens(t)) => return Ok((t.clone(), None)),
            Input::Prompt(Prompt::Text(t)) => {
                let (model, text) = (model.clone(), t.clone());
                let job = move || Ok((encode(&model, &text, true)?, None));
                if t.len() <= INLINE_TOKENIZE_BYTES {
                    return job();
                }
                Box::new(job)
            }
            Input::Chat(c) => {
                let (model, c) = (model.clone(), c.clone());
                Box::new(move || {
                    let started = timed.then(Instant::now);
                    let input = ChatInput {
                        messages: &c.messages,
                        add_generation_prompt: c.add_generation_prompt,
                        tools: c.tools.as_deref(),
                        documents: c.documents.as_deref(),
                        extra: Some(&c.template_kwargs),
                        max_output_bytes: max_rendered_bytes,
                    };
                    let text = model
                        .render_chat(&input)
                        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
                    let template = started.map(|t| t.elapsed());
                    Ok((encode(&model, &text, false)?, template))
                })
            }
        };
        tokio::task::spawn_blocking(job)
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
    }
}

impl Understood {
    /// The booked route request for it under `route_id`, with the client's router hints
    /// (`kvrouter` extension) and cache salt; refused here with a 400 rather than by every
    /// replica it would be sent to.
    pub fn route_request(
        &self,
        req: &ClientRequest,
        route_id: &str,
    ) -> Result<RouteRequest, ApiError> {
        let route = RouteRequest::new(self.model.name(), self.tokens.clone())
            .booked(route_id.to_string())
            .with_lora(self.lora.clone())
            .with_allowed_workers(req.router.allowed_workers.clone())
            .with_pin(req.router.pin)
            .with_extras(req.cache_salt.as_ref().map(|s| PromptExtras {
                block_extras: Vec::new(),
                cache_salt: Some(s.clone()),
            }))
            .with_overrides(req.router.overrides)
            .with_priority_jump(req.router.priority_jump)
            .with_expected_output_tokens(req.router.expected_output_tokens);
        route
            .check_limits()
            .map_err(|e| ApiError::invalid(Some("kvrouter"), e.to_string()))?;
        Ok(route)
    }
}

fn encode(model: &ModelFiles, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    model
        .tokenizer()
        .encode(text, special)
        .map_err(|e| ApiError::invalid(Some("prompt"), format!("cannot tokenize the prompt: {e}")))
}
