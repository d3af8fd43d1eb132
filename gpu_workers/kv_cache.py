"""The paged KV pool: per layer, K and V of shape [num_blocks, block_size, Hkv_rank, D].

Sizing: on CUDA, whatever memory the profiling forward left under gpu_memory_utilization, at
most kv_cache_bytes when given; on CPU, the kv_cache_bytes budget. Either way one
max_model_len sequence must fit, or start-up fails with a message that says what to change.
A draft model (speculative "draft") keeps its own pool over the same block ids, so
`extra_per_block` (its bytes per block) is paid from the same budget.
"""

from __future__ import annotations

import torch

from gpu_workers.config import DEFAULT_CPU_KV_BYTES, ModelConfig, WorkerConfig
from gpu_workers.kv_shared_pool import memfd_pool
from protocol.process_runtime import ExplainedStartupError


class KVCacheTooSmall(ExplainedStartupError):
    """The KV pool cannot hold one sequence of max_model_len tokens."""


def bytes_per_block(model: ModelConfig, block_size: int, world_size: int) -> int:
    return model.kv_bytes_per_token(world_size) * block_size


def cpu_num_blocks(config: WorkerConfig, model: ModelConfig, world_size: int,
                   extra_per_block: int = 0) -> int:
    budget = config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
    return budget // (bytes_per_block(model, config.block_size, world_size) + extra_per_block)


def check_fits(num_blocks: int, config: WorkerConfig, model: ModelConfig, world_size: int,
               extra_per_block: int = 0) -> None:
    need = -(-config.max_model_len // config.block_size)
    if num_blocks >= need:
        return
    per_seq = need * (bytes_per_block(model, config.block_size, world_size) + extra_per_block)
    budget = (
        f"gpu_memory_utilization={config.gpu_memory_utilization} (--gpu-memory-utilization)"
        if config.device == "cuda"
        else f"kv_cache_bytes={config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES} (--kv-cache-bytes)"
    )
    raise KVCacheTooSmall(
        f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens "
        f"({num_blocks * config.block_size} tokens) but one sequence of max_model_len="
        f"{config.max_model_len} needs {need} blocks ({per_seq / 2**20:.1f} MiB per rank); "
        f"lower max_model_len (--max-model-len), raise {budget}, or use more "
        "tensor-parallel ranks"
    )


class KVCache:
    """One rank's pool. Its KV-head count is the one of the attention layers it is bound to:
    under tensor parallelism ranks may hold different numbers of KV heads (see
    protocol.head_partition), so the storage is allocated by bind(). The block count is the same
    on every rank (the runner agrees on it, sizing by the rank that holds the most heads)."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, mappable: bool = False) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.mappable = mappable
        """Allocate a CPU pool where another process can map it (gpu_workers.kv_shared_pool;
        a CUDA pool needs nothing special)."""
        self.storage: torch.Tensor | None = None
        self.memfd = -1
        """The memfd holding a mappable CPU pool."""

    def bind(self, attention_layers) -> None:
        layers = list(attention_layers)
        hkv = {layer.num_kv_heads for layer in layers}
        assert len(hkv) == 1, f"attention layers disagree on their KV heads: {sorted(hkv)}"
        m = self.model
        # One allocation; zeros so a never-written slot cannot inject NaNs through masked lanes.
        shape = (2, m.num_layers, self.num_blocks, self.block_size, hkv.pop(), m.head_dim)
        if self.mappable and torch.device(self.device).type == "cpu":
            self.storage, self.memfd = memfd_pool(shape, m.kv_dtype)
        else:
            self.storage = torch.zeros(shape, dtype=m.kv_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache = self.storage[0, i]
            layer.v_cache = self.storage[1, i]

    @staticmethod
    def unbind(attention_layers) -> None:
        """Point the layers at no cache: a scratch cache bound to them is then freed with its
        last other reference, not when the next cache is bound (memory measured in between
        would count it)."""
        for layer in attention_layers:
            layer.k_cache = torch.empty(0)
            layer.v_cache = torch.empty(0)
