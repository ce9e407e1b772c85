"""KV event payloads as the engines encode them, for the bridge's decoding tests
(crates/bridge/tests/engine_wire): made with each pinned release's own classes (engines.py)
where a release sends that form, and with classes declared here field for field only for
forms no pinned release sends (vLLM's array_like era, v0.11-v0.23, and its first form; SGLang's
array form with a metadata map, between 0.5.3 and 0.5.23).

`python3 engine_wire.py cases` prints one JSON line per case: {"name", "release", "payload"}
with the payload in hex (`release` is "declared" for the forms declared here).
"""
import json
import os
import subprocess
import sys
from typing import Any, Optional, Union

import msgspec

ExternalBlockHash = Union[bytes, int]


# --- vLLM, array_like era (v0.11-v0.23): events as tagged arrays ---
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


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


ENC = msgspec.msgpack.Encoder()
BIG = 2**64 - 1  # needs msgpack uint64
T8 = list(range(1, 9))  # two blocks of 4 tokens
DIGEST_A = bytes(range(32))
DIGEST_B = bytes(range(32, 64))




def declared_cases():
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
    yield "vllm_oldest", OldEventBatch(
        ts=8.0, events=[OldBlockStored([51, 52], None, T8, 4, None)],
    )
    yield "sglang_array_metadata", SgEventBatch(
        ts=11.5,
        events=[SgBlockStored([-5], None, T8[:4], 4, None, "GPU"),
                SgBlockStoredWithMetadata([9], -5, T8[4:], 4, None, "GPU",
                                          metadata=SgBlockStoredMetadata("t"))],
        attn_dp_rank=1,
    )


def vllm_cases(release, kv):
    Stored, Removed = kv.BlockStored, kv.BlockRemoved
    newest = release == "vllm-0.33.0"

    def stored(hashes, parent, tokens, medium="GPU", lora_id=None, lora_name=None, **kw):
        return Stored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                      block_size=4, lora_id=lora_id, medium=medium, lora_name=lora_name, **kw)

    def batch(ts, events, rank=None):
        return kv.KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)

    if not newest:
        # 0.26's media for its storage tiers, gone in 0.33 (MEDIUM_STORAGE).
        yield "vllm26_media", batch(1.0, [
            stored([91], None, T8[:4], medium=kv.MEDIUM_FS),
            stored([92], None, T8[:4], medium=kv.MEDIUM_OBJ),
        ])
        return

    # A future release's event type, on the release's own base class.
    class BlockMoved(kv.KVCacheEvent):
        block_hashes: list[int]
        to: str

    yield "vllm_map", batch(1.5, [
        stored([BIG, 7], None, T8, extra_keys=[None, None], group_idx=0,
               kv_cache_spec_kind="full_attention"),
        Removed(block_hashes=[7], medium="GPU"),
        kv.AllBlocksCleared(),
    ], rank=0)
    yield "vllm_bytes", batch(3.0, [
        stored([DIGEST_A], None, T8[:4]),
        stored([DIGEST_B], DIGEST_A, T8[4:]),
        Removed(block_hashes=[DIGEST_B], medium="GPU"),
    ])
    yield "vllm_lora", batch(4.0, [
        stored([11, 12], None, T8, lora_id=3, lora_name="ad1", extra_keys=[("ad1",), ("ad1",)]),
    ])
    yield "vllm_lora_id_only", batch(4.5, [stored([13], None, T8[:4], lora_id=3)])
    yield "vllm_salt_mm", batch(5.0, [
        stored([21, 22], None, T8, extra_keys=[("img-abc", 2, "salt-1"), ("img-abc", -2)]),
    ])
    yield "vllm_cpu", batch(6.0, [
        stored([31], None, T8[:4], medium=kv.MEDIUM_CPU),
        Removed(block_hashes=[31], medium=kv.MEDIUM_CPU),
        stored([32], None, T8[:4], locality="REMOTE"),
        # offloaded as vLLM's connector reports it by default: the device copy first, then
        # a placeholder for the host copy (hash alone, block size 0), then the device copy goes
        stored([33], None, T8[:4]),
        Stored(block_hashes=[33], parent_block_hash=None, token_ids=[], block_size=0,
               lora_id=None, medium=kv.MEDIUM_CPU, lora_name=None, group_idx=0),
        Removed(block_hashes=[33], medium="GPU"),
        stored([34], None, T8[:4], medium="TAPE"),
        stored([35], None, T8[:4], medium=kv.MEDIUM_STORAGE),
    ])
    yield "vllm_groups", batch(7.0, [
        stored([41], None, T8[:4], group_idx=1, kv_cache_spec_kind="sliding_window",
               kv_cache_spec_sliding_window=128),
        Removed(block_hashes=[41], medium="GPU", group_idx=1),
        stored([42], None, T8[:4], group_idx=0, kv_cache_spec_kind="full_attention"),
    ])
    yield "unknown_then_good", batch(9.0, [
        BlockMoved(block_hashes=[61], to="CPU"),
        stored([62], None, T8[:4]),
    ])
    yield "block_size_other", batch(10.0, [
        Stored(block_hashes=[71], parent_block_hash=None, token_ids=T8, block_size=8,
               lora_id=None, medium="GPU", lora_name=None),
    ])
    yield "vllm_lookahead", batch(13.0, [
        stored([81, 82], None, T8, session_id="s-1", lookahead_token_ids=[[], [9, 10]]),
    ])


