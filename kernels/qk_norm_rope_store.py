"""Everything between the QKV projection and attention, in one kernel.

From the packed projection output [T, (H + 2 Hkv) * D] it RMS-normalises each head of q and k
(Qwen3's q_norm/k_norm; skipped for Llama/Qwen2), rotates q and k at each token's position,
writes q to the attention input [T, H, D] and k, v into their paged cache slots. Unfused this
is two strided copies, two norms, two rotary launches and store_kv per layer; the reference
below is exactly that sequence (the CPU path and the tests use it).

One program per token handles all of its heads: the position, the rotary row and the cache
slot are read once per token, before waiting for the projection (PDL). On an H200
(`nanopipe bench kernels --only small`, Qwen3-0.6B heads, per call in a CUDA graph) that took
a 4,096-token prefill chunk from 119.0 to 22.6 us and 170 decode tokens from 5.2 to 2.1 us,
against one program per (token, head) before.

An fp8 cache gets k / k_scale and v / v_scale saturated to +-448, as store_kv writes them.
"""

from __future__ import annotations

import torch

from kernels._common import (
    FLOAT_DTYPES,
    check,
    check_index_dtype,
    check_same_device,
    jit,
    launch_pdl,
    next_pow2,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
    use_triton,
)
from kernels.kv_quant import is_fp8
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref
from kernels.store_kv import store_kv_ref


@jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr, eps, num_heads, num_kv_heads, k_scale, v_scale,
    stride_qkv, stride_qt, stride_qh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROWS: tl.constexpr, KV_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr,
):
    # One program per token, all its heads at once: rows 0..H-1 are q's heads and H..H+Hkv-1
    # k's (the packed layout puts k's heads right after q's, so head h starts at column h * D),
    # so the token's position, rotary row and cache slot are loaded once, not once per head.
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS)
    row_ok = r < num_heads + num_kv_heads
    is_q = r < num_heads
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    tile_ok = row_ok[:, None] & dmask[None, :]
    dt = q_out_ptr.dtype.element_ty
    # Read before the wait: positions and slots come with the step's input copy, which precedes
    # the embedding and the QKV projection, and a kernel launched early starts only once the
    # one before it has passed its own wait, so whatever ran two kernels back is done.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # cos/sin are rounded to the activation dtype first, like HF's cos.to(x.dtype).
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(dt)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=dmask, other=0.0).to(dt)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    pdl_wait(PDL)
    row = qkv_ptr + t * stride_qkv + r[:, None] * HEAD_DIM
    x1 = tl.load(row + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        # Rounded as rms_norm_ref: normalised in fp32, cast, times the weight, cast.
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        wq1 = tl.load(q_w_ptr + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        wq2 = tl.load(q_w_ptr + HALF + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        wk1 = tl.load(k_w_ptr + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        wk2 = tl.load(k_w_ptr + HALF + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
        w1 = tl.where(is_q[:, None], wq1[None, :], wk1[None, :])
        w2 = tl.where(is_q[:, None], wq2[None, :], wk2[None, :])
        x1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dt)
    o2 = (x2 * cos + x1 * sin).to(dt)
    q_row = q_out_ptr + t * stride_qt + r[:, None] * stride_qh
    q_ok = tile_ok & is_q[:, None]
    tl.store(q_row + d[None, :], o1, mask=q_ok)
    tl.store(q_row + HALF + d[None, :], o2, mask=q_ok)
    if slot >= 0:  # -1: a padding row, stores nothing
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        cdt = k_cache_ptr.dtype.element_ty
        kv_head = r - num_heads  # negative on q's rows, which the mask leaves out
        kc = (k_cache_ptr + blk * stride_kcb + off * stride_kcs
              + kv_head[:, None] * stride_kch)
        k_ok = tile_ok & (r >= num_heads)[:, None]
        k1, k2 = o1, o2
        if FP8:  # saturate: a cast past 448 would give NaN
            k1 = tl.minimum(tl.maximum(o1.to(tl.float32) / k_scale, -448.0), 448.0)
            k2 = tl.minimum(tl.maximum(o2.to(tl.float32) / k_scale, -448.0), 448.0)
        tl.store(kc + d[None, :], k1.to(cdt), mask=k_ok)
        tl.store(kc + HALF + d[None, :], k2.to(cdt), mask=k_ok)
        # v is copied as it is: its kv heads are rows of whole head_dim width.
        vr = tl.arange(0, KV_ROWS)
        dv = tl.arange(0, BLOCK_D)
        v_ok = (vr < num_kv_heads)[:, None] & (dv < HEAD_DIM)[None, :]
        v_row = (qkv_ptr + t * stride_qkv + (num_heads + num_kv_heads) * HEAD_DIM
                 + vr[:, None] * HEAD_DIM + dv[None, :])
        v = tl.load(v_row, mask=v_ok, other=0.0)
        if FP8:
            v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0)
        vc = (v_cache_ptr + blk * stride_vcb + off * stride_vcs + vr[:, None] * stride_vch
              + dv[None, :])
        tl.store(vc, v.to(cdt), mask=v_ok)


def _check(qkv, num_heads, num_kv_heads, positions, cos_sin, q_weight, k_weight, k_cache,
           v_cache, slot_mapping) -> int:
    """-> head_dim, after checking every shape against it."""
    check(num_heads >= 1 and num_kv_heads >= 1,
          f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    heads = num_heads + 2 * num_kv_heads
    check(qkv.dim() == 2 and qkv.shape[1] % heads == 0,
          f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] with {num_heads} q and "
          f"{num_kv_heads} kv heads, got {tuple(qkv.shape)}")
    head_dim = qkv.shape[1] // heads
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    check(qkv.dtype in FLOAT_DTYPES, f"unsupported qkv dtype {qkv.dtype}")
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim,
          f"cos_sin must be [max_positions, {head_dim}], got {tuple(cos_sin.shape)}")
    check(positions.shape == (qkv.shape[0],),
          f"positions must be [T={qkv.shape[0]}], got {tuple(positions.shape)}")
    check_index_dtype("positions", positions)
    check((q_weight is None) == (k_weight is None),
          "q_weight and k_weight must be given together or not at all")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check(w is None or w.shape == (head_dim,),
              f"{name} must be [{head_dim}], got {None if w is None else tuple(w.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          "k_cache, v_cache must be [num_blocks, block_size, Hkv, D] alike, got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check(tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim),
          f"cache heads/head_dim {tuple(k_cache.shape[2:])} != ({num_kv_heads}, {head_dim})")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    check(slot_mapping.shape == (qkv.shape[0],),
          f"slot_mapping must be [T={qkv.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_index_dtype("slot_mapping", slot_mapping)
    return head_dim


def qk_norm_rope_store_triton(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    require_triton()
    head_dim = _check(qkv, num_heads, num_kv_heads, positions, cos_sin, q_weight, k_weight,
                      k_cache, v_cache, slot_mapping)
    check_same_device(qkv=qkv, positions=positions, cos_sin=cos_sin, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping)
    check(qkv.stride(1) == 1, "qkv rows must be contiguous")
    check(cos_sin.stride(1) == 1, "cos_sin must be contiguous in head_dim")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check(positions.is_contiguous() and slot_mapping.is_contiguous(),
          "positions and slot_mapping must be contiguous")
    block_size = k_cache.shape[1]
    has_norm = q_weight is not None
    if has_norm:
        check(q_weight.is_contiguous() and k_weight.is_contiguous(),
              "q_weight and k_weight must be contiguous")
        check(q_weight.device == qkv.device and k_weight.device == qkv.device,
              "q_weight and k_weight must be on qkv's device")
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    half = head_dim // 2
    dummy = cos_sin  # never read when HAS_NORM is off
    pdl = use_pdl(qkv)
    rows = next_pow2(num_heads + num_kv_heads)
    _qk_norm_rope_store_kernel[(t,)](
        qkv, q, positions, cos_sin, q_weight if has_norm else dummy,
        k_weight if has_norm else dummy, k_cache, v_cache, slot_mapping, eps,
        num_heads, num_kv_heads, k_scale, v_scale,
        qkv.stride(0), q.stride(0), q.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=next_pow2(half), ROWS=rows,
        KV_ROWS=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=block_size,
        HAS_NORM=has_norm, PDL=pdl, FP8=is_fp8(k_cache.dtype),
        num_warps=_num_warps(rows * half), **launch_pdl(pdl),
    )
    return q


def _num_warps(elements: int) -> int:
    """About 16 elements of each half-row tile per thread (one warp up to 512)."""
    return max(1, min(8, elements // 512))


def qk_norm_rope_store_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The unfused sequence: per-head norms, rotary, store_kv (views, no copies of q/k/v)."""
    head_dim = _check(qkv, num_heads, num_kv_heads, positions, cos_sin, q_weight, k_weight,
                      k_cache, v_cache, slot_mapping)
    q, k, v = (p.unflatten(-1, (-1, head_dim)) for p in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = apply_rotary_ref(q, k, positions, cos_sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def qk_norm_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D] normed and rotated; k (normed, rotated) and v
    written into the cache slots of slot_mapping (-1: skip). Norm weights: both or neither."""
    if use_triton(qkv, k_cache):
        return qk_norm_rope_store_triton(qkv, num_heads, num_kv_heads, positions, cos_sin,
                                         q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
                                         k_scale, v_scale)
    return qk_norm_rope_store_ref(qkv, num_heads, num_kv_heads, positions, cos_sin, q_weight,
                                  k_weight, eps, k_cache, v_cache, slot_mapping, k_scale, v_scale)
