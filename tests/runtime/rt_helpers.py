"""Shared helpers for runtime tests: a ModelRunner on the CPU with small limits."""

from __future__ import annotations

from gpu_workers import ModelRunner, WorkerConfig

BLOCK_SIZE = 16


def make_runner(model_dir: str, rank: int = 0, world_size: int = 1, **overrides) -> ModelRunner:
    kw = dict(model=model_dir, device="cpu", dtype="float32", max_model_len=256,
              block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=1024,
              kv_cache_bytes=2 << 20)
    kw.update(overrides)
    return ModelRunner(WorkerConfig(**kw), rank, world_size)
