"""Attention for a few queries per sequence over a paged KV cache, split-K on long contexts.

Decode reads the whole KV cache once per step and is memory bound. With few sequences
there are too few (sequence, kv head) programs to fill the GPU, so the context is split
into partitions computed in parallel (stage 1) and merged by their log-sum-exp (stage 2).
Each sequence divides its own context evenly among the splits (the kernel reads its length),
so a launch sized for the block table's capacity, as a CUDA graph is, splits a short context
as finely as a long one instead of leaving it to one partition.

A step that verifies speculative proposals has Q = 1 + K queries per sequence, the last Q
positions of its context, each attending causally up to its own position. They share the
sequence's keys, so they are rows of the same program (with the q heads of one kv head):
the KV is still read once per sequence, and Q is fixed per launch (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._attn_common import (
    LOG2E,
    P_FP8_SCALE,
    attn_tile,
    check_fp8_dots,
    check_paged_inputs,
    check_triton_layout,
    dot_precision,
    fp8_queries,
    fp16_queries,
    kv_scales,
    widen_fp8_to_f16,
)
from kernels._common import (
    cdiv,
    check,
    jit,
    launch_pdl,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
    use_triton,
)
from kernels.decode_launch import choose_splits, heads_first, launch_config, tile
from kernels.kv_quant import dequantize

REDUCE_CHUNK = 16
"""Partial results the reduce merges per loop step. One compiled reduce serves every split
count, as one split kernel serves every count above one: the count is not a specialisation
(do_not_specialize), so the decode graphs' many batch sizes, whose split counts run from 2 to
64, compile no further variant at capture. Nor is the block table's row stride, which
changes with an eager step's width and only offsets a row."""


@jit(do_not_specialize=("num_splits", "stride_bt"))
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_k_ptr, qk_scale, v_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, QLEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr,
    FP8_DOTS: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    pdl_wait(PDL)
    if HEADS_FIRST:  # grid (kv heads, sequences, splits): heads_first
        kv_head, b, num_kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    else:
        b, kv_head, num_kv_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_k_ptr + b)
    # This sequence's share of keys per split, whole tiles: short contexts leave splits empty.
    partition = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * partition
    end = tl.minimum(start + partition, seq_len)

    # Rows are (query j, q head g) pairs of the q heads sharing this kv head, padded to ROWS
    # for the tensor cores; query j sits at position seq_len - QLEN + j.
    r = tl.arange(0, ROWS)
    row_ok = r < GROUP * QLEN
    j = r // GROUP
    head = kv_head * GROUP + r % GROUP
    token = b.to(tl.int64) * QLEN + j
    if SPLIT:
        if start >= seq_len:
            # No keys: a short context in a launch sized for the longest the table allows.
            # Only its -inf log-sum-exp is written, which tells the reduce to skip it, so
            # the launch's width costs a load and a store per empty split.
            idx = (token * GROUP * num_kv_heads + head) * num_splits + split
            tl.store(part_lse_ptr + idx, tl.full([ROWS], float("-inf"), tl.float32),
                     mask=row_ok)
            return
    pos = seq_len - QLEN + j
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if FP8_DOTS:
        q, qk_scale = fp8_queries(q, qk_scale)
    else:
        q = fp16_queries(q, F16)
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    # Tiles every query sees in full need no mask; the rest (the partition's tail and, with
    # QLEN > 1, the last keys that only some queries see) are masked causally.
    open_end = tl.maximum(tl.minimum(end, seq_len - QLEN + 1), start)
    full_end = start + ((open_end - start) // BLOCK_N) * BLOCK_N
    for n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, n, end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs,
            kv_head * stride_kh, kv_head * stride_vh,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, False, False, DOT_PRECISION, FP8_DOTS,
        )
    for n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = attn_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, n, end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs,
            kv_head * stride_kh, kv_head * stride_vh,
            BLOCK_N, HEAD_DIM, BLOCK_SIZE, True, QLEN > 1, DOT_PRECISION, FP8_DOTS,
        )
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if FP8:  # the splits' merge is linear in them, so each may carry v_scale
        out = out * v_scale
    if not SPLIT:
        o_ptrs = out_ptr + token[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Partial results: normalised output and log2-sum-exp2 (-inf for an empty split).
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        idx = (token * GROUP * num_kv_heads + head) * num_splits + split
        tl.store(part_lse_ptr + idx, lse, mask=row_ok)
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])


