"""vllm.v1.kv_cache_interface: the names the offloading events import (typing only here)."""


class KVCacheGroupSpec:
    pass


def get_kv_cache_spec_kind(spec):
    raise NotImplementedError("stub")


def get_kv_cache_spec_sliding_window(spec):
    raise NotImplementedError("stub")
