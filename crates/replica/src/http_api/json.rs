//! The JSON API's request and answer shapes and their mapping to and from the protocol's
//! types: plain functions, no I/O (docs/protocol.md, "JSON API for peer routers").

use super::errors::ApiError;
use crate::layouts::WorkerLayout;
use crate::rank_silence::Quiet;
use kvrouter_protocol::{
    DpRank, ErrorKind, Lease, Pin, PromptExtras, RouteOverrides, RouteRequest, WorkerId, WorkerKey,
};
use kvrouter_scheduler::KeyLoad;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Parses a JSON object body; the error names what is wrong and where (serde_json's
/// message): `malformed` for text that is not a JSON object, `invalid_request` for an
/// object of the wrong shape.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // serde would also take an array as a struct, its fields by position.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::new(
            ErrorKind::Malformed,
            "invalid JSON body: expected a JSON object ({...})",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        let kind = match e.classify() {
            serde_json::error::Category::Data => ErrorKind::InvalidRequest,
            _ => ErrorKind::Malformed,
        };
        ApiError::new(kind, format!("invalid JSON body: {e}"))
    })
}

fn yes() -> bool {
    true
}

/// `POST /v1/route`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteBody {
    pub model: String,
    pub tokens: Vec<u32>,
    /// Needed with `update_states` (made up when absent) to name the request later.
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub lora: Option<String>,
    #[serde(default)]
    pub allowed_workers: Option<Vec<WorkerId>>,
    #[serde(default)]
    pub excluded_workers: Option<Vec<WorkerId>>,
    /// `"WORKER"` (any of its ranks) or `"WORKER:RANK"`, as the CLI's `--pin`.
    #[serde(default)]
    pub pin: Option<String>,
    /// Count the request as load until it is freed (or its lease runs out).
    #[serde(default = "yes")]
    pub update_states: bool,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Per block, its extra keys (multimodal identifiers): see "Hashing".
    #[serde(default)]
    pub block_extras: Option<Vec<Vec<String>>>,
    /// This request's own cost settings.
    #[serde(default)]
    pub kvrouter: Option<KvrouterOverrides>,
    /// Seconds the request counts as having waited already if it must queue.
    #[serde(default)]
    pub priority_jump: f64,
    /// Output tokens expected: their blocks count as the worker's decode load from the start.
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    /// The booking's lease, 32 hexadecimal digits (made up when absent; the answer carries
    /// it either way).
    #[serde(default)]
    pub lease: Option<String>,
    /// Next-best workers wanted beside the choice (0 to 8; more count as 8).
    #[serde(default)]
    pub fallbacks: u8,
}

/// `kvrouter` in a route body: each `None` keeps the replica's setting.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvrouterOverrides {
    #[serde(default)]
    pub overlap_credit: Option<f64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub host_cache_hit_weight: Option<f64>,
    #[serde(default)]
    pub disk_cache_hit_weight: Option<f64>,
    #[serde(default)]
    pub shared_cache_hit_weight: Option<f64>,
}

/// `"WORKER"` or `"WORKER:RANK"`.
pub fn parse_pin(s: &str) -> Result<Pin, ApiError> {
    // "18446744073709551615:4294967295" with some room for spaces; a longer one is not
    // echoed back.
    const LONGEST_PIN: usize = 64;
    if s.len() > LONGEST_PIN {
        return Err(ApiError::invalid(format!(
            "pin is {} bytes long: expected \"WORKER\" or \"WORKER:RANK\"",
            s.len()
        )));
    }
    s.parse().map_err(|e| {
        ApiError::invalid(format!(
            "pin {s:?}: expected \"WORKER\" or \"WORKER:RANK\"; {e}"
        ))
    })
}

