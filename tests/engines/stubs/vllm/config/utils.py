"""vllm.config.utils: its `config` decorator makes a dataclass (what KVEventsConfig needs)."""
from dataclasses import dataclass


def config(cls):
    return dataclass(cls)
