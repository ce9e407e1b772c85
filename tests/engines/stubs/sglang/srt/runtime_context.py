"""sglang.srt.runtime_context: one process, every parallel rank 0."""
from types import SimpleNamespace


def get_parallel():
    return SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)
