//! An engine's load, read from its Prometheus `/metrics` text: running and waiting requests
//! and KV cache usage, per data-parallel rank where the engine labels them.

use kvrouter_protocol::EngineKind;
use std::collections::BTreeMap;

/// One rank's load as the engine reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    pub running: f64,
    pub waiting: f64,
    /// Fraction of the KV cache in use, 0..=1 (absent if the engine does not say).
    pub cache_usage: Option<f64>,
}

struct Names {
    running: &'static str,
    waiting: &'static str,
    usage: &'static [&'static str],
    rank_label: &'static str,
}

fn names(kind: EngineKind) -> Names {
    match kind {
        EngineKind::Sglang => Names {
            running: "sglang:num_running_reqs",
            waiting: "sglang:num_queue_reqs",
            usage: &["sglang:token_usage"],
            rank_label: "dp_rank",
        },
        // The mocker's emulation speaks vLLM's names unless it emulates SGLang.
        EngineKind::Vllm | EngineKind::Mocker => Names {
            running: "vllm:num_requests_running",
            waiting: "vllm:num_requests_waiting",
            usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
            rank_label: "engine",
        },
    }
}

/// Loads by rank label (`None`: a series without one). Several series of one rank (other
/// labels) add up their requests and keep the highest usage. Lines that do not parse are
/// skipped: one odd metric must not hide the others.
pub fn parse_engine_metrics(kind: EngineKind, text: &str) -> BTreeMap<Option<u32>, EngineLoad> {
    let n = names(kind);
    let mut out: BTreeMap<Option<u32>, EngineLoad> = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        let which = if name == n.running {
            0
        } else if name == n.waiting {
            1
        } else if n.usage.contains(&name) {
            2
        } else {
            continue;
        };
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        let rank = label(labels, n.rank_label).and_then(|v| v.parse().ok());
        let load = out.entry(rank).or_default();
        match which {
            0 => load.running += value,
            1 => load.waiting += value,
            _ => {
                let v = value.min(1.0);
                load.cache_usage = Some(load.cache_usage.map_or(v, |u| u.max(v)));
            }
        }
    }
    out
}

/// `name{labels} value [timestamp]` → (name, labels without braces, value).
fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(i) => {
            let close = closing_brace(line, i)?;
            (&line[..i], &line[i + 1..close], &line[close + 1..])
        }
        None => {
            let i = line.find(char::is_whitespace)?;
            (&line[..i], "", &line[i..])
        }
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name.trim(), labels, value))
}

/// The `}` closing the label set opened at `open`, skipping quoted values.
fn closing_brace(line: &str, open: usize) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in line[open + 1..].char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_quotes => escaped = true,
            '"' => in_quotes = !in_quotes,
            '}' if !in_quotes => return Some(open + 1 + i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` (escapes are not undone: rank labels are plain numbers).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start();
        let after = after.strip_prefix('"')?;
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].trim_start().trim_start_matches(',');
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_per_engine_series() {
        let text = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m"} 9.0
"#;
        let m = parse_engine_metrics(EngineKind::Vllm, text);
        assert_eq!(
            m[&Some(0)],
            EngineLoad {
                running: 3.0,
                waiting: 7.0,
                cache_usage: Some(0.25)
            }
        );
        assert_eq!(m[&Some(1)].cache_usage, Some(0.5));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn sglang_names_and_unlabelled_series() {
        let text = "sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 2\n\
                    sglang:num_queue_reqs{model_name=\"m\"} 5 1712345678\n\
                    sglang:token_usage{model_name=\"m\"} 0.9\n\
                    vllm:num_requests_running 100\n";
        let m = parse_engine_metrics(EngineKind::Sglang, text);
        assert_eq!(
            m[&None],
            EngineLoad {
                running: 2.0,
                waiting: 5.0,
                cache_usage: Some(0.9)
            }
        );
        let m = parse_engine_metrics(EngineKind::Sglang, "sglang:num_queue_reqs{dp_rank=\"3\"} 4");
        assert_eq!(m[&Some(3)].waiting, 4.0);
    }

    #[test]
    fn odd_lines_are_skipped_not_fatal() {
        let text = "vllm:num_requests_waiting{engine=\"0\" 3\n\
                    vllm:num_requests_waiting{engine=\"0\",x=\"a}b\\\"c\"} NaN\n\
                    vllm:num_requests_waiting{engine=\"0\",x=\"a}b\"} -1\n\
                    vllm:num_requests_waiting{engine=\"0\",x=\"a}b\"} 4\n\
                    garbage\n{}\n";
        let m = parse_engine_metrics(EngineKind::Vllm, text);
        assert_eq!(m[&Some(0)].waiting, 4.0);
    }
}
