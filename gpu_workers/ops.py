"""The kernel ops the model uses, in one place (kernels/ dispatches Triton vs torch by device)."""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_attention, paged_attention_ref
from kernels.store_kv import store_kv, store_kv_ref

try:
    from kernels.paged_attention import paged_decode_attention
except ImportError:  # pragma: no cover - until the split-K decode kernel lands
    def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_k, scale):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention(q, k_cache, v_cache, block_tables, cu, seq_lens_k, scale)

try:
    from kernels.rms_norm import add_rms_norm, rms_norm
except ImportError:  # pragma: no cover
    def rms_norm(x, weight, eps):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight.float()).to(x.dtype)

    def add_rms_norm(x, residual, weight, eps):
        s = (x.float() + residual.float()).to(x.dtype)
        return rms_norm(s, weight, eps), s

try:
    from kernels.rotary import apply_rotary, build_rope_cache
except ImportError:  # pragma: no cover
    def build_rope_cache(head_dim, max_positions, theta, scaling, device, dtype=torch.float32):
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if scaling is not None:
            raise NotImplementedError("rope_scaling needs kernels.rotary")
        pos = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(pos, inv)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)

    def _rot(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def apply_rotary(q, k, positions, cos_sin):
        cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rot(q, cos, sin), _rot(k, cos, sin)

try:
    from kernels.activation import silu_and_mul
except ImportError:  # pragma: no cover
    def silu_and_mul(x):
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a.float()).to(x.dtype) * b

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
