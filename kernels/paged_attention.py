"""Causal attention over a paged KV cache for a ragged batch (prefill, extend and decode).

Query i of sequence b sits at position seq_lens_k[b] - q_len_b + i, so a cached prefix
(q_len < seq_len_k) and plain decode (q_len == 1) are the same computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._attn_common import (
    LOG2E,
    attn_tile,
    check_paged_inputs,
    check_triton_layout,
    dot_precision,
    fp16_queries,
    gather_kv,
    kv_scales,
    widen_fp8_to_f16,
)
from kernels._common import check, jit, next_pow2, require_triton, tl, use_triton


# The sequence count (a search bound) and the block table's row stride (a row offset) change
# from step to step, and specialising on them (1, a multiple of 16, neither) would compile
# up to nine variants of this kernel, some first met while serving, for no faster code.
@jit(do_not_specialize=("num_seqs", "stride_bt"))
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, seq_lens_k_ptr,
    num_seqs, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, F16: tl.constexpr,
):
    # Programs are laid out as sum_b (q_len_b // BLOCK_Q + 1) query tiles; the first tile
    # of sequence b is cu_seqlens_q[b] // BLOCK_Q + b, so a binary search finds b without
    # a host-side max_seqlen_q (no device sync, CUDA-graph friendly).
    # Reversed so the longest (last, most causal keys) query tiles start first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        go_right = first <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    b = lo - 1
    q_begin = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    m0 = (pid - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_k_ptr + b)
    ctx = seq_len - q_len

    # Rows are (query token, q head of this kv head's group): each K/V tile is loaded once
    # for the whole GQA group.
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    m = m0 + r // GROUP_P
    g = r % GROUP_P
    row_ok = (m < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    tok = (q_begin + m).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = fp16_queries(q, F16)
    pos = ctx + m

    m_i = tl.full([BLOCK_Q * GROUP_P], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = kv_head * stride_kh
    v_head = kv_head * stride_vh

    # Keys up to the tile's first position are visible to every row: no masking needed.
    kv_end = tl.minimum(ctx + m0 + BLOCK_Q, seq_len)
    full_end = ((ctx + m0 + 1) // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, start, kv_end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, k_head, v_head,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, False, True, DOT_PRECISION, 0,
        )
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, start, kv_end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, k_head, v_head,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, True, True, DOT_PRECISION, 0,
        )
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if FP8:
        out = out * v_scale
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _launch_config(q: torch.Tensor, group_p: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages): ~128 rows per tile on GPU, tiny on CPU."""
    if q.is_cuda:
        if head_dim <= 128:
            return max(128 // group_p, 1), 128, 8, 2
        return max(64 // group_p, 1), 64, 8, 2
    return max(16 // group_p, 1), 16, 4, 1


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    require_triton()
    num_seqs = cu_seqlens_q.shape[0] - 1
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k)
    check_triton_layout(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p = next_pow2(group)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_q, block_n, num_warps, num_stages = _launch_config(q, group_p, head_dim)
    # Upper bound on sum_b (q_len_b // BLOCK_Q + 1); surplus programs exit at once.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    k_scale, v_scale, fp8 = kv_scales(k_cache, k_scale, v_scale)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens_k,
        num_seqs, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, DOT_PRECISION=dot_precision(q.dtype),
        FP8=fp8, F16=widen_fp8_to_f16(q, fp8), num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    for b, seq_len in enumerate(lens):
        q_begin, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)]
        k = gather_kv(k_cache, blocks, seq_len, q.dtype, k_scale)  # [Hkv, L, D]
        v = gather_kv(v_cache, blocks, seq_len, q.dtype, v_scale)
        # GQA without repeating K/V: the group's heads become extra query rows.
        qg = q[q_begin:q_end].reshape(q_len, num_kv_heads, group, head_dim)
        qg = qg.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        mask = None
        if q_len > 1:
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            mask = mask.repeat(group, 1)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_begin:q_end] = o.reshape(q_len, num_heads, head_dim)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention; q [T, H, D] -> out [T, H, D] in q's dtype."""
    if use_triton(q, k_cache):
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale, k_scale, v_scale
        )
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k, scale,
                               k_scale, v_scale)


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens_k) -> None:
    check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1,
          f"cu_seqlens_q must be [B+1], got {tuple(cu_seqlens_q.shape)}")
    check(cu_seqlens_q.dtype == torch.int32,
          f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens_k, cu_seqlens_q.shape[0] - 1)