impl RouteBody {
    /// The protocol's route request; `new_id` names a request that updates state and came
    /// without an id.
    pub fn into_request(self, new_id: impl FnOnce() -> String) -> Result<RouteRequest, ApiError> {
        let pin = self.pin.as_deref().map(parse_pin).transpose()?;
        let overrides = self.kvrouter.map(|o| RouteOverrides {
            overlap_credit: o.overlap_credit,
            temperature: o.temperature,
            host_cache_hit_weight: o.host_cache_hit_weight,
            disk_cache_hit_weight: o.disk_cache_hit_weight,
            shared_cache_hit_weight: o.shared_cache_hit_weight,
        });
        if let Some((field, value)) = overrides.as_ref().and_then(RouteOverrides::invalid) {
            return Err(ApiError::invalid(format!(
                "kvrouter.{field} must be a finite number >= 0, got {value}"
            )));
        }
        let extras =
            (self.cache_salt.is_some() || self.block_extras.is_some()).then(|| PromptExtras {
                block_extras: self.block_extras.unwrap_or_default(),
                cache_salt: self.cache_salt,
            });
        let request_id = match self.request_id {
            Some(id) => id,
            None if self.update_states => new_id(),
            None => String::new(),
        };
        let lease = match self.lease.as_deref() {
            Some(hex) => parse_lease(hex)?,
            None if self.update_states => Lease::random(),
            None => Lease::NONE,
        };
        Ok(RouteRequest::new(self.model, self.tokens)
            .with_request_id(request_id)
            .with_update_states(self.update_states)
            .with_lora(self.lora)
            .with_allowed_workers(self.allowed_workers)
            .with_excluded_workers(self.excluded_workers.unwrap_or_default())
            .with_pin(pin)
            .with_extras(extras)
            .with_overrides(overrides)
            .with_priority_jump(self.priority_jump)
            .with_expected_output_tokens(self.expected_output_tokens)
            .with_lease(lease)
            .with_fallbacks(self.fallbacks))
    }
}

/// A lease as the JSON API writes it (32 hexadecimal digits).
pub fn parse_lease(hex: &str) -> Result<Lease, ApiError> {
    Lease::parse_hex(hex).map_err(|e| ApiError::invalid(format!("lease: {e}")))
}

/// The answer to `POST /v1/route` (also what `kvrouter route` prints).
pub use kvrouter_protocol::RouteAnswer;

/// `POST /v1/requests/{id}/prefill_done`, `.../free` and `.../output_block`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateBody {
    pub model: String,
    /// The `replica_id` of the route answer: another replica's is forwarded to it.
    #[serde(default)]
    pub replica_id: Option<String>,
    /// `output_block` only: the share of the request's output load still to count, 0 to 1.
    #[serde(default)]
    pub decay_fraction: Option<f64>,
    /// The `lease` of the route answer (needed unless the route was booked without one).
    #[serde(default)]
    pub lease: Option<String>,
}

/// The answer to `GET /v1/workers`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkersAnswer {
    pub models: Vec<ModelWorkers>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelWorkers {
    pub model: String,
    /// `null` until the first worker registers (or `--block-size` sets it).
    pub block_size: Option<u32>,
    pub workers: Vec<WorkerRank>,
}

/// One worker rank as this replica sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerRank {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub base_url: String,
    /// `null` for a rank the scheduler knows whose registration is gone (a moment's race).
    pub engine: Option<&'static str>,
    pub role: Option<&'static str>,
    /// In routing: registered, live, and its state fetched.
    pub live: bool,
    pub capacity_blocks: Option<u64>,
    /// The load this replica counts (with replica sync, its peers' requests too).
    pub active_requests: u64,
    pub active_blocks: u64,
    pub prefill_tokens: u64,
    /// From the rank's own load reports, when it sends them.
    pub reported_active_blocks: Option<u64>,
    pub reported_waiting_requests: Option<u64>,
    /// Blocks the index holds for the rank; `null` when this replica keeps no index
    /// (`--use-remote-indexer`).
    pub cached_blocks: Option<usize>,
    /// Sent requests without publishing KV events for `--events-silent-secs`: routing has
    /// no cache affinity for it. `null` when this replica follows no events (approximate
    /// mode, a remote indexer).
    pub events_silent: Option<bool>,
    /// Since its last KV event (since it joined when it published none); `null` as above.
    pub seconds_since_last_event: Option<f64>,
}

