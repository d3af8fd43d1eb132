"""Worker configuration and the model shape read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.limits import (
    ATTENTION_BACKENDS,
    BLOCK_SIZE,
    CPU_KV_CACHE_BYTES,
    MAX_MODEL_LEN_CAP,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    canonical_kv_cache_dtype,
    plans_in_flight,
)
from protocol.model_shape import ModelShape, canonical_dtype

if TYPE_CHECKING:  # torch loads where a model does: the launcher reads WorkerConfig only
    import torch

SPECULATIVE_METHODS = (None, "ngram", "draft")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype `name` names (protocol.model_shape says which names are accepted)."""
    import torch

    return getattr(torch, canonical_dtype(name))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What one worker rank runs. The pipeline builds it with EngineConfig.worker_config; the
    defaults here are the shared CPU ones of protocol/limits.py, for configs built by hand."""

    model: str
    """A Hugging Face model directory (config.json + safetensors)."""
    device: str = "cpu"
    dtype: str | None = None
    """None keeps the checkpoint's dtype."""
    max_model_len: int = MAX_MODEL_LEN_CAP
    block_size: int = BLOCK_SIZE["cpu"]
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS["cpu"]
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    """KV budget on CPU (None = DEFAULT_CPU_KV_BYTES); on CUDA a cap on the pool that
    gpu_memory_utilization leaves room for (None: no cap)."""
    gpu_share: bool = False
    """Other replicas share this GPU (disaggregation on too few GPUs): the KV budget counts
    this process's own memory against its gpu_memory_utilization share, not the device's."""
    kv_pool_mappable: bool = False
    """KV moves between replicas through shared pools: a CPU pool is allocated where another
    process can map it (gpu_workers.kv_shared_pool)."""
    kv_cache_dtype: str = "auto"
    """"auto": the KV cache in the model's dtype; "fp8": float8_e4m3fn with scales."""
    kv_offloading_size: float = 0.0
    """GiB of host memory per rank for the host KV tier (0: off)."""
    enforce_eager: bool = False
    """Disable CUDA graphs for decode batches."""
    precompile_kernels: bool = True
    """A start with no cached peak memory compiles its Triton kernels on parallel processes
    before its first step (gpu_workers.startup_kernels)."""
    peer_all_reduce: bool = False
    """Ranks on one host all-reduce small tensors through each other's memory (one kernel)
    instead of NCCL's ring (gpu_workers.layers.peer_all_reduce); opt-in until measured."""
    attention_backend: str = "auto"
    dist_init_method: str | None = None
    seed: int = 0
    lookahead: bool = False
    """Launch a plan that is already waiting before the previous step's tokens reached the
    host, so the device runs the two back to back (needs the scheduler's overlap). A plan
    whose proposals read the host's token history settles the step in flight first."""
    speculative: str | None = None
    """"ngram": propose tokens by prompt lookup; "draft": propose them with draft_model; either
    way one target step verifies them (gpu_workers.speculative)."""
    num_speculative_tokens: int = 0
    """The most proposals one entry verifies per step; the plan caps each entry (num_spec)."""
    ngram_size: int = 3
    """Tokens matched by the n-gram proposer."""
    draft_model: str | None = None
    """The draft model directory (speculative "draft"): same vocabulary as the target."""
    max_plans_in_flight: int = plans_in_flight(overlap=True)
    """The scheduler's: how many plans it sends ahead of results. A sequence finished at
    step N may be computed by the plans already sent after N, so the worker's buffers reach
    that far past the limits above (the headroom properties below)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype is not None:
            canonical_dtype(self.dtype)
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is needed with speculative='draft', and only then")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_plans_in_flight", "ngram_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        canonical_kv_cache_dtype(self.kv_cache_dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")

    @property
    def headroom_tokens(self) -> int:
        """Positions past max_model_len a sequence's buffers keep: one extra token per plan
        that may follow its finish, and one for the token sampled last (never computed)."""
        return self.max_plans_in_flight

    @property
    def max_seq_tokens(self) -> int:
        return self.max_model_len + self.headroom_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width: max_model_len's blocks, one more per plan that may follow."""
        return -(-self.max_model_len // self.block_size) + self.max_plans_in_flight - 1

    @property
    def mirror_rows(self) -> int:
        """Mirror rows to start with: every plan in flight may hold max_num_seqs sequences
        (finished ones are dropped only by a later plan), plus a few for admissions that
        arrive with the same plan as the drops that make room for them (the mirror grows
        past this if ever needed)."""
        return self.max_plans_in_flight * self.max_num_seqs + 8


DEFAULT_CPU_KV_BYTES = CPU_KV_CACHE_BYTES


@dataclass(frozen=True, slots=True)
class ModelConfig(ModelShape):
    """The model shape (protocol.model_shape parses and checks it, for the launcher too) and
    the torch dtypes its weights and KV cache use."""

    dtype: torch.dtype
    kv_cache_dtype: torch.dtype | None = None
    """None: the KV cache holds the weights' dtype."""

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None,
                 kv_cache_dtype: str = "auto") -> ModelConfig:
        shape = cls.from_shape(ModelShape.from_dir(model_dir, dtype))
        return shape.with_kv_cache_dtype(kv_cache_dtype)

    @classmethod
    def for_worker(cls, config: WorkerConfig) -> ModelConfig:
        """The model of a worker's config, with its KV cache dtype."""
        return cls.from_dir(config.model, config.dtype, config.kv_cache_dtype)

    @classmethod
    def from_dict(cls, cfg: dict, dtype: str | None = None) -> ModelConfig:
        return cls.from_shape(ModelShape.from_dict(cfg, dtype))

    @classmethod
    def from_shape(cls, shape: ModelShape) -> ModelConfig:
        values = {f.name: getattr(shape, f.name) for f in fields(ModelShape)}
        return cls(**values, dtype=parse_dtype(shape.dtype_name))

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def with_kv_cache_dtype(self, name: str) -> ModelConfig:
        """This shape with the KV cache of --kv-cache-dtype `name` ("auto", "fp8", ...)."""
        if canonical_kv_cache_dtype(name) == "auto":
            return replace(self, kv_cache_dtype=None)
        from kernels.kv_quant import FP8_KV_DTYPE

        return replace(self, kv_cache_dtype=FP8_KV_DTYPE)

    def kv_bytes_per_token(self, world_size: int = 1, rank: int | None = None) -> int:
        """Bytes of K and V per token on one rank; rank None = the rank holding the most."""
        counts = [s.num_kv_heads for s in self.head_shards(world_size)]
        kv_heads = max(counts) if rank is None else counts[rank]
        elem = self.kv_dtype.itemsize
        return 2 * self.num_layers * kv_heads * self.head_dim * elem


def check_model_len(config: WorkerConfig, mc: ModelConfig) -> None:
    """A worker refuses a max_model_len its model's positions do not reach."""
    if config.max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={mc.max_position_embeddings}; lower max_model_len")
