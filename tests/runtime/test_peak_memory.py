"""The profiling forward's figures kept in nanopipe's cache: a warm start sizes the KV pool
from them without the forward, a changed key or a bad entry measures again (never trusted
into a larger pool), and both ways size the same pool. CUDA's memory queries are played by
a fake device here; tests/runtime/test_gpu_peak_memory.py runs the real one."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from gpu_workers import ModelConfig, WorkerConfig, cuda_sizing
from gpu_workers.kv_cache import bytes_per_block
from gpu_workers.peak_memory import PeakMemory, cache_key, entry_path, key_parts, kv_budget

GIB = 2**30


class _Device:
    """A GPU's memory as torch.cuda reports it; the profiling forward leaves `overhead` in use."""

    def __init__(self, monkeypatch, total=80 * GIB, used=10 * GIB, transient=3 * GIB,
                 overhead=GIB // 2) -> None:
        self.total, self.used, self.transient, self.overhead = total, used, transient, overhead
        self.measured = 0
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (self.total - self.used,
                                                                     self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.used)
        monkeypatch.setattr(cuda_sizing, "device_facts", lambda device: {"name": "fake"})
        monkeypatch.setattr(cuda_sizing, "measure_peak_memory", self.measure)

    def measure(self, runner) -> PeakMemory:
        self.measured += 1
        self.used += self.overhead
        return PeakMemory(self.transient, self.overhead)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _runner(model_dir: str, **overrides):
    # No parallel compile ahead of the fake forward: it records real launches
    # (tests/runtime/test_startup_kernels_gpu.py runs it).
    config = WorkerConfig(**{"model": model_dir, "device": "cuda", "dtype": "float32",
                             "max_num_batched_tokens": 4096, "precompile_kernels": False,
                             **overrides})
    return SimpleNamespace(config=config, model_config=ModelConfig.for_worker(config),
                           world_size=1, device=torch.device("cpu"))


def _entry(runner) -> tuple[str, object]:
    parts = key_parts(runner.config, runner.model_config, 0, 1, {"name": "fake"})
    key = cache_key(parts)
    return key, entry_path(key)


def test_a_warm_start_sizes_the_same_pool_without_the_forward(tiny_qwen3_dir, cache,
                                                               monkeypatch):
    gpu = _Device(monkeypatch)
    runner = _runner(tiny_qwen3_dir)
    blocks, cached = cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    assert (gpu.measured, cached) == (1, False)
    per_block = bytes_per_block(runner.model_config, runner.config.block_size, 1)
    assert blocks == int(80 * GIB * 0.9 - 10.5 * GIB - 3 * GIB) // per_block
    _, path = _entry(runner)
    assert json.loads(path.read_text())["transient"] == 3 * GIB
    gpu.used = 10 * GIB  # a new process: the forward's overhead is not in use yet
    assert cuda_sizing.cuda_kv_blocks(runner, 0, 0) == (blocks, True)
    assert gpu.measured == 1


@pytest.mark.parametrize("change", [dict(max_num_batched_tokens=8192), dict(max_num_seqs=8),
                                    dict(kv_cache_dtype="fp8"), dict(dtype="bfloat16")])
def test_a_change_to_what_the_forward_allocates_measures_again(tiny_qwen3_dir, cache,
                                                               monkeypatch, change):
    gpu = _Device(monkeypatch)
    cuda_sizing.cuda_kv_blocks(_runner(tiny_qwen3_dir), 0, 0)
    gpu.used = 10 * GIB
    other = _runner(tiny_qwen3_dir, **change)
    assert cuda_sizing.cuda_kv_blocks(other, 0, 0)[1] is False
    assert gpu.measured == 2


def test_the_run_specific_settings_keep_the_entry(tiny_qwen3_dir, cache, monkeypatch):
    gpu = _Device(monkeypatch)
    runner = _runner(tiny_qwen3_dir)
    cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    gpu.used = 10 * GIB
    runner.config = replace(runner.config, gpu_memory_utilization=0.5, seed=7,
                            dist_init_method="tcp://127.0.0.1:5")
    blocks, cached = cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    assert cached and gpu.measured == 1
    per_block = bytes_per_block(runner.model_config, runner.config.block_size, 1)
    assert blocks == int(80 * GIB * 0.5 - 10.5 * GIB - 3 * GIB) // per_block
    # Another rank or GPU is another entry.
    assert cache_key(key_parts(runner.config, runner.model_config, 1, 2, {"name": "fake"})) \
        != cache_key(key_parts(runner.config, runner.model_config, 0, 1, {"name": "fake"}))
    assert cache_key(key_parts(runner.config, runner.model_config, 0, 1, {"name": "other"})) \
        != cache_key(key_parts(runner.config, runner.model_config, 0, 1, {"name": "fake"}))


@pytest.mark.parametrize("bad", [
    "{not json", "[]", '{"format": 1}',
    "SAME_KEY_NEGATIVE", "SAME_KEY_TOO_SMALL", "SAME_KEY_TOO_LARGE", "FOREIGN_KEY"])
def test_a_bad_entry_is_measured_again_and_replaced(tiny_qwen3_dir, cache, monkeypatch, bad):
    gpu = _Device(monkeypatch)
    runner = _runner(tiny_qwen3_dir)
    key, path = _entry(runner)
    entries = {"SAME_KEY_NEGATIVE": (key, -1), "SAME_KEY_TOO_SMALL": (key, 1024),
               "SAME_KEY_TOO_LARGE": (key, 80 * GIB), "FOREIGN_KEY": ("0" * 64, 3 * GIB)}
    if bad in entries:
        k, transient = entries[bad]
        bad = json.dumps({"format": 1, "key": k, "transient": transient, "overhead": 0})
    path.parent.mkdir(parents=True)
    path.write_text(bad)
    blocks, cached = cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    assert (cached, gpu.measured) == (False, 1)
    per_block = bytes_per_block(runner.model_config, runner.config.block_size, 1)
    assert blocks == int(80 * GIB * 0.9 - 10.5 * GIB - 3 * GIB) // per_block
    assert json.loads(path.read_text())["key"] == key


def test_an_overhead_that_is_another_process_allocating_is_never_kept(tiny_qwen3_dir, cache,
                                                                     monkeypatch):
    """A sibling replica allocating its pool while this forward ran shows up in the
    device-wide free memory as this forward's overhead: stored, it would size every warm
    start's pool to nothing. Above the ceiling it is neither stored nor trusted."""
    gpu = _Device(monkeypatch, overhead=40 * GIB)
    runner = _runner(tiny_qwen3_dir)
    _, path = _entry(runner)
    cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    assert gpu.measured == 1 and not path.exists()
    key, _ = _entry(runner)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "key": key, "transient": 3 * GIB,
                                "overhead": 40 * GIB}))
    gpu.used, gpu.overhead = 10 * GIB, GIB // 2
    blocks, cached = cuda_sizing.cuda_kv_blocks(runner, 0, 0)
    assert (cached, gpu.measured) == (False, 2)
    per_block = bytes_per_block(runner.model_config, runner.config.block_size, 1)
    assert blocks == int(80 * GIB * 0.9 - 10.5 * GIB - 3 * GIB) // per_block


