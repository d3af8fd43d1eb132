"""Rotary position embeddings, rotate-half (GPT-NeoX) style as HF Llama/Qwen3 apply them.

The cache row for position p is [cos(p * inv_freq), sin(p * inv_freq)], each head_dim/2
wide; inv_freq follows transformers' rope init functions ("default", "linear", "llama3").
"""

from __future__ import annotations

import math

import torch

from kernels._common import (
    FLOAT_DTYPES,
    check,
    check_same_device,
    jit,
    next_pow2,
    require_triton,
    tl,
    use_triton,
)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def build_rope_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> cos_sin [max_positions, head_dim]: first half cos, second half sin."""
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    inv_freq = _inv_freq(head_dim, theta, scaling)
    # Computed in fp32 on the CPU, as HF does at load time, then moved.
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)


@jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cos_sin_ptr, num_heads,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = h < num_heads
    dt = x_ptr.dtype.element_ty
    # cos/sin are rounded to the activation dtype first, like HF's cos.to(x.dtype).
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d).to(dt).to(tl.float32)[None, :]
    x_row = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + t * stride_ot + h * stride_oh
    tl.store(o_row + d[None, :], (x1 * cos - x2 * sin).to(dt), mask=mask)
    tl.store(o_row + HALF + d[None, :], (x2 * cos + x1 * sin).to(dt), mask=mask)


def _check(q, k, positions, cos_sin) -> None:
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, D]")
    check(q.shape[0] == k.shape[0] == positions.shape[0] and positions.dim() == 1,
          f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} "
          "disagree on T")
    check(q.shape[2] == k.shape[2] == cos_sin.shape[1],
          f"head_dim of q/k/cos_sin differ: {q.shape[2]}, {k.shape[2]}, {cos_sin.shape[1]}")
    check(q.dtype in FLOAT_DTYPES and k.dtype == q.dtype, "q and k need one float dtype")
    check(positions.dtype in (torch.int32, torch.int64), "positions must be int32/int64")


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton()
    _check(q, k, positions, cos_sin)
    check_same_device(q=q, k=k, positions=positions, cos_sin=cos_sin)
    head_dim = q.shape[2]
    check(head_dim // 2 == next_pow2(head_dim // 2), "head_dim / 2 must be a power of two")
    check(q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.stride(1) == 1,
          "q, k and cos_sin must be contiguous in head_dim")
    check(positions.is_contiguous(), "positions must be contiguous")
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.shape[0] > 0:
            _rotary_kernel[(x.shape[0],)](
                x, out, positions, cos_sin, x.shape[1],
                x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
                HALF=head_dim // 2, BLOCK_H=next_pow2(x.shape[1]), num_warps=4,
            )
        outs.append(out)
    return outs[0], outs[1]


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, positions, cos_sin)
    half = q.shape[2] // 2
    rows = cos_sin[positions.long()].to(q.dtype)
    cos, sin = rows[:, None, :half], rows[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # Same operations and roundings as HF: x * cos + rotate_half(x) * sin.
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated (q, k), new tensors."""
    if use_triton(q, k):
        return apply_rotary_triton(q, k, positions, cos_sin)
    return apply_rotary_ref(q, k, positions, cos_sin)
