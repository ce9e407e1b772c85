//! `kvrouter route`: ask the replicas of a namespace for one routing decision.

use super::nats_args::NatsArgs;
use anyhow::Context;
use clap::Args;
use kvrouter_client::{new_request_id, KvRouterClient};
use kvrouter_protocol::{Pin, RouteRequest};
use serde_json::Value;
use std::time::Duration;

#[derive(Args)]
pub struct RouteArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Model name, as the workers register it.
    #[arg(long, env = "KVROUTER_MODEL")]
    pub model: String,
    /// Prompt token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, env = "KVROUTER_TOKENS", value_parser = parse_tokens)]
    pub tokens: TokenList,
    /// Request id (default: a fresh uuid).
    #[arg(long, env = "KVROUTER_REQUEST_ID")]
    pub request_id: Option<String>,
    /// LoRA adapter name.
    #[arg(long, env = "KVROUTER_LORA")]
    pub lora: Option<String>,
    /// Only these worker ids may be chosen (comma-separated).
    #[arg(long, env = "KVROUTER_ALLOWED_WORKERS", value_delimiter = ',', value_parser = super::parse_u64)]
    pub allowed_workers: Option<Vec<u64>>,
    /// Pin to a worker (WORKER) or to one rank of it (WORKER:RANK).
    #[arg(long, env = "KVROUTER_PIN", value_parser = parse_pin)]
    pub pin: Option<Pin>,
    /// Do not track the request as active load (no mark_prefill / free needed afterwards).
    #[arg(long, env = "KVROUTER_NO_UPDATE_STATES")]
    pub no_update_states: bool,
    #[command(flatten)]
    pub hints: RouteHints,
    /// How long to wait for the replica's answer, in milliseconds.
    #[arg(long, env = "KVROUTER_TIMEOUT_MS", default_value_t = 2000)]
    pub timeout_ms: u64,
    /// Disaggregated: pick a prefill worker rank and a decode worker rank (prints both).
    #[arg(long, env = "KVROUTER_DISAGG", conflicts_with = "pin")]
    pub disagg: bool,
}

/// Token ids from the command line (a newtype so clap does not split it into many values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenList(pub Vec<u32>);

