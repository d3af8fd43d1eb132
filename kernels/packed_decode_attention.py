"""Decode attention with every kv head of a sequence in one program (stage 1 of a split).

With few, small kv heads (SmolLM2-135M: 3 of 64) a program per (sequence, kv head) reads a
128-byte row per key and tensor, strided by the token's other heads, and pays the per-key work
(block-table reads, address math, softmax bookkeeping) for those few bytes. A token's K (and
V) for all kv heads is contiguous in the cache ([num_blocks, block_size, kv_heads, head_dim]),
so one program per (sequence, split) here reads tiles of [BLOCK_N, kv_heads * head_dim],
padded to a power of two, and pays that work once per key for all heads.

Every q head of the sequence is a row of one block-diagonal Q: row (query j, q head h) holds
q_h in the columns of its kv head and zeros elsewhere. Q @ K^T then gives each row its own
head's scores, and P @ V each row's output in its own head's columns; the zero products cost
nothing in a memory-bound kernel. A row stores only its own columns, in the layout of
kernels/paged_decode_attention.py (output or split partials), whose reduce kernel merges them.
"""

from __future__ import annotations

from kernels._common import jit, next_pow2, pdl_wait, tl


@jit
def _load_kv(ptr, rows, cols, key_ok, col_ok, MASK_KEYS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A [BLOCK_N, COLS] tile; a mask only where keys or padded columns need one, so full
    tiles of an unpadded width load unmasked."""
    ptrs = ptr + rows[:, None] + cols[None, :]
    if MASK_KEYS:
        if MASK_COLS:
            tile = tl.load(ptrs, mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=key_ok[:, None], other=0.0)
    else:
        if MASK_COLS:
            tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@jit
def _packed_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, start, kv_end, pos, qk_scale,
    stride_kb, stride_ks, stride_vb, stride_vs, cols_k, cols_v, col_ok,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, PAD_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N), all kv heads at once: as
    `attn_tile` (kernels/_attn_common.py), with a token's heads side by side in the columns."""
    n = start + tl.arange(0, BLOCK_N)
    key_ok = n < kv_end
    if BLOCK_SIZE >= BLOCK_N:
        blk = tl.load(bt_row_ptr + start // BLOCK_SIZE).to(tl.int64)  # one block per tile
    else:
        blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    off = n % BLOCK_SIZE
    k = _load_kv(k_cache_ptr, blk * stride_kb + off * stride_ks, cols_k, key_ok, col_ok,
                 MASKED, PAD_COLS)
    v = _load_kv(v_cache_ptr, blk * stride_vb + off * stride_vs, cols_v, key_ok, col_ok,
                 MASKED, PAD_COLS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        keep = key_ok[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@jit
def packed_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_k_ptr, qk_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEADS: tl.constexpr, GROUP: tl.constexpr, QLEN: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, COLS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_k_ptr + b)
    # Splits and causal tails as in _decode_split_kernel (kernels/paged_decode_attention.py).
    partition = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * partition
    end = tl.minimum(start + partition, seq_len)

    # Rows are (query j, q head h) pairs, padded to ROWS; columns are (kv head, dim) pairs,
    # padded to COLS. A row owns the columns of its kv head.
    r = tl.arange(0, ROWS)
    row_ok = r < HEADS * QLEN
    j = r // HEADS
    head = r % HEADS
    token = b.to(tl.int64) * QLEN + j
    pos = seq_len - QLEN + j
    c = tl.arange(0, COLS)
    c_head = c // HEAD_DIM
    d = c % HEAD_DIM
    own = row_ok[:, None] & (c_head[None, :] == (head // GROUP)[:, None])
    q = tl.load(q_ptr + token[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=own, other=0.0)
    cols_k = c_head * stride_kh + d
    cols_v = c_head * stride_vh + d
    col_ok = c < WIDTH
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    open_end = tl.maximum(tl.minimum(end, seq_len - QLEN + 1), start)
    full_end = start + ((open_end - start) // BLOCK_N) * BLOCK_N
    for n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _packed_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, n, end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, cols_k, cols_v, col_ok,
            BLOCK_N, BLOCK_SIZE, False, False, WIDTH < COLS, DOT_PRECISION,
        )
    for n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _packed_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, n, end, pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, cols_k, cols_v, col_ok,
            BLOCK_N, BLOCK_SIZE, True, QLEN > 1, WIDTH < COLS, DOT_PRECISION,
        )
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + token[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=own)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        idx = (token * HEADS + head) * num_splits + split
        tl.store(part_lse_ptr + idx, lse, mask=row_ok)
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + d[None, :], out, mask=own)


def packed_width(num_kv_heads: int, head_dim: int) -> int:
    """Columns of a packed K/V tile: all kv heads of a token, padded to a power of two."""
    return next_pow2(num_kv_heads * head_dim)