def test_replicas_sharing_a_gpu_measure_on_every_start(tiny_qwen3_dir, cache, monkeypatch):
    gpu = _Device(monkeypatch)
    runner = _runner(tiny_qwen3_dir, gpu_share=True, gpu_memory_utilization=0.45)
    _, path = _entry(runner)
    for start in (1, 2):
        gpu.used = 10 * GIB
        _, cached = cuda_sizing.cuda_kv_blocks(runner, 0, 0)
        assert (cached, gpu.measured) == (False, start)
    assert not path.exists()


def test_a_cache_that_cannot_be_written_only_costs_the_forward(tiny_qwen3_dir, tmp_path,
                                                               monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NANOPIPE_CACHE", str(blocker))
    gpu = _Device(monkeypatch)
    runner = _runner(tiny_qwen3_dir)
    assert cuda_sizing.cuda_kv_blocks(runner, 0, 0)[1] is False
    assert cuda_sizing.cuda_kv_blocks(runner, 0, 0)[1] is False
    assert gpu.measured == 2


def test_the_budget_with_cached_figures_is_the_measured_one(tiny_qwen3_dir):
    config = WorkerConfig(model=tiny_qwen3_dir, device="cuda", gpu_memory_utilization=0.8)
    peak = PeakMemory(transient=2 * GIB, overhead=GIB)
    measured = kv_budget(config, free=69 * GIB, total=100 * GIB, reserved=31 * GIB,
                         peak=PeakMemory(2 * GIB, 0))
    cached = kv_budget(config, free=70 * GIB, total=100 * GIB, reserved=30 * GIB, peak=peak)
    assert measured == cached == 80 * GIB - 31 * GIB - 2 * GIB
    shared = replace(config, gpu_share=True)
    assert kv_budget(shared, free=20 * GIB, total=100 * GIB, reserved=30 * GIB, peak=peak) \
        == pytest.approx(19 * GIB * 0.95)
    capped = replace(config, kv_cache_bytes=GIB)
    assert kv_budget(capped, free=70 * GIB, total=100 * GIB, reserved=30 * GIB, peak=peak) == GIB
    assert kv_budget(config, free=GIB, total=100 * GIB, reserved=99 * GIB, peak=peak) == 0.0


def test_the_floor_counts_the_tokens_the_forward_runs(tiny_qwen3_dir):
    from gpu_workers.peak_memory import floor_bytes

    config = WorkerConfig(model=tiny_qwen3_dir, device="cuda", max_num_batched_tokens=16384,
                          max_num_seqs=2, max_model_len=256)
    mc = ModelConfig.for_worker(config)
    assert floor_bytes(config, mc, 2) == 2 * 512 * mc.hidden_size * 2
    wide = replace(config, max_num_seqs=256)
    assert floor_bytes(wide, mc, 2) == 2 * 16384 * mc.hidden_size * 2