/// Parses `1,2,3` (spaces allowed) into token ids.
pub fn parse_tokens(s: &str) -> Result<TokenList, String> {
    if s.trim().is_empty() {
        return Err("no tokens given: expected comma-separated token ids, e.g. 1,2,3".into());
    }
    s.split(',')
        .enumerate()
        .map(|(i, t)| {
            let t = t.trim();
            t.parse::<u32>().map_err(|_| {
                format!(
                    "token #{} {t:?} is not a token id (an integer 0..={}); expected e.g. 1,2,3",
                    i + 1,
                    u32::MAX
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(TokenList)
}

/// Parses `WORKER` or `WORKER:RANK`.
/// What a route request may tell the scheduler besides its prompt (`route`, `generate`).
#[derive(Args, Clone, Debug)]
pub struct RouteHints {
    /// Seconds the request counts as having waited already if the replica must queue it.
    #[arg(long, env = "KVROUTER_PRIORITY_JUMP", default_value_t = 0.0, value_parser = parse_priority_jump)]
    pub priority_jump: f64,
    /// Output tokens expected: their blocks count as the worker's decode load from the start.
    #[arg(long, env = "KVROUTER_EXPECTED_OUTPUT_TOKENS")]
    pub expected_output_tokens: Option<u32>,
}

fn parse_priority_jump(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds >= 0")),
    }
}

pub fn parse_pin(s: &str) -> Result<Pin, String> {
    s.parse()
        .map_err(|e| format!("bad --pin {s:?}: expected WORKER or WORKER:RANK; {e}"))
}

/// One JSON object with its keys in the given order.
pub fn json_line(fields: &[(&str, Value)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}:{v}", Value::from(*k)))
        .collect();
    format!("{{{}}}", body.join(","))
}

pub async fn run(args: RouteArgs) -> anyhow::Result<()> {
    let bus = args.nats.connect("kvrouter-route").await?;
    let client = KvRouterClient::new(bus, &args.nats.namespace)
        .context("bad --namespace")?
        .with_timeout(Duration::from_millis(args.timeout_ms.max(1)));
    if args.disagg {
        let req = kvrouter_protocol::DisaggRouteRequest {
            model: args.model,
            request_id: args.request_id.unwrap_or_else(new_request_id),
            tokens: args.tokens.0,
            lora: args.lora.filter(|l| !l.is_empty()),
            allowed_workers: args.allowed_workers,
            update_states: !args.no_update_states,
            lease: kvrouter_protocol::Lease::NONE, // the client makes one when booking
            trace: None,
        };
        let d = client.route_disagg(&req).await?;
        println!("{}", disagg_json(&req.request_id, &d));
        return Ok(());
    }
    let req = RouteRequest::new(args.model, args.tokens.0)
        .with_request_id(args.request_id.unwrap_or_else(new_request_id))
        .with_update_states(!args.no_update_states)
        .with_lora(args.lora.filter(|l| !l.is_empty()))
        .with_allowed_workers(args.allowed_workers)
        .with_pin(args.pin)
        .with_priority_jump(args.hints.priority_jump)
        .with_expected_output_tokens(args.hints.expected_output_tokens);
    let d = client.route(&req).await?;
    // The whole decision, as the replicas' JSON API answers /v1/route.
    let answer = kvrouter_protocol::RouteAnswer::new(d, &req.request_id);
    println!("{}", serde_json::to_string(&answer)?);
    Ok(())
}

/// A disaggregated decision as one JSON object: both worker keys.
pub fn disagg_json(request_id: &str, d: &kvrouter_protocol::DisaggDecision) -> String {
    let key = |r: &kvrouter_protocol::RouteDecision| {
        serde_json::json!({
            "worker_id": r.worker_id,
            "dp_rank": r.dp_rank,
            "overlap_blocks": r.overlap_blocks,
        })
    };
    json_line(&[
        ("request_id", request_id.into()),
        ("prefill", key(&d.prefill)),
        ("decode", key(&d.decode)),
        ("replica_id", d.replica_id.clone().into()),
        // Both halves are booked under one lease; null when nothing was booked.
        (
            "lease",
            (!d.decode.lease.is_none())
                .then(|| d.decode.lease.to_hex())
                .into(),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_parse() {
        assert_eq!(parse_tokens("1,2, 3").unwrap(), TokenList(vec![1, 2, 3]));
        assert!(parse_tokens("").is_err());
        let e = parse_tokens("1,x,3").unwrap_err();
        assert!(e.contains("#2") && e.contains("\"x\""), "{e}");
        assert!(parse_tokens("1,,2").is_err());
        assert!(parse_tokens("-1").is_err());
        assert!(parse_tokens("4294967296").is_err());
    }

    #[test]
    fn pins_parse() {
        assert_eq!(
            parse_pin("7").unwrap(),
            Pin {
                worker_id: 7,
                dp_rank: None
            }
        );
        assert_eq!(
            parse_pin("7:2").unwrap(),
            Pin {
                worker_id: 7,
                dp_rank: Some(2)
            }
        );
        assert!(parse_pin("7:").is_err());
        assert!(parse_pin("x:1").is_err());
        assert!(parse_pin("1:2:3").is_err());
    }

    #[test]
    fn disagg_json_names_both_keys() {
        let d = |w, r| kvrouter_protocol::RouteDecision {
            tier_overlap_blocks: kvrouter_protocol::TierBlocks::on_device(2),
            worker_id: w,
            dp_rank: r,
            overlap_blocks: 2,
            replica_id: "x".into(),
            base_url: String::new(),
            block_size: 16,
            lease: kvrouter_protocol::Lease::NONE,
            fallbacks: Vec::new(),
        };
        let s = disagg_json(
            "q",
            &kvrouter_protocol::DisaggDecision {
                prefill: d(1, 3),
                decode: d(2, 1),
                replica_id: "x".into(),
            },
        );
        assert_eq!(
            s,
            r#"{"request_id":"q","prefill":{"dp_rank":3,"overlap_blocks":2,"worker_id":1},"decode":{"dp_rank":1,"overlap_blocks":2,"worker_id":2},"replica_id":"x","lease":null}"#
        );
    }

    #[test]
    fn json_keeps_key_order() {
        let s = json_line(&[("b", 1.into()), ("a", "x\"y".into())]);
        assert_eq!(s, r#"{"b":1,"a":"x\"y"}"#);
    }
}
