//! The cost flags: how a replica weighs cached blocks against load. One group, flattened
//! into `serve` and `bench replay`, so a replay measures exactly what a replica would run.

use clap::Args;
use kvrouter_scheduler::SchedulerConfig;

#[derive(Args, Clone, Debug)]
pub struct CostArgs {
    /// Prefill blocks one cached block saves in the cost.
    #[arg(long, env = "KVROUTER_OVERLAP_CREDIT", default_value_t = 1.0)]
    pub overlap_credit: f64,
    /// Prefill blocks one block cached in a worker's host memory saves (a transfer, not a
    /// prefill).
    #[arg(long, env = "KVROUTER_HOST_CACHE_HIT_WEIGHT",
          default_value_t = kvrouter_scheduler::DEFAULT_HOST_CACHE_HIT_WEIGHT)]
    pub host_cache_hit_weight: f64,
    /// Prefill blocks one block cached on a worker's disk saves.
    #[arg(long, env = "KVROUTER_DISK_CACHE_HIT_WEIGHT",
          default_value_t = kvrouter_scheduler::DEFAULT_DISK_CACHE_HIT_WEIGHT)]
    pub disk_cache_hit_weight: f64,
    /// Prefill blocks one block in shared storage (any worker of the model can load it)
    /// saves.
    #[arg(long, env = "KVROUTER_SHARED_CACHE_HIT_WEIGHT",
          default_value_t = kvrouter_scheduler::DEFAULT_SHARED_CACHE_HIT_WEIGHT)]
    pub shared_cache_hit_weight: f64,
    /// Weight of prefill blocks against decode blocks in the cost.
    #[arg(long, env = "KVROUTER_PREFILL_LOAD_SCALE",
          default_value_t = kvrouter_scheduler::DEFAULT_PREFILL_LOAD_SCALE)]
    pub prefill_load_scale: f64,
    /// Predicted blocks: prefill blocks saved per leading prompt block that belongs to a
    /// request active on the worker but is not in the index yet (its prefill under way, or
    /// its KV events on their way); lasts while that request is active. 0: off.
    #[arg(long, env = "KVROUTER_ACTIVE_PREFIX_CREDIT",
          default_value_t = kvrouter_scheduler::DEFAULT_ACTIVE_PREFIX_CREDIT)]
    pub active_prefix_credit: f64,
    /// In-flight prefill tokens on a worker rank past this many no longer count against it
    /// in the cost: once every candidate has seconds of prefill queued, the cached prefix
    /// decides, not the slightly shorter backlog. 0: no cap.
    #[arg(long, env = "KVROUTER_PREFILL_QUEUE_CAP_TOKENS",
          default_value_t = kvrouter_scheduler::DEFAULT_PREFILL_QUEUE_CAP_TOKENS)]
    pub prefill_queue_cap_tokens: u64,
    /// 0: lowest cost wins; > 0: sample with probability ∝ exp(-(cost/max cost)/T).
    #[arg(long, env = "KVROUTER_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub router_temperature: f64,
}

impl CostArgs {
    /// Sets the cost fields of `config`, leaving the rest as they are.
    pub fn apply(&self, config: SchedulerConfig) -> SchedulerConfig {
        SchedulerConfig {
            overlap_credit: self.overlap_credit,
            host_cache_hit_weight: self.host_cache_hit_weight,
            disk_cache_hit_weight: self.disk_cache_hit_weight,
            shared_cache_hit_weight: self.shared_cache_hit_weight,
            prefill_load_scale: self.prefill_load_scale,
            active_prefix_credit: self.active_prefix_credit,
            prefill_queue_cap_tokens: self.prefill_queue_cap_tokens,
            temperature: self.router_temperature,
            ..config
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        cost: CostArgs,
    }

    #[test]
    fn defaults_are_the_schedulers_and_every_weight_reaches_the_config() {
        let d = Cmd::parse_from(["x"])
            .cost
            .apply(SchedulerConfig::default());
        let s = SchedulerConfig::default();
        assert_eq!(d.host_cache_hit_weight, s.host_cache_hit_weight);
        assert_eq!(d.shared_cache_hit_weight, s.shared_cache_hit_weight);
        assert_eq!(d.prefill_load_scale, s.prefill_load_scale);
        assert_eq!(d.prefill_queue_cap_tokens, s.prefill_queue_cap_tokens);
        let c = Cmd::parse_from([
            "x",
            "--overlap-credit=2",
            "--host-cache-hit-weight=0.5",
            "--disk-cache-hit-weight=0.125",
            "--shared-cache-hit-weight=0.0625",
            "--prefill-load-scale=7",
            "--active-prefix-credit=0.25",
            "--prefill-queue-cap-tokens=99",
            "--router-temperature=0.5",
        ])
        .cost
        .apply(SchedulerConfig {
            max_queued_requests: 3,
            ..SchedulerConfig::default()
        });
        assert_eq!(
            (
                c.overlap_credit,
                c.host_cache_hit_weight,
                c.disk_cache_hit_weight
            ),
            (2.0, 0.5, 0.125)
        );
        assert_eq!(
            (
                c.shared_cache_hit_weight,
                c.prefill_load_scale,
                c.active_prefix_credit
            ),
            (0.0625, 7.0, 0.25)
        );
        assert_eq!((c.prefill_queue_cap_tokens, c.temperature), (99, 0.5));
        assert_eq!(c.max_queued_requests, 3, "the rest is left as it was");
    }
}
