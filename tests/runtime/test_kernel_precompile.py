"""Start-up's parallel kernel compile, without a GPU: Triton compiles for an H100/H200 target
(sm_90) on the CPU, so recording variants, compiling them on a pool of processes and finding
them in Triton's cache afterwards all run here. (The recording inside a CUDA graph capture,
and the start-up that uses it, are tested on the GPU: tests/runtime/test_startup_kernels_gpu.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

RECORD_AND_COMPILE = """
import json, sys
import torch
from triton import knobs
from gpu_workers.kernel_precompile import SpecRecorder, _use_target, precompile

_use_target(("cuda", 90, 32))
from kernels.rms_norm import _rms_norm_kernel as kernel

x = torch.zeros(4, 256, dtype=torch.float16)  # the binder reads only pointers and dtypes
before = knobs.runtime.jit_cache_hook
with SpecRecorder() as recorder:
    launched = [kernel[(4,)](x, x, x[0], x, x, 256, 1e-6, 256, 256, 256, 256,
                             HAS_RESIDUAL=True, BLOCK=block, num_warps=2)
                for block in (256, 512, 256)]
report = precompile(recorder.specs.values(), processes=2)
print(json.dumps({"launched": [k is not None for k in launched],
                  "specs": len(recorder.specs), "compiled": report.compiled,
                  "failed": report.failed,
                  "hook_restored": knobs.runtime.jit_cache_hook is before}))
"""

COMPILE_AGAIN = """
import json, os, time
import torch
from gpu_workers.kernel_precompile import _use_target

_use_target(("cuda", 90, 32))
from kernels.rms_norm import _rms_norm_kernel as kernel

x = torch.zeros(4, 256, dtype=torch.float16)
for block in (256, 512):  # compile (or find in the cache) exactly as a step would
    kernel.run(x, x, x[0], x, x, 256, 1e-6, 256, 256, 256, 256, HAS_RESIDUAL=True,
               BLOCK=block, num_warps=2, grid=(4,), warmup=True)
print(json.dumps({"ok": True}))
"""


def _run(script: str, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_recorded_variants_compile_on_a_pool_into_the_cache_a_step_then_reads(tmp_path):
    cache = tmp_path / "triton"
    got = _run(RECORD_AND_COMPILE, cache)
    # Recording skipped every launch, kept each variant once, and put Triton's hook back.
    assert got["launched"] == [False, False, False]
    assert got["specs"] == 2
    assert got["compiled"] == 2 and got["failed"] == []
    assert got["hook_restored"]
    compiled = _entries(cache)
    assert sum(name.endswith(".cubin") for name in compiled) == 2
    # A later process needing the same variants compiles nothing: they are Triton's cache hits.
    _run(COMPILE_AGAIN, cache)
    assert _entries(cache) == compiled


@pytest.mark.slow
def test_a_variant_that_cannot_be_found_fails_alone(tmp_path):
    from gpu_workers.kernel_precompile import KernelSpec, precompile

    env_before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path)
    try:
        report = precompile([KernelSpec("kernels.rms_norm", "no_such_kernel", "{}",
                                        ("cuda", 90, 32))], processes=1)
    finally:
        if env_before is None:
            os.environ.pop("TRITON_CACHE_DIR")
        else:
            os.environ["TRITON_CACHE_DIR"] = env_before
    assert report.compiled == 0
    assert len(report.failed) == 1 and "no_such_kernel" in report.failed[0]


def test_pool_size_shares_the_cpus_among_the_ranks():
    from gpu_workers.kernel_precompile import MAX_PROCESSES, process_count

    assert process_count(1, cpus=16) == MAX_PROCESSES
    assert process_count(2, cpus=16) == 8
    assert process_count(4, cpus=16) == 4
    assert process_count(8, cpus=2) == 1


def test_a_start_whose_variants_are_listed_records_nothing(tmp_path, monkeypatch):
    from gpu_workers import startup_kernels

    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path))
    path = startup_kernels.marker_path("k" * 64)
    path.parent.mkdir(parents=True)
    path.write_text("")
    untouchable = object()  # recording would read its config
    assert startup_kernels.precompile_startup_kernels(untouchable, "k" * 64) == 0


def test_a_recording_that_fails_leaves_the_start_up_to_compile_as_before(tmp_path, monkeypatch,
                                                                          caplog):
    from types import SimpleNamespace

    from gpu_workers import startup_kernels

    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path))
    monkeypatch.setattr(startup_kernels, "process_count", lambda ranks: 1)
    runner = SimpleNamespace(world_size=1)  # no config: the recording fails at once
    assert startup_kernels.precompile_startup_kernels(runner, "f" * 64) == 0
    assert "precompiling the start-up's kernels failed" in caplog.text
    assert not startup_kernels.marker_path("f" * 64).exists()
