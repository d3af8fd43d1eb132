"""Compiled kernels outlive the process that compiled them: nothing in the engine points
Triton at a cache of its own (a per-run directory would recompile every kernel at every
start-up, tens of seconds on a GPU), so Triton keeps its per-user cache (docs/startup.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("frontend", "scheduler_proc", "gpu_workers", "kernels", "protocol")
CACHE_SETTINGS = ("TRITON_CACHE_DIR", "TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR")
MEASURES_COLD_STARTS = "frontend/bench/common/cold_caches.py"
"""The benchmark tool's empty caches for a measured server's cold start (its child only)."""


def test_no_library_module_moves_the_kernel_caches():
    found = [f"{path.relative_to(ROOT)}: {name}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for name in CACHE_SETTINGS if name in path.read_text()
             if path.relative_to(ROOT).as_posix() != MEASURES_COLD_STARTS]
    assert not found, f"the compile caches are moved by: {found}"
