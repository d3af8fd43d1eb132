"""How many KV blocks a rank allocates. On CUDA: from the memory the profiling forward
leaves, or, when an earlier start with the same key measured it, from its cached figures
without running that forward (gpu_workers.peak_memory says what the key holds and why)."""

from __future__ import annotations

import os
from typing import Any

import torch

from gpu_workers.kv_cache import bytes_per_block, check_fits, cpu_num_blocks
from gpu_workers.peak_memory import (
    PeakMemory,
    cache_key,
    entry_path,
    floor_bytes,
    key_parts,
    kv_budget,
    load,
    store,
)
from gpu_workers.warm_up import ScratchRunner, measure_peak_memory
from protocol.startup_phases import PhaseClock

MEMORY_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_MODULE_LOADING",
                   "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
"""Environment settings that change what the forward allocates or leaves in use."""


def size_kv_pool(runner: ScratchRunner, rank: int, drafter) -> int:
    """The rank's block count, the same on every rank (the least), checked to hold one
    max_model_len sequence. A draft model's pool is paid from the same budget."""
    c, mc, world_size = runner.config, runner.model_config, runner.world_size
    extra = 0 if drafter is None else drafter.bytes_per_block(world_size)
    if runner.device.type == "cuda":
        blocks, cached = cuda_kv_blocks(runner, rank, extra)
        part(runner.startup, runner.device, "kv.cached-peak" if cached else "kv.profile")
    else:
        blocks = cpu_num_blocks(c, mc, world_size, extra)
    if world_size > 1:  # every rank must agree on the pool the scheduler manages
        import torch.distributed as dist

        t = torch.tensor([blocks], dtype=torch.int64, device=runner.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        blocks = int(t.item())
    check_fits(blocks, c, mc, world_size, extra)
    return blocks


def device_facts(device: torch.device) -> dict[str, Any]:
    """The GPU and the software under the forward, for the cache key."""
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "total_memory": props.total_memory,
            "capability": [props.major, props.minor], "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "env": {k: os.environ.get(k) for k in MEMORY_SETTINGS}}


def cuda_kv_blocks(runner: ScratchRunner, rank: int, extra_per_block: int) -> tuple[int, bool]:
    """The rank's block count, and whether its peak memory came from the cache."""
    c, mc = runner.config, runner.model_config
    parts = key_parts(c, mc, rank, runner.world_size, device_facts(runner.device))
    key = cache_key(parts)
    path = entry_path(key)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # Replicas sharing the GPU start side by side: what one's forward leaves in use cannot
    # be told from what the others allocate meanwhile, so they measure on every start.
    peak = None if c.gpu_share else load(path, key, floor_bytes(c, mc, mc.dtype.itemsize),
                                         total)
    cached = peak is not None
    if peak is None:
        # A first start: its kernels compile in parallel first. One rank only: a recording's
        # captures on several ranks would each hold a different share of their collectives
        # wherever one rank's capture stops early.
        if c.precompile_kernels and runner.world_size == 1:
            from gpu_workers.startup_kernels import precompile_startup_kernels

            precompile_startup_kernels(runner, key)
            part(runner.startup, runner.device, "kv.precompile")
        measured = measure_peak_memory(runner)
        if not c.gpu_share:
            store(path, key, measured, parts)
        free, total = torch.cuda.mem_get_info()  # after it: its overhead is already in use
        peak = PeakMemory(measured.transient, 0)
    budget = kv_budget(c, free, total, torch.cuda.memory_reserved(), peak)
    per_block = bytes_per_block(mc, c.block_size, runner.world_size) + extra_per_block
    return int(budget) // per_block, cached


def part(clock: PhaseClock, device: torch.device, name: str) -> None:
    """Time a part of a CUDA start-up phase (the ready line's `[kv: ...]`), the work it
    queued included; on the CPU the phases alone say enough."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clock.part(name)
