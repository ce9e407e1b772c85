"""KV event payloads made as vLLM and SGLang make them: msgspec classes declared field for
field as in vllm/distributed/kv_events.py (both the array_like era and the map era) and
sglang/srt/disaggregation/kv_events.py, encoded with msgspec's msgpack encoder.

`python3 engine_wire.py cases` prints one JSON line per case: {"name", "payload"} with the
payload in hex. The Rust tests decode them and check every field.
"""
import json
import sys
from typing import Any, Optional, Union

import msgspec

ExternalBlockHash = Union[bytes, int]


# --- vLLM, current (events as tagged maps since vLLM #42892; the batch stays an array) ---
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[list[int]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# A class the router does not know (a future engine's event type).
class BlockMoved(KVCacheEvent):
    block_hashes: list[int]
    to: str


# --- vLLM, array_like era (v0.11-v0.23): the same fields, events as tagged arrays ---
class ArrKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrBlockStored(ArrKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class ArrBlockRemoved(ArrKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class ArrAllBlocksCleared(ArrKVCacheEvent, tag="AllBlocksCleared"):
    pass


# --- vLLM, first version (#16750): two-field batch, five-field BlockStored ---
class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldBlockStored(ArrKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


# --- SGLang, array form: `attn_dp_rank`, a metadata map where vLLM has lora_name ---
class SgEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SgKVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SgBlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SgBlockStored(SgKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SgBlockStoredWithMetadata(SgBlockStored, tag="BlockStored", kw_only=True):
    metadata: SgBlockStoredMetadata


class SgBlockRemoved(SgKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


# --- SGLang, map form (#37482): cache_salt a field of BlockStored ---
class SgMapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SgMapBlockStored(SgMapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None


ENC = msgspec.msgpack.Encoder()
BIG = 2**64 - 1  # needs msgpack uint64
T8 = list(range(1, 9))  # two blocks of 4 tokens
DIGEST_A = bytes(range(32))
DIGEST_B = bytes(range(32, 64))


def cases():
    yield "vllm_map", KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([BIG, 7], None, T8, 4, None, "GPU", None, extra_keys=[None, None],
                        group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    yield "vllm_array", EventBatch(
        ts=2.0,
        events=[
            ArrBlockStored([BIG, 7], None, T8, 4, None, "GPU", None, extra_keys=None,
                           group_idx=0, kv_cache_spec_kind="full_attention"),
            ArrBlockRemoved([7], "GPU"),
            ArrAllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    yield "vllm_bytes", KVEventBatch(
        ts=3.0,
        events=[
            BlockStored([DIGEST_A], None, T8[:4], 4, None, "GPU", None),
            BlockStored([DIGEST_B], DIGEST_A, T8[4:], 4, None, "GPU", None),
            BlockRemoved([DIGEST_B], "GPU"),
        ],
    )
    yield "vllm_lora", KVEventBatch(
        ts=4.0,
        events=[BlockStored([11, 12], None, T8, 4, 3, "GPU", "ad1",
                            extra_keys=[("ad1",), ("ad1",)])],
    )
    yield "vllm_lora_id_only", KVEventBatch(
        ts=4.5, events=[BlockStored([13], None, T8[:4], 4, 3, "GPU", None)],
    )
    yield "vllm_salt_mm", KVEventBatch(
        ts=5.0,
        events=[BlockStored([21, 22], None, T8, 4, None, "GPU", None,
                            extra_keys=[("img-abc", 2, "salt-1"), ("img-abc", -2)])],
    )
    yield "vllm_cpu", KVEventBatch(
        ts=6.0,
        events=[BlockStored([31], None, T8[:4], 4, None, "CPU", None),
                BlockRemoved([31], "CPU"),
                BlockStored([32], None, T8[:4], 4, None, "GPU", None, locality="REMOTE"),
                # offloaded as vLLM's connector reports it: the device copy first, then the
                # host copy by hash alone (no tokens), then the device copy goes
                BlockStored([33], None, T8[:4], 4, None, "GPU", None),
                BlockStored([33], None, [], 4, None, "CPU_PINNED", None),
                BlockRemoved([33], "GPU"),
                BlockStored([34], None, T8[:4], 4, None, "TAPE", None)],
    )
    yield "vllm_groups", KVEventBatch(
        ts=7.0,
        events=[BlockStored([41], None, T8[:4], 4, None, "GPU", None, group_idx=1,
                            kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128),
                BlockRemoved([41], "GPU", group_idx=1),
                BlockStored([42], None, T8[:4], 4, None, "GPU", None, group_idx=0,
                            kv_cache_spec_kind="full_attention")],
    )
    yield "vllm_oldest", OldEventBatch(
        ts=8.0, events=[OldBlockStored([51, 52], None, T8, 4, None)],
    )
    yield "unknown_then_good", KVEventBatch(
        ts=9.0,
        events=[BlockMoved([61], "CPU"),
                BlockStored([62], None, T8[:4], 4, None, "GPU", None)],
    )
    yield "block_size_other", KVEventBatch(
        ts=10.0, events=[BlockStored([71], None, T8, 8, None, "GPU", None)],
    )
    yield "vllm_lookahead", KVEventBatch(
        ts=13.0,
        events=[BlockStored([81, 82], None, T8, 4, None, "GPU", None,
                            session_id="s-1", lookahead_token_ids=[[], [9, 10]])],
    )
    yield "sglang_array", SgEventBatch(
        ts=11.0,
        events=[SgBlockStored([-5], None, T8[:4], 4, None, "GPU"),
                SgBlockStoredWithMetadata([9], -5, T8[4:], 4, None, "GPU",
                                          metadata=SgBlockStoredMetadata("t")),
                SgBlockRemoved([9], "GPU")],
        attn_dp_rank=1,
    )
    yield "sglang_map", SgEventBatch(
        ts=12.0,
        events=[SgMapBlockStored([-5], None, T8[:4], 4, None, "GPU", cache_salt="t")],
        attn_dp_rank=0,
    )


def main():
    if sys.argv[1:] == ["cases"]:
        for name, batch in cases():
            print(json.dumps({"name": name, "payload": ENC.encode(batch).hex()}))
    else:
        sys.exit("usage: engine_wire.py cases")


if __name__ == "__main__":
    main()
