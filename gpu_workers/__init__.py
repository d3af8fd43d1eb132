"""The model runtime: one GPU (or CPU) worker per tensor-parallel rank."""

# First: gpu_workers.ops refuses a foreign package named `kernels` before any module here
# imports from it.
import gpu_workers.ops  # noqa: F401
from gpu_workers.config import ModelConfig, WorkerConfig
from gpu_workers.kv_cache import KVCacheTooSmall
from gpu_workers.model_runner import ModelRunner

__all__ = ["KVCacheTooSmall", "ModelConfig", "ModelRunner", "WorkerConfig"]
