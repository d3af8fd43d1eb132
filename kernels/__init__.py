"""Triton kernels for the GPU path and pure-torch references for the CPU path.

Each op module holds `<op>_triton` (the launcher), `<op>_ref` (torch) and `<op>`, which
dispatches on the device of its tensors.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul
from kernels.paged_attention import paged_attention
from kernels.paged_decode_attention import paged_decode_attention
from kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_ref
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, build_rope_cache
from kernels.store_kv import store_kv

# Lets callers tell this package from the unrelated PyPI distribution named `kernels`.
NANOPIPE_KERNELS = True

__all__ = [
    "NANOPIPE_KERNELS",
    "add_rms_norm",
    "apply_rotary",
    "build_rope_cache",
    "paged_attention",
    "paged_decode_attention",
    "qk_norm_rope_store",
    "qk_norm_rope_store_ref",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
