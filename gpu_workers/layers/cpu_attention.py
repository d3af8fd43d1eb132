"""The CPU path between the QKV projection and the output projection, with fewer, larger ops.

On the CPU every torch op costs microseconds of dispatch whatever its size, and a decode
step of a small model runs hundreds of them per layer. What every layer would recompute is
built once per step (CPUStep): the rotary rows of the step's positions, the flat cache rows
its new tokens go to, and, for decode, the cache rows each sequence attends to with the mask
of its length. Per layer what is left is: rotary on q and k together (one view of the packed
projection), k and v into the cache with index_copy_, one index_select each for K and V in
the layout SDPA reads, and SDPA with the query heads of a KV head as extra query rows.

Roundings are those of Hugging Face's eager float code (x * cos + rotate_half(x) * sin, then
SDPA), so greedy tokens stay those of transformers. Prefill and chunked steps (several new
tokens per entry) keep the reference kernel, which runs once per prompt.

An fp8 cache (kernels/kv_quant.py) stores k / k_scale and v / v_scale saturated to +-448 and
is read back as fp8 * scale; its stores copy bytes, as torch has no CPU index_copy_ for fp8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize, quantize, raw
from kernels.paged_attention import paged_attention_ref


@dataclass(slots=True)
class DecodeGather:
    """Where each sequence's keys are, as rows of a cache viewed as [blocks * bs * Hkv, D]."""

    rows: torch.Tensor
    """[B * Hkv * S] int64: for sequence b, KV head h, position s, the cache row to read."""
    mask: torch.Tensor | None
    """[B, 1, 1, S] bool (position < length), or None when every sequence is S long."""
    num_seqs: int
    max_len: int


@dataclass(slots=True)
class CPUStep:
    """What every layer of one step shares on the CPU path (built once by the model)."""

    cos: torch.Tensor
    """[T, 1, D] cos of each token's position, repeated over both halves."""
    sin: torch.Tensor
    """[T, 1, D] the signed sin that goes with rotate-half: [-sin, sin]."""
    slots: torch.Tensor
    """[T'] int64 cache slots of the tokens that store (T' = T unless some are padding)."""
    stored: torch.Tensor | None
    """[T'] rows of the tokens that store, or None when all do."""
    gather: DecodeGather | None
    """The decode batch's cache rows; None for prefill/extend steps."""

    @classmethod
    def build(cls, batch, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype,
              num_blocks: int, block_size: int, num_kv_heads: int) -> CPUStep:
        half = cos_sin.shape[1] // 2
        rows = cos_sin.index_select(0, positions.long()).to(dtype)
        cos, sin = rows[:, :half], rows[:, half:]
        cos2 = torch.cat([cos, cos], dim=-1).unsqueeze(1)
        sin2 = torch.cat([-sin, sin], dim=-1).unsqueeze(1)
        slots = batch.slot_mapping.long()
        stored = None
        if bool((slots < 0).any()):
            stored = torch.nonzero(slots >= 0).flatten()
            slots = slots.index_select(0, stored)
        gather = None
        if batch.decode:
            gather = decode_gather(batch.block_tables, batch.seq_lens_k, batch.max_seqlen_k,
                                   num_blocks, block_size, num_kv_heads)
        return cls(cos2, sin2, slots, stored, gather)


def decode_gather(block_tables: torch.Tensor, seq_lens_k: torch.Tensor, max_len: int,
                  num_blocks: int, block_size: int, num_kv_heads: int) -> DecodeGather:
    """The cache rows of every sequence's positions [0, max_len), padded past its length
    with row 0 (masked out); unused block-table entries may hold anything."""
    num_seqs = block_tables.shape[0]
    s = max(int(max_len), 1)
    pos = torch.arange(s)
    lens = seq_lens_k.long().clamp(min=1)
    inside = pos[None, :] < lens[:, None]  # [B, S]
    blocks = block_tables.long().index_select(1, pos // block_size).clamp(0, num_blocks - 1)
    slot = torch.where(inside, blocks * block_size + pos % block_size, 0)
    heads = torch.arange(num_kv_heads)
    rows = (slot[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
    mask = None if bool(inside.all()) else inside[:, None, None, :]
    return DecodeGather(rows, mask, num_seqs, s)


def rotate(x: torch.Tensor, step: CPUStep) -> torch.Tensor:
    """x [T, n, D] -> x * cos + rotate_half(x) * sin (HF's roundings), a new tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * step.cos + swapped * step.sin


def prepare_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                step: CPUStep, q_norm, k_norm, k_cache: torch.Tensor,
                v_cache: torch.Tensor, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D] normed (Qwen3) and rotated; k and v stored."""
    h = num_heads
    heads = qkv.unflatten(1, (-1, head_dim))  # [T, H + 2 Hkv, D], a view
    v = heads[:, h + num_kv_heads:]
    if q_norm is None:
        qk = rotate(heads[:, :h + num_kv_heads], step)  # q and k in one go
        q, k = qk[:, :h], qk[:, h:]
    else:
        q = rotate(q_norm(heads[:, :h]), step)
        k = rotate(k_norm(heads[:, h:h + num_kv_heads]), step)
    store(k, v, k_cache, v_cache, step, k_scale, v_scale)
    return q


def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          step: CPUStep, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [T, Hkv, D] into their cache slots (tokens without a slot store nothing)."""
    if step.stored is not None:
        k, v = k.index_select(0, step.stored), v.index_select(0, step.stored)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = raw(quantize(k, k_scale, k_cache.dtype))
    v = raw(quantize(v, v_scale, v_cache.dtype))
    raw(k_cache).view(-1, hkv, d).index_copy_(0, step.slots, k)
    raw(v_cache).view(-1, hkv, d).index_copy_(0, step.slots, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
           step: CPUStep, scale: float, k_scale: float = 1.0,
           v_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] over the cache, which already holds this step's k/v."""
    g = step.gather
    if g is None:
        return paged_attention_ref(q, k_cache, v_cache, batch.block_tables,
                                   batch.cu_seqlens_q, batch.seq_lens_k, scale, k_scale, v_scale)
    b, h, d = g.num_seqs, q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    k = k_cache.view(-1, d).index_select(0, g.rows).view(b, hkv, g.max_len, d)
    v = v_cache.view(-1, d).index_select(0, g.rows).view(b, hkv, g.max_len, d)
    # GQA without repeating K/V: the group's query heads become extra query rows.
    qg = q.reshape(b, hkv, h // hkv, d)
    k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
    return o.reshape(b, h, d)