def sglang_cases(release, kv):
    if release == "sglang-0.5.3":
        yield "sglang_array", kv.KVEventBatch(ts=11.0, events=[
            kv.BlockStored(block_hashes=[-5], parent_block_hash=None, token_ids=T8[:4],
                           block_size=4, lora_id=None),
            kv.BlockStored(block_hashes=[9], parent_block_hash=-5, token_ids=T8[4:],
                           block_size=4, lora_id=None),
            kv.BlockRemoved(block_hashes=[9]),
        ], attn_dp_rank=1)
        return
    # SGLang names the salt on every run of a salted request, continuations included.
    yield "sglang_map", kv.KVEventBatch(ts=12.0, events=[
        kv.BlockStored(block_hashes=[-5], parent_block_hash=None, token_ids=T8[:4],
                       block_size=4, lora_id=None, medium=kv.StorageMedium.GPU.value,
                       cache_salt="t"),
        kv.BlockStored(block_hashes=[9], parent_block_hash=-5, token_ids=T8[4:],
                       block_size=4, lora_id=None, medium=kv.StorageMedium.GPU.value,
                       cache_salt="t", lora_name=None),
        # HiCache backs the root block up to host memory.
        kv.BlockStored(block_hashes=[-5], parent_block_hash=None, token_ids=T8[:4],
                       block_size=4, lora_id=None, medium=kv.StorageMedium.CPU.value,
                       cache_salt="t"),
    ], attn_dp_rank=0)


def print_cases(release, cases):
    for name, batch in cases:
        print(json.dumps({"name": name, "release": release, "payload": ENC.encode(batch).hex()}))


def main():
    args = sys.argv[1:]
    if args == ["cases"]:
        sys.stdout.flush()
        print_cases("declared", declared_cases())
        sys.stdout.flush()
        import engines
        # One process per release: two releases' modules share their names.
        for release in engines.PINNED:
            subprocess.run([sys.executable, os.path.abspath(__file__), "cases", release],
                           check=True)
    elif len(args) == 2 and args[0] == "cases":
        import engines
        kv, _ = engines.load(args[1])
        cases = vllm_cases if args[1].startswith("vllm") else sglang_cases
        print_cases(args[1], cases(args[1], kv))
    else:
        sys.exit("usage: engine_wire.py cases [RELEASE]")


if __name__ == "__main__":
    main()
