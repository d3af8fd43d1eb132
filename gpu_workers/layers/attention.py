"""Paged attention over the KV cache, with one switch choosing the implementation.

Backends: "flash_attn" (flash-attn's paged varlen / kvcache kernels, CUDA, bf16/fp16; only
when asked for), "triton" (kernels/ Triton kernels; their torch references on CPU; the "auto"
choice) and "torch" (the pure-torch references everywhere, for debugging).

An fp8 KV cache (kernels/kv_quant.py) is written and read by the Triton kernels and the torch
references; flash-attn's kernels read no fp8 KV, so asking for both is refused.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from gpu_workers.layers import cpu_attention
from gpu_workers.layers.cpu_attention import CPUStep
from gpu_workers.ops import (
    paged_attention,
    paged_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    store_kv,
    store_kv_ref,
)
from kernels.kv_quant import is_fp8
from protocol.limits import FLASH_BLOCK_MULTIPLE

FLASH_HEAD_DIMS = (64, 128, 256)


@dataclass(slots=True)
class AttentionBatch:
    """Per-step attention inputs shared by every layer (device tensors + host-side maxima)."""

    slot_mapping: torch.Tensor
    """[T] cache slot of each new token (block * block_size + offset); -1 = padding."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32."""
    cu_seqlens_q: torch.Tensor
    """[B + 1] int32 offsets of each entry's new tokens."""
    seq_lens_k: torch.Tensor
    """[B] int32 context length after this step (cached + new)."""
    cu_seqlens_k: torch.Tensor | None
    """[B + 1] int32, only for flash-attn's varlen kernel."""
    max_seqlen_q: int
    max_seqlen_k: int
    decode: bool
    """Every entry computes exactly q_per_seq tokens, the last of its context (one when
    decoding; 1 + K when a CUDA graph verifies K proposals per entry, padded to K)."""
    cpu: CPUStep | None = None
    """On the CPU path: what every layer of this step shares (the model builds it)."""
    q_per_seq: int = 1


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


FP8_MIN_CAPABILITY = (8, 9)
"""Triton converts float8_e4m3fn on Ada and Hopper GPUs and later, not on older ones."""


def resolve_backend(requested: str, device: str, dtype: torch.dtype, head_dim: int,
                    block_size: int, kv_dtype: torch.dtype | None = None) -> str:
    """Pick the attention backend; an explicit request that cannot work is an error."""
    if kv_dtype is not None and is_fp8(kv_dtype):
        check_fp8_kv(requested, device)
    flash_ok = (
        device == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim in FLASH_HEAD_DIMS
        and block_size % FLASH_BLOCK_MULTIPLE == 0
        and flash_attn_available()
    )
    if requested == "auto":
        # The Triton kernels are the measured path on GPUs; flash-attn is used when asked for.
        return "triton" if device == "cuda" else "torch"
    if requested == "flash_attn" and not flash_ok:
        raise ValueError(
            "attention_backend='flash_attn' needs flash-attn installed, device 'cuda', a bf16/fp16 "
            f"dtype, head_dim in {FLASH_HEAD_DIMS} and block_size a multiple of "
            f"{FLASH_BLOCK_MULTIPLE} (got dtype={dtype}, head_dim={head_dim}, "
            f"block_size={block_size}); use attention_backend='auto' or 'triton'"
        )
    return requested


def check_fp8_kv(requested: str, device: str) -> None:
    """An fp8 KV cache runs on the Triton kernels (or the torch references), nowhere else."""
    if requested == "flash_attn":
        raise ValueError("kv_cache_dtype='fp8' needs the Triton attention kernels (flash-attn "
                         "reads no fp8 KV); use attention_backend='auto' or 'triton'")
    if device == "cuda" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        have = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer "
                         f"(this one is {have}); use kv_cache_dtype='auto'")


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # Views into the runner's KV pool, assigned once it is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An fp8 cache holds k / k_scale and v / v_scale (kernels/kv_quant.py); the loader
        # sets them from the checkpoint's k_scale/v_scale. A model-dtype cache ignores them.
        self.scales: dict[str, float] = {"k_scale": 1.0, "v_scale": 1.0}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; stores k/v first so queries see them."""
        self.store(k, v, batch)
        return self.attend(q, batch)

    def store(self, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
        """k/v [T, Hkv, D] into their cache slots (the model's fused kernel does this itself)."""
        store = store_kv_ref if self.backend == "torch" else store_kv
        store(k, v, self.k_cache, self.v_cache, batch.slot_mapping, **self.scales)

    def attend(self, q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the cache, which already holds this step's k/v."""
        kc, vc, scales = self.k_cache, self.v_cache, self.scales
        if batch.cpu is not None:
            return cpu_attention.attend(q, kc, vc, batch, batch.cpu, self.scale, **scales)
        if self.backend == "torch":
            if batch.decode:  # one batched call instead of one per sequence
                return paged_decode_attention_ref(q, kc, vc, batch.block_tables,
                                                  batch.seq_lens_k, self.scale, batch.q_per_seq,
                                                  **scales)
            return paged_attention_ref(q, kc, vc, batch.block_tables, batch.cu_seqlens_q,
                                       batch.seq_lens_k, self.scale, **scales)
        if self.backend == "flash_attn":
            return self._flash(q, batch)
        if batch.decode:
            return paged_decode_attention(q, kc, vc, batch.block_tables, batch.seq_lens_k,
                                          self.scale, batch.q_per_seq, **scales)
        return paged_attention(q, kc, vc, batch.block_tables, batch.cu_seqlens_q,
                               batch.seq_lens_k, self.scale, **scales)

    def _flash(self, q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        if batch.decode:  # causal: the q_per_seq queries are the context's last positions
            qs = q.view(-1, batch.q_per_seq, *q.shape[1:])
            out = flash_attn_with_kvcache(
                qs, self.k_cache, self.v_cache, cache_seqlens=batch.seq_lens_k,
                block_table=batch.block_tables, softmax_scale=self.scale, causal=True,
            )
            return out.view(q.shape)
        return flash_attn_varlen_func(
            q, self.k_cache, self.v_cache,
            cu_seqlens_q=batch.cu_seqlens_q, cu_seqlens_k=batch.cu_seqlens_k,
            max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=batch.block_tables,
        )
