"""The model runtime: one GPU (or CPU) worker per tensor-parallel rank.

Its exports load on first use, so that the launcher reads the worker's settings
(gpu_workers.config) without importing torch and the kernels: seconds of start-up before
the first process could start.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpu_workers.kernels_package import refuse_foreign_kernels

# First: a foreign package named `kernels` is refused before any module here imports from it.
refuse_foreign_kernels()

_EXPORTS = {
    "KVCacheTooSmall": "gpu_workers.kv_cache",
    "ModelConfig": "gpu_workers.config",
    "ModelRunner": "gpu_workers.model_runner",
    "WorkerConfig": "gpu_workers.config",
}
__all__ = ["KVCacheTooSmall", "ModelConfig", "ModelRunner", "WorkerConfig"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpu_workers' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
