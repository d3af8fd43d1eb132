"""What a user chooses when starting a pipeline, and the per-process configs derived from it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """A Hugging Face model directory; None uses the embedded SmolLM2-135M-Instruct."""
    tensor_parallel_size: int = 1
    device: str | None = None
    """"cuda" or "cpu"; None picks cuda when a GPU is visible."""
    dtype: str | None = None
    max_model_len: int | None = None
    """None: the model's own limit, capped at 4096."""
    block_size: int | None = None
    """None: 256 on cuda (short block tables; also what flash-attn's paged KV needs), 16 on cpu."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    """None: 16384 on cuda, 2048 on cpu."""
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    overlap: bool = True
    worker_lookahead: bool = False
    """Workers launch step N+1 before step N's tokens reached the host (with overlap only)."""
    transport: str = "ipc"
    """"ipc" (unix sockets in a private run directory) or "tcp"."""
    host: str = "127.0.0.1"
    """Where the public (client-facing) socket listens with tcp transport."""
    port: int | None = None
    stdout: bool = False
    """Attach a detokenizer that prints every request's text to stdout."""
    seed: int = 0
    served_model_name: str | None = None
    """The model id clients see; None uses the model directory's name."""
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @cached_property
    def model_dir(self) -> str:
        if self.model is not None:
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"{self.model!r} is not a model directory with a config.json")
            return self.model
        from frontend.embedded_model import default_model_dir

        return default_model_dir()

    @cached_property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @cached_property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model_dir))

    @cached_property
    def resolved_max_model_len(self) -> int:
        with open(os.path.join(self.model_dir, "config.json")) as f:
            hf = json.load(f)
        limit = int(hf.get("max_position_embeddings", 4096))
        if self.max_model_len is None:
            return min(limit, 4096)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        return self.max_model_len

    @property
    def resolved_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 256 if self.resolved_device == "cuda" else 16

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 16384 if self.resolved_device == "cuda" else 2048

    def worker_config(self, dist_init_method: str):
        from gpu_workers.config import WorkerConfig

        return WorkerConfig(
            model=self.model_dir,
            device=self.resolved_device,
            dtype=self.dtype,
            max_model_len=self.resolved_max_model_len,
            block_size=self.resolved_block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.resolved_max_num_batched_tokens,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_bytes=self.kv_cache_bytes,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            dist_init_method=dist_init_method,
            seed=self.seed,
            lookahead=self.worker_lookahead and self.overlap,
        )

    def tokenizer_config(self):
        from frontend.actors.tokenizer import TokenizerConfig

        return TokenizerConfig(model=self.model_dir, model_name=self.model_name,
                               max_model_len=self.resolved_max_model_len)

    def detokenizer_config(self):
        from frontend.actors.detokenizer import DetokenizerConfig

        return DetokenizerConfig(model=self.model_dir)

    def scheduler_config(self, num_kv_blocks: int):
        from scheduler_proc.config import SchedulerConfig

        return SchedulerConfig(
            num_kv_blocks=num_kv_blocks,
            block_size=self.resolved_block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.resolved_max_num_batched_tokens,
            max_model_len=self.resolved_max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            overlap=self.overlap,
        )
