"""vllm.v1.kv_offload.base (torch-free part): offload keys, media, the manager's events."""
from dataclasses import dataclass
from enum import Enum
from typing import Any, NewType

OffloadKey = NewType("OffloadKey", bytes)


def make_offload_key(block_hash, group_idx):
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big", signed=False))


def get_offload_block_hash(key):
    return key[:-4]


def get_offload_group_idx(key):
    return int.from_bytes(key[-4:], "big", signed=False)


class Medium(Enum):
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass
class OffloadingEvent:
    keys: list
    medium: Any  # Medium in 0.33; the medium's name in 0.26
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False


@dataclass
class OffloadingKVEventsConfig:
    enable_kv_cache_events: bool
    self_describing_kv_events: bool