/// Every rank of the registered workers, and any other rank the scheduler knows, sorted by
/// worker and rank.
pub fn worker_ranks(
    layouts: &[(WorkerId, WorkerLayout, String)],
    loads: &[(WorkerKey, KeyLoad)],
    cached: impl Fn(WorkerKey) -> Option<usize>,
    quiet: impl Fn(WorkerKey) -> Option<Quiet>,
) -> Vec<WorkerRank> {
    let rank = |key: WorkerKey, layout: Option<(&WorkerLayout, &str)>| {
        let load = loads.iter().find(|(k, _)| *k == key).map(|(_, l)| l);
        let reported = load.and_then(|l| l.reported);
        WorkerRank {
            worker_id: key.worker_id,
            dp_rank: key.dp_rank,
            base_url: layout.map(|l| l.1.to_string()).unwrap_or_default(),
            engine: layout.map(|l| l.0.engine.as_str()),
            role: layout.map(|l| l.0.role.as_str()),
            live: load.is_some(),
            capacity_blocks: load.map(|l| l.capacity_blocks),
            active_requests: load.map_or(0, |l| l.active_requests),
            active_blocks: load.map_or(0, |l| l.active_blocks),
            prefill_tokens: load.map_or(0, |l| l.prefill_tokens),
            reported_active_blocks: reported.map(|r| r.active_blocks),
            reported_waiting_requests: reported.map(|r| r.waiting_requests),
            cached_blocks: cached(key),
            events_silent: quiet(key).map(|q| q.silent),
            seconds_since_last_event: quiet(key).map(|q| q.since_last_event.as_secs_f64()),
        }
    };
    let mut out: BTreeMap<(WorkerId, DpRank), WorkerRank> = BTreeMap::new();
    for (worker, layout, url) in layouts {
        let end = layout.dp_start_rank.saturating_add(layout.dp_size);
        for r in layout.dp_start_rank..end {
            let key = WorkerKey::new(*worker, r);
            out.insert((*worker, r), rank(key, Some((layout, url))));
        }
    }
    for (key, _) in loads {
        out.entry((key.worker_id, key.dp_rank))
            .or_insert_with(|| rank(*key, None));
    }
    out.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{EngineKind, RouteDecision, TierBlocks, WorkerRole};
    use kvrouter_scheduler::ReportedLoad;

    fn body(json: &str) -> Result<RouteBody, ApiError> {
        parse(json.as_bytes())
    }

    #[test]
    fn a_full_route_body_maps_to_the_protocol_request() {
        let b = body(
            r#"{"model":"m","tokens":[1,2,3],"request_id":"r1","lora":"l",
                "allowed_workers":[1,2],"excluded_workers":[3],"pin":"7:1",
                "update_states":false,"cache_salt":"s","block_extras":[["img"]],
                "kvrouter":{"overlap_credit":0.5,"temperature":0}}"#,
        )
        .unwrap();
        let r = b.into_request(|| unreachable!()).unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.request_id, "r1");
        assert_eq!(r.tokens, vec![1, 2, 3]);
        assert_eq!(r.lora.as_deref(), Some("l"));
        assert_eq!(r.allowed_workers, Some(vec![1, 2]));
        assert_eq!(r.excluded_workers, vec![3]);
        assert_eq!(
            r.pin,
            Some(Pin {
                worker_id: 7,
                dp_rank: Some(1)
            })
        );
        assert!(!r.update_states);
        let extras = r.extras.unwrap();
        assert_eq!(extras.cache_salt.as_deref(), Some("s"));
        assert_eq!(extras.block_extras, vec![vec!["img".to_string()]]);
        let o = r.overrides.unwrap();
        assert_eq!((o.overlap_credit, o.temperature), (Some(0.5), Some(0.0)));
    }

    #[test]
    fn a_minimal_body_updates_state_under_a_new_id() {
        let r = body(r#"{"model":"m","tokens":[5]}"#)
            .unwrap()
            .into_request(|| "new".into())
            .unwrap();
        assert!(r.update_states);
        assert_eq!(r.request_id, "new");
        assert!(r.extras.is_none() && r.overrides.is_none() && r.pin.is_none());
        assert!(r.excluded_workers.is_empty() && r.allowed_workers.is_none());
        // No state: no id is made up.
        let r = body(r#"{"model":"m","tokens":[5],"update_states":false}"#)
            .unwrap()
            .into_request(|| unreachable!())
            .unwrap();
        assert_eq!(r.request_id, "");
    }

    #[test]
    fn bad_bodies_are_refused_naming_what_is_wrong() {
        let err = |json: &str| body(json).unwrap_err();
        let cases = [
            (
                r#"{"model":"m","tokens":[1],"bogus":1}"#,
                ErrorKind::InvalidRequest,
                "unknown field `bogus`",
            ),
            (
                r#"{"tokens":[1]}"#,
                ErrorKind::InvalidRequest,
                "missing field `model`",
            ),
            (
                r#"{"model":"m"}"#,
                ErrorKind::InvalidRequest,
                "missing field `tokens`",
            ),
            (
                r#"{"model":"m","tokens":[-1]}"#,
                ErrorKind::InvalidRequest,
                "-1",
            ),
            (
                r#"{"model":"m","tokens":[4294967296]}"#,
                ErrorKind::InvalidRequest,
                "4294967296",
            ),
            (
                r#"{"model":"m","tokens":[1.5]}"#,
                ErrorKind::InvalidRequest,
                "1.5",
            ),
            (
                r#"{"model":"m","tokens":[1],"kvrouter":{"temp":1}}"#,
                ErrorKind::InvalidRequest,
                "unknown field `temp`",
            ),
            (
                r#"{"model":"m","tokens":[1],"kvrouter":{"temperature":1e999}}"#,
                ErrorKind::Malformed,
                "out of range",
            ),
            (
                r#"{"model":"m","tokens":[1],"pin":7}"#,
                ErrorKind::InvalidRequest,
                "expected a string",
            ),
            (r#"{"model":"m","tokens":"#, ErrorKind::Malformed, "EOF"),
            ("", ErrorKind::Malformed, "expected a JSON object"),
            (
                r#"["m",[1]]"#,
                ErrorKind::Malformed,
                "expected a JSON object",
            ),
            ("nul", ErrorKind::Malformed, "expected a JSON object"),
            ("{", ErrorKind::Malformed, "EOF"),
            (
                r#"{"model":"m","tokens":[1]} x"#,
                ErrorKind::Malformed,
                "trailing characters",
            ),
        ];
        for (json, kind, words) in cases {
            let e = err(json);
            assert_eq!((e.kind, e.status), (kind, 400), "{json}: {e:?}");
            assert!(
                e.message.contains(words),
                "{json}: {words:?} not in {:?}",
                e.message
            );
        }
        // Not UTF-8.
        let e = parse::<RouteBody>(b"{\"model\":\"\xff\",\"tokens\":[1]}").unwrap_err();
        assert_eq!(e.status, 400, "{e:?}");
    }

    #[test]
    fn overrides_and_pins_are_checked_before_routing() {
        let e = body(r#"{"model":"m","tokens":[1],"kvrouter":{"temperature":-1}}"#)
            .unwrap()
            .into_request(String::new)
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("kvrouter.temperature"), "{}", e.message);
        assert_eq!(
            parse_pin("7").unwrap(),
            Pin {
                worker_id: 7,
                dp_rank: None
            }
        );
        assert_eq!(
            parse_pin("18446744073709551615:4294967295").unwrap(),
            Pin {
                worker_id: u64::MAX,
                dp_rank: Some(u32::MAX)
            }
        );
        for bad in ["", "x", "7:", ":1", "7:1:2", "-1", "7:4294967296"] {
            let e = parse_pin(bad).unwrap_err();
            assert!(e.message.contains("WORKER:RANK"), "{bad}: {e:?}");
        }
    }

    #[test]
    fn update_bodies_need_a_model() {
        let b: UpdateBody = parse(br#"{"model":"m","replica_id":"r"}"#).unwrap();
        assert_eq!(
            (b.model.as_str(), b.replica_id.as_deref()),
            ("m", Some("r"))
        );
        let e = parse::<UpdateBody>(b"{}").unwrap_err();
        assert!(e.message.contains("missing field `model`"), "{e:?}");
        let e = parse::<UpdateBody>(br#"{"model":"m","x":1}"#).unwrap_err();
        assert!(e.message.contains("unknown field `x`"), "{e:?}");
    }

    #[test]
    fn the_route_answer_names_the_request_and_the_replica() {
        let d = RouteDecision {
            tier_overlap_blocks: TierBlocks {
                device: 3,
                host: 2,
                disk: 0,
                shared: 1,
            },
            worker_id: 7,
            dp_rank: 1,
            overlap_blocks: 3,
            replica_id: "r".into(),
            base_url: "http://w".into(),
            block_size: 16,
            lease: Lease::from_bits(0xab),
            fallbacks: vec![kvrouter_protocol::Fallback {
                worker_id: 8,
                dp_rank: 0,
                overlap_blocks: 1,
                base_url: "http://v".into(),
            }],
        };
        let json = serde_json::to_string(&RouteAnswer::new(d.clone(), "q")).unwrap();
        assert_eq!(
            json,
            concat!(
                r#"{"worker_id":7,"dp_rank":1,"overlap_blocks":3,"#,
                r#""tier_overlap_blocks":{"device":3,"host":2,"disk":0,"shared":1},"#,
                r#""base_url":"http://w","request_id":"q","replica_id":"r","block_size":16,"#,
                r#""lease":"000000000000000000000000000000ab","#,
                r#""fallbacks":[{"worker_id":8,"dp_rank":0,"overlap_blocks":1,"base_url":"http://v"}]}"#
            )
        );
        let unbooked = RouteDecision {
            lease: Lease::NONE,
            ..d
        };
        let answer = RouteAnswer::new(unbooked, "");
        assert_eq!((answer.request_id, answer.lease), (None, None));
    }

    #[test]
    fn worker_ranks_join_layouts_loads_and_the_index() {
        let layout = |dp_start_rank, dp_size| WorkerLayout {
            role: WorkerRole::Aggregated,
            dp_start_rank,
            dp_size,
            tp_size: 1,
            engine: EngineKind::Vllm,
        };
        let layouts = vec![(5, layout(2, 2), "http://w5".to_string())];
        let load = KeyLoad {
            active_blocks: 4,
            prefill_tokens: 10,
            active_requests: 1,
            capacity_blocks: 100,
            reported: Some(ReportedLoad {
                active_blocks: 6,
                waiting_requests: 2,
            }),
        };
        let loads = vec![
            (WorkerKey::new(5, 3), load),
            (WorkerKey::new(9, 0), KeyLoad::default()),
        ];
        let quiet = |k: WorkerKey| {
            (k.dp_rank == 3).then_some(Quiet {
                silent: true,
                since_last_event: std::time::Duration::from_secs(90),
                never_published: true,
            })
        };
        let ranks = worker_ranks(&layouts, &loads, |k| Some(k.dp_rank as usize), quiet);
        let keys: Vec<(u64, u32, bool)> = ranks
            .iter()
            .map(|r| (r.worker_id, r.dp_rank, r.live))
            .collect();
        assert_eq!(keys, vec![(5, 2, false), (5, 3, true), (9, 0, true)]);
        let r = &ranks[1];
        assert_eq!(
            (r.engine, r.role, r.base_url.as_str()),
            (Some("vllm"), Some("aggregated"), "http://w5")
        );
        assert_eq!(
            (r.active_requests, r.active_blocks, r.prefill_tokens),
            (1, 4, 10)
        );
        assert_eq!(
            (r.reported_active_blocks, r.reported_waiting_requests),
            (Some(6), Some(2))
        );
        assert_eq!((r.capacity_blocks, r.cached_blocks), (Some(100), Some(3)));
        assert_eq!(
            (r.events_silent, r.seconds_since_last_event),
            (Some(true), Some(90.0))
        );
        assert_eq!(ranks[0].events_silent, None);
        assert_eq!(
            (ranks[0].capacity_blocks, ranks[0].active_requests),
            (None, 0)
        );
        assert_eq!((ranks[2].engine, ranks[2].base_url.as_str()), (None, ""));
    }
}
