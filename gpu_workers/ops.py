"""The kernel ops the model uses, in one place (kernels/ dispatches Triton vs torch by device)."""

from __future__ import annotations

import kernels

if not getattr(kernels, "NANOPIPE_KERNELS", False):
    # A PyPI distribution is also named `kernels` (transformers can pull it in); if it wins
    # the import, every op below would be missing or, worse, a different function.
    raise ImportError(
        f"'import kernels' found {getattr(kernels, '__file__', None) or kernels.__path__}, "
        "not nanopipe's kernels package: another package named 'kernels' shadows it. "
        "Uninstall it (pip uninstall kernels) or put nanopipe's directory first on sys.path."
    )

from kernels import (  # noqa: E402
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
from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.store_kv import store_kv_ref

__all__ = [
    "add_rms_norm",
    "apply_rotary",
    "build_rope_cache",
    "paged_attention",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "store_kv_ref",
]
