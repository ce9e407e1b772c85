"""vllm.v1.core.kv_cache_utils: block hash types and the conversions the events use."""
import os
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
ExternalBlockHash = bytes | int


def maybe_convert_block_hash(hash_bytes):
    # vllm.envs: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default 1.
    if not int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")):
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


def resolve_block_hashes(block_hashes, hash_block_size, block_size, **_):
    # The drivers hash at the block size, where vLLM reuses the hashes as they are.
    assert hash_block_size == block_size, "stub: only equal hash and block sizes"
    return block_hashes


def to_event_extra_keys(extra_keys):
    return None if extra_keys is None else list(extra_keys)
