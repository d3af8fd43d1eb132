"""The kernel ops the model uses, in one place (kernels/ dispatches Triton vs torch by device)."""

from __future__ import annotations

from kernels import (
    add_rms_norm,
    apply_rotary,
    build_rope_cache,
    paged_attention,
    paged_decode_attention,
    rms_norm,
    silu_and_mul,
    store_kv,
)
from kernels.paged_attention import paged_attention_ref
from kernels.store_kv import store_kv_ref

__all__ = [
    "add_rms_norm",
    "apply_rotary",
    "build_rope_cache",
    "paged_attention",
    "paged_attention_ref",
    "paged_decode_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "store_kv_ref",
]
