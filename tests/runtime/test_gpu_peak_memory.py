"""On CUDA: the start-up parts; a second runner with the same configuration sizes its KV
pool from the figures the first one's profiling forward stored, without that forward, to the
same pool (less the memory the first forward already left in use in this process), and
generates the same; the host tier pinned in idle time. A first start that compiles its kernels
in parallel first sizes the same pool as one that does not."""

from __future__ import annotations

import gc

import pytest
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

pytestmark = pytest.mark.gpu


def _greedy(runner, prompts, max_tokens=8):
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(prompts):
        planner.add(i, p, max_tokens)
    return planner.run(runner)


def test_a_cached_peak_sizes_the_pool_without_the_profiling_forward(tiny_qwen3_dir, tmp_path,
                                                                    monkeypatch):
    import torch

    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path))
    kw = dict(device="cuda", kv_cache_bytes=None, gpu_memory_utilization=0.5,
              max_num_batched_tokens=2048, kv_offloading_size=0.25)
    first = make_runner(tiny_qwen3_dir, **kw)
    assert [p.name for p in first.startup.parts] == ["kv.profile", "kv.pool"]
    prompts = random_prompts(3, [5, 9, 17, 30])
    expected, blocks = _greedy(first, prompts), first.num_kv_blocks
    del first
    gc.collect()
    torch.cuda.empty_cache()
    second = make_runner(tiny_qwen3_dir, **kw)
    assert second.startup.parts[0].name == "kv.cached-peak"
    # Never more than measured (what the first left in use here only makes it smaller).
    assert 0.95 * blocks <= second.num_kv_blocks <= blocks * 1.005
    assert _greedy(second, prompts) == expected
    # The host tier is usable at once; the worker's idle time pins it a slice at a time.
    assert second.mover is not None and second.host_tier.pinning
    while second.host_tier.pin_idle():
        pass
    assert not second.host_tier.pinning and second.mover.host_pool.is_pinned()
    assert second.num_host_slots == second.mover.host_pool.shape[0] > 0


def test_compiling_the_kernels_first_leaves_the_kv_sizing_as_it_was(tiny_qwen3_dir, tmp_path,
                                                                     monkeypatch):
    import torch

    kw = dict(device="cuda", kv_cache_bytes=None, gpu_memory_utilization=0.5,
              max_num_batched_tokens=2048, kv_offloading_size=0)
    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path / "plain"))
    plain = make_runner(tiny_qwen3_dir, **kw)
    blocks = plain.num_kv_blocks
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path / "precompiled"))
    first = make_runner(tiny_qwen3_dir, precompile_kernels=True, **kw)
    assert [p.name for p in first.startup.parts][:2] == ["kv.precompile", "kv.profile"]
    assert 0.95 * blocks <= first.num_kv_blocks <= blocks * 1.005
