//! The mocker: its KV cache against a reference model, the fleet on a bus, disaggregation.

mod disagg;
mod fleet;
mod kv_cache_model;
