"""Scatter this step's K/V into the paged cache (slot = block * block_size + offset).

An fp8 cache stores k / k_scale and v / v_scale, saturated to +-448 (kernels/kv_quant.py);
a cache in the model's dtype stores k and v as they are and ignores the scales.
"""

from __future__ import annotations

import torch

from kernels._common import (
    check,
    check_index_dtype,
    check_same_device,
    jit,
    next_pow2,
    require_triton,
    tl,
    use_triton,
)
from kernels.kv_quant import is_fp8, quantize


@jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < num_kv_heads
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:  # saturate: a cast past 448 would give NaN
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, k.to(kc.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc.dtype.element_ty), mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    check(k.dim() == 3 and v.shape == k.shape, f"k, v must be [T, Hkv, D] alike, got "
          f"{tuple(k.shape)} and {tuple(v.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          "k_cache, v_cache must be [num_blocks, block_size, Hkv, D] alike, got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check(tuple(k_cache.shape[2:]) == tuple(k.shape[1:]),
          f"cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {tuple(k.shape[1:])}")
    check(slot_mapping.shape == (k.shape[0],),
          f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_index_dtype("slot_mapping", slot_mapping)
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    require_triton()
    _check(k, v, k_cache, v_cache, slot_mapping)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    head_dim = k.shape[2]
    check(head_dim == next_pow2(head_dim), f"head_dim must be a power of two, got {head_dim}")
    block_size = k_cache.shape[1]
    check(block_size == next_pow2(block_size),
          f"block_size must be a power of two, got {block_size}")
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k.shape[1], BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_H=next_pow2(k.shape[1]),
        FP8=is_fp8(k_cache.dtype),
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _check(k, v, k_cache, v_cache, slot_mapping)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_blocks, block_size, hkv, d = k_cache.shape
    blk, off = slots // block_size, slots % block_size
    # Advanced indexing writes through any cache strides (no flattening view needed).
    k_cache[blk, off] = quantize(k[valid], k_scale, k_cache.dtype)
    v_cache[blk, off] = quantize(v[valid], v_scale, v_cache.dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v rows into their cache slots in place; slot -1 means skip (padding)."""
    if use_triton(k, k_cache):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