@jit(do_not_specialize=("num_splits",))
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
    CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    # Merged so far: the largest log2-sum-exp2 seen (m), and the output and weight sums
    # scaled to it; each chunk of partials rescales them to its own larger maximum.
    m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    total = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    for first in range(0, num_splits, CHUNK):
        s = first + tl.arange(0, CHUNK)
        lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: all weights 0
        w = tl.exp2(lse - pivot)
        parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                        mask=((s < num_splits) & (lse > float("-inf")))[:, None], other=0.0)
        rescale = tl.exp2(m - pivot)
        acc = acc * rescale + tl.sum(parts * w[:, None], 0)
        total = total * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.maximum(total, 1e-30)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    *,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    q_per_seq: int = 1,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dots: int = 0,
) -> torch.Tensor:
    """`max_seqlen_k` defaults to the block-table capacity (static, so CUDA-graph safe);
    `block_n` (keys per tile, a power of two >= 16) and `fp8_dots` (an fp8 cache's dots on
    the tensor cores in e4m3: 1 for Q·Kᵀ, 2 for P·V as well; attn_tile) are a benchmark's
    knobs."""
    require_triton()
    num_seqs = _num_seqs(q, q_per_seq)
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens_k, num_seqs)
    check_triton_layout(q, k_cache, v_cache, block_tables, seq_lens_k)
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seqlen_k is None:
        max_seqlen_k = block_tables.shape[1] * block_size
    max_seqlen_k = max(max_seqlen_k, 1)
    if block_n is None:
        block_n = tile(q)
    check(block_n >= 16 and block_n & (block_n - 1) == 0,
          f"block_n must be a power of two >= 16, got {block_n}")
    k_scale, v_scale, fp8 = kv_scales(k_cache, k_scale, v_scale)
    if num_splits is None:
        num_splits = choose_splits(q, num_seqs, num_kv_heads, max_seqlen_k, block_n, fp8)
    check(1 <= num_splits <= max_seqlen_k, f"num_splits must be in [1, {max_seqlen_k}]")
    num_splits = min(num_splits, cdiv(max_seqlen_k, block_n))  # a split holds whole tiles
    num_warps, num_stages, rows = launch_config(q, group * q_per_seq, num_splits > 1, fp8)
    pdl = use_pdl(q)
    if num_splits > 1:
        part_out = torch.empty(q.shape[0], num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_lse = torch.empty(q.shape[0], num_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    check_fp8_dots(fp8_dots, q, fp8)
    if fp8_dots == 2:
        v_scale /= P_FP8_SCALE
    by_head = heads_first(head_dim)
    grid = (num_kv_heads, num_seqs) if by_head else (num_seqs, num_kv_heads)
    _decode_split_kernel[(*grid, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens_k,
        scale * LOG2E * k_scale, v_scale, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, QLEN=q_per_seq, ROWS=rows, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1, DOT_PRECISION=dot_precision(q.dtype), PDL=pdl, FP8=fp8,
        F16=widen_fp8_to_f16(q, fp8), FP8_DOTS=fp8_dots, HEADS_FIRST=by_head,
        num_warps=num_warps, num_stages=num_stages, **launch_pdl(pdl),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(q.shape[0], num_heads)](
            part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
            CHUNK=REDUCE_CHUNK, HEAD_DIM=head_dim, PDL=pdl,
            num_warps=4, **launch_pdl(pdl),
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    q_per_seq: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if q_per_seq > 1:  # query j of each sequence sees the context up to its own position
        num_seqs = _num_seqs(q, q_per_seq)
        qs = q.view(num_seqs, q_per_seq, *q.shape[1:])
        outs = [paged_decode_attention_ref(qs[:, j], k_cache, v_cache, block_tables,
                                           (seq_lens_k - (q_per_seq - 1 - j)).clamp(min=0),
                                           scale, 1, k_scale, v_scale)
                for j in range(q_per_seq)]
        return torch.stack(outs, 1).reshape(q.shape)
    num_seqs, num_heads, head_dim = q.shape
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens_k, num_seqs)
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return torch.empty_like(q)
    # Vectorised over the batch: gather every sequence's blocks up to the longest context,
    # padded, and mask the tail. Unused block-table entries may hold anything.
    max_len = max(int(seq_lens_k.max()), 1)
    ids = block_tables[:, : cdiv(max_len, block_size)].long().clamp(0, num_blocks - 1)

    def gather(cache: torch.Tensor, kv_scale: float) -> torch.Tensor:
        kv = cache[ids].flatten(1, 2)[:, :max_len]  # [B, S, Hkv, D]
        return dequantize(kv.transpose(1, 2), kv_scale, q.dtype)  # [B, Hkv, S, D]

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    lens = seq_lens_k.to(q.device).long()
    mask = torch.arange(max_len, device=q.device)[None, :] < lens.clamp(min=1)[:, None]
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    o = o.reshape(num_seqs, num_heads, head_dim)
    return torch.where((lens == 0)[:, None, None], torch.zeros_like(o), o)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    q_per_seq: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q_per_seq queries per sequence, the last positions of its context (seq_lens_k counts
    them): q [B * q_per_seq, H, D] -> out of q's shape and dtype."""
    if use_triton(q, k_cache):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens_k,
                                             scale, q_per_seq=q_per_seq, k_scale=k_scale,
                                             v_scale=v_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens_k, scale,
                                      q_per_seq, k_scale, v_scale)


def _num_seqs(q: torch.Tensor, q_per_seq: int) -> int:
    check(q_per_seq >= 1 and q.dim() == 3 and q.shape[0] % q_per_seq == 0,
          f"q must be [B * q_per_seq, H, D] with q_per_seq={q_per_seq} >= 1, "
          f"got shape {tuple(q.shape)}")
    return q.shape[0] // q_per_seq
