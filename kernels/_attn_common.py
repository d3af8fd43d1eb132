"""Checks and pieces shared by the paged attention kernels and references.

An fp8 cache (kernels/kv_quant.py) is read as fp8 * scale: the kernels convert each K/V tile
to the queries' dtype (exact: every float8_e4m3fn value is a bf16/fp16 value), fold k_scale
into the softmax scale (kv_scales) and multiply the output by v_scale; the references
dequantize what they gather.
"""

from __future__ import annotations

import torch

from kernels._common import FLOAT_DTYPES, check, check_same_device, jit, next_pow2, tl
from kernels.kv_quant import dequantize, is_fp8

LOG2E = 1.4426950408889634
P_FP8_SCALE = 256.0
"""With fp8 dots for P·V (FP8_DOTS == 2), the probabilities, in [0, 1], are multiplied by this
before they become e4m3, so that small ones keep mantissa bits instead of falling into the
format's subnormals (below 2^-6); the output is divided by it again (the kernel's v_scale)."""


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k: torch.Tensor,
    num_seqs: int,
) -> None:
    check(q.dim() == 3, f"q must be 3-D, got shape {tuple(q.shape)}")
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          "k_cache, v_cache must be [num_blocks, block_size, Hkv, D] alike, got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}")
    check(num_heads % num_kv_heads == 0,
          f"num q heads {num_heads} must be a multiple of num kv heads {num_kv_heads}")
    check(head_dim == next_pow2(head_dim), f"head_dim must be a power of two, got {head_dim}")
    check(block_size == next_pow2(block_size),
          f"block_size must be a power of two, got {block_size}")
    check(q.dtype in FLOAT_DTYPES, f"unsupported q dtype {q.dtype}")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    check(k_cache.dtype == q.dtype or is_fp8(k_cache.dtype),
          f"the cache holds {k_cache.dtype}: q's dtype {q.dtype} or float8_e4m3fn")
    check(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
          f"block_tables must be [B={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    check(block_tables.dtype == torch.int32,
          f"block_tables must be int32, got {block_tables.dtype}")
    check(seq_lens_k.shape == (num_seqs,),
          f"seq_lens_k must be [B={num_seqs}], got {tuple(seq_lens_k.shape)}")
    check(seq_lens_k.dtype == torch.int32, f"seq_lens_k must be int32, got {seq_lens_k.dtype}")


def check_triton_layout(q, k_cache, v_cache, block_tables, *index_tensors) -> None:
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    for t in index_tensors:
        check(t.is_contiguous() and t.device == q.device,
              "index tensors must be contiguous and on q's device")


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for inputs of `dtype`, passed to the kernels as a constexpr.

    Triton's default for float32 operands on NVIDIA GPUs is TF32 (10-bit mantissas, ~1e-3
    relative error), which flips greedy tokens against a float32 reference: float32 asks
    for IEEE dots. 16-bit inputs are exact in any mode and accumulate in float32; they keep
    the default so their compiled kernels are unchanged.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float, bool]:
    """(k_scale, v_scale, fp8) as the kernels apply them: 1.0 for a model-dtype cache."""
    fp8 = is_fp8(cache.dtype)
    return (k_scale, v_scale, True) if fp8 else (1.0, 1.0, False)


def widen_fp8_to_f16(q: torch.Tensor, fp8: bool) -> bool:
    """Whether the kernels compute over an fp8 cache in float16 rather than q's bfloat16: an
    e4m3 pair widens to float16 in one instruction on the GPU, to bfloat16 in three more
    (through float16), and decode reads every tile of K and V. The queries go to float16
    once per program, clamped to its range (bfloat16's 8-bit mantissa fits in float16's 10);
    the probabilities are in [0, 1], where float16 is the finer of the two."""
    return fp8 and q.dtype == torch.bfloat16


@jit
def fp16_queries(q, WIDEN: tl.constexpr):
    """q as the tiles' compute dtype (widen_fp8_to_f16): attn_tile converts K and V to it."""
    if WIDEN:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


def check_fp8_dots(fp8_dots: int, q: torch.Tensor, fp8: bool) -> None:
    check(fp8_dots in (0, 1, 2), f"fp8_dots is 0, 1 or 2, got {fp8_dots}")
    check(fp8_dots == 0 or (fp8 and q.dtype in (torch.bfloat16, torch.float16)),
          "fp8 dots need an fp8 cache and 16-bit queries")


@jit
def fp8_queries(q, QK_SCALE):
    """q as e4m3, each row scaled to the format's range, and QK_SCALE times each row's scale
    (the factor that brings the row's scores back), for tensor-core dots of fp8 q and fp8 K:
    no K tile is widened. A row of zeros (padding) stays zeros."""
    scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30) / 448.0  # FP8_MAX
    q8 = (q.to(tl.float32) / scale[:, None]).to(tl.float8e4nv)
    return q8, QK_SCALE * scale[:, None]


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype,
    scale: float = 1.0,
) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] + block ids -> [Hkv, length, D] of `dtype` for one sequence."""
    kv = cache[block_ids.long()].flatten(0, 1)[:length]
    return dequantize(kv, scale, dtype).transpose(0, 1)


@jit
def attn_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, kv_end, pos, qk_scale,
    stride_kb, stride_ks, stride_vb, stride_vs, kv_head_off_k, kv_head_off_v,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_DOTS: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N) of a paged sequence.

    FP8_DOTS (an fp8 cache only): 0 widens K and V to q's dtype; 1 takes q as e4m3
    (fp8_queries; qk_scale then holds a scale per row) for Q·Kᵀ on the fp8 tile as loaded,
    and widens V to float16; 2 also takes P, scaled by P_FP8_SCALE, as e4m3 for P·V."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if BLOCK_SIZE >= BLOCK_N:
        # The whole tile lives in one cache block: one block-table read.
        blk = tl.load(bt_row_ptr + start // BLOCK_SIZE).to(tl.int64)
        off = n % BLOCK_SIZE
        k_rows = blk * stride_kb + off * stride_ks
        v_rows = blk * stride_vb + off * stride_vs
    else:
        blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n < kv_end, other=0).to(tl.int64)
        off = n % BLOCK_SIZE
        k_rows = blk * stride_kb + off * stride_ks
        v_rows = blk * stride_vb + off * stride_vs
    # An fp8 cache's tiles are converted to q's dtype as loaded, before K's transpose: a
    # transposed 8-bit tile has no fast path into the matrix units, a 16-bit one does (the
    # conversion is a no-op for a cache of q's dtype). The scales are applied outside:
    # k_scale in qk_scale, v_scale on the output.
    if MASKED:
        kv_mask = n < kv_end
        k = tl.load(k_cache_ptr + kv_head_off_k + k_rows[:, None] + d[None, :],
                    mask=kv_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_head_off_v + v_rows[:, None] + d[None, :],
                    mask=kv_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_head_off_k + k_rows[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + kv_head_off_v + v_rows[:, None] + d[None, :])
    kt = tl.trans(k.to(q.dtype))
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        keep = n[None, :] < kv_end
        if CAUSAL:
            keep = keep & (n[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_DOTS == 0:
        v = v.to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    elif FP8_DOTS == 1:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        pv = tl.dot((p * 256.0).to(v.dtype), v)  # P_FP8_SCALE
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i
