"""One decoder-only transformer for Llama, Qwen2 and Qwen3.

They differ by two flags: Qwen2 has biases on q/k/v, Qwen3 RMS-normalises each head of q and k
before rotary. Module names follow the Hugging Face checkpoints so the loader maps names 1:1
(apart from the packed qkv_proj and gate_up_proj).

Between the QKV projection and attention the model runs one fused kernel (q/k norms, rotary,
KV-cache store: kernels/qk_norm_rope_store.py). CausalLM(..., fused_qkv=False) runs the
former op-by-op sequence instead, the reference the tests compare the kernel with.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.config import ModelConfig
from gpu_workers.layers import cpu_attention
from gpu_workers.layers.attention import AttentionBatch, PagedAttention
from gpu_workers.layers.cpu_attention import CPUStep
from gpu_workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gpu_workers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_workers.layers.norm import RMSNorm, norm_then_linear
from gpu_workers.layers.parallel import TPInfo
from gpu_workers.ops import apply_rotary, build_rope_cache
from kernels import qk_norm_rope_store, qk_norm_rope_store_ref


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, backend: str, device,
                 fused_qkv: bool = True) -> None:
        super().__init__()
        self.fused_qkv = fused_qkv
        # The torch backend runs the references everywhere, on any device.
        self.prepare_qkv = qk_norm_rope_store_ref if backend == "torch" else qk_norm_rope_store
        d, dt = cfg.head_dim, cfg.dtype
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp, dt, device)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_heads = self.qkv_proj.q_heads  # o_proj reads the columns of this rank's query heads
        self.o_proj = RowParallelLinear(range(q_heads.start * d, q_heads.stop * d),
                                        cfg.hidden_size, False, tp, dt, device)
        self.head_dim = d
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt, device) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5, backend)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               batch: AttentionBatch) -> torch.Tensor:
        """Attention and o_proj, from the qkv projection's output (DecoderLayer computes that
        with the norm before it: norm_then_linear)."""
        if batch.cpu is not None and self.fused_qkv:
            q = cpu_attention.prepare_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                          batch.cpu, self.q_norm, self.k_norm,
                                          self.attn.k_cache, self.attn.v_cache, **self.attn.scales)
        else:
            prepare = self._prepare_fused if self.fused_qkv else self._prepare_unfused
            q = prepare(qkv, positions, cos_sin, batch)
        out = self.attn.attend(q, batch)
        return self.o_proj(out.reshape(qkv.shape[0], self.num_heads * self.head_dim))

    def _prepare_fused(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       batch: AttentionBatch) -> torch.Tensor:
        """One kernel: q/k norms, rotary, k/v into the cache; returns q [T, H, D]."""
        qn, kn = self.q_norm, self.k_norm
        return self.prepare_qkv(
            qkv, self.num_heads, self.num_kv_heads, positions, cos_sin,
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            0.0 if qn is None else qn.eps, self.attn.k_cache, self.attn.v_cache,
            batch.slot_mapping, **self.attn.scales)

    def _prepare_unfused(self, qkv: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The same op by op (strided copies, two norms, rotary, store_kv), to compare."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, d))
            k = self.k_norm(k.reshape(-1, d))
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        q, k = apply_rotary(q, k, positions, cos_sin)
        self.attn.store(k, v, batch)
        return q


class MLP(nn.Module):
    """The SwiGLU projections (checkpoint names mlp.gate_proj/up_proj/down_proj); DecoderLayer
    runs them, the norm inside gate_up and silu(gate) * up inside down_proj where it can."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, device) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], False, tp,
                                                       cfg.dtype, device)
        self.down_proj = RowParallelLinear.even(i, cfg.hidden_size, False, tp, cfg.dtype, device)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, backend: str, device,
                 fused_qkv: bool = True) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, tp, backend, device, fused_qkv)
        self.mlp = MLP(cfg, tp, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype,
                                                device)

    def forward(self, x, residual, positions, cos_sin, batch):
        # Each norm goes into the projection after it (one kernel at decode's few rows).
        qkv, residual = norm_then_linear(x, residual, self.input_layernorm,
                                         self.self_attn.qkv_proj)
        x = self.self_attn.attend(qkv, positions, cos_sin, batch)
        gate_up, residual = norm_then_linear(x, residual, self.post_attention_layernorm,
                                             self.mlp.gate_up_proj)
        return self.mlp.down_proj(gate_up, gated=True), residual


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, backend: str, device,
                 max_positions: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype,
                                                   device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, backend, device, fused_qkv) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        # The torch backend on the CPU runs the CPU path (gpu_workers.layers.cpu_attention).
        self.cpu_path = backend == "torch" and torch.device(device).type == "cpu"
        self.dtype = cfg.dtype
        cos_sin = build_rope_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                   device)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        if self.cpu_path:
            kc = self.layers[0].self_attn.attn.k_cache
            batch.cpu = CPUStep.build(batch, positions, self.cos_sin, self.dtype, kc.shape[0],
                                      kc.shape[1], kc.shape[2])
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, batch)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, backend: str, device,
                 max_positions: int, fused_qkv: bool = True) -> None:
        super().__init__()
        self.config = cfg
        self.fused_qkv = fused_qkv
        self.model = DecoderStack(cfg, tp, backend, device, max_positions, self.fused_qkv)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of every new token."""
        return self.model(ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [R, vocab] in the model's dtype on rank 0, None on the other ranks (the
        sampler widens what it needs: a greedy batch's argmax reads them as they are)."""
        return self.lm_head.logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
