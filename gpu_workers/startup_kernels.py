"""A first start's Triton kernels, compiled in parallel before its scratch steps run.

On a start that has not run before with this configuration (no entry in nanopipe's cache
for its key, the peak-memory key: gpu_workers.peak_memory), the start-up's scratch steps
(the profiling step and the warm-up's: gpu_workers.warm_up) are first run with Triton's
compiles skipped and written down (gpu_workers.kernel_precompile), inside a CUDA graph
capture that is thrown away: the device runs none of it, so what the skipped kernels would
have written is never read. The variants found are compiled by a pool of processes into
Triton's cache; the scratch steps then load them from there. A step whose capture fails
(an operation a capture refuses) loses only the variants after the failure: they compile
when first used, as without this. The entry written afterwards lists the variants.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from gpu_workers.kernel_precompile import (
    CompilePool,
    KernelSpec,
    SpecRecorder,
    describe,
    process_count,
)
from gpu_workers.kv_cache import KVCache
from gpu_workers.peak_memory import cache_root
from gpu_workers.pending_step import PendingStep
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.warm_up import (
    ScratchRunner,
    decode_plan,
    peak_step,
    prefill_plan,
    warm_up_steps,
)
from protocol import StepPlan

log = logging.getLogger("nanopipe.worker")
FOLDER = "kernels"


class RecordingRunner(ScratchRunner, Protocol):
    def launch_on(self, plan: StepPlan, table: SequenceTable) -> PendingStep: ...


def marker_path(key: str, root: Path | None = None) -> Path:
    """This configuration's entry, per Triton cache folder (an emptied or other Triton cache
    compiles again)."""
    from triton import knobs

    folder = hashlib.sha256(str(knobs.cache.dir).encode()).hexdigest()[:8]
    return (root or cache_root()) / FOLDER / f"{key[:32]}-{folder}.jsonl"


def precompile_startup_kernels(runner: RecordingRunner, key: str) -> int:
    """Record and compile the start-up's kernels unless this key's entry says they were;
    the number of variants compiled."""
    path = marker_path(key)
    if path.exists():
        return 0
    try:
        with CompilePool(process_count(runner.world_size)) as pool:  # starting meanwhile
            specs = record_startup_kernels(runner)
            report = pool.compile(specs)
    except Exception as exc:  # noqa: BLE001 - the steps then compile as without it
        log.warning("precompiling the start-up's kernels failed: %s", exc)
        return 0
    log.info("compiled %d kernel variants in %.1f s on %d processes", report.compiled,
             report.seconds, pool.processes)
    if not report.failed:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(describe(specs))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("kernel precompile: could not write %s: %s", path, exc)
    return report.compiled


@torch.inference_mode()
def record_startup_kernels(runner: RecordingRunner) -> list[KernelSpec]:
    """The Triton kernel variants the scratch steps launch, found without compiling or
    running them."""
    c = runner.config
    peak, blocks = peak_step(c)
    warm = warm_up_steps(c, 1 << 62)  # every shape whole, as the pool that serves holds them
    blocks = max(blocks, *(sum(len(s.block_table) for s in seqs) for seqs in warm))
    kv = KVCache(runner.model_config, blocks, c.block_size, runner.device)
    kv.bind(runner.model.attention_layers())
    stream = torch.cuda.Stream(runner.device)
    with SpecRecorder() as recorder:
        for plans in [[prefill_plan(peak)], *([prefill_plan(s), decode_plan(s)] for s in warm)]:
            table = runner.new_table()
            for plan in plans:
                if not _record_step(runner, plan, table, stream):
                    break
    del kv
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    return list(recorder.specs.values())


def _record_step(runner: RecordingRunner, plan: StepPlan, table: SequenceTable,
                 stream: torch.cuda.Stream) -> bool:
    """Launch one step inside a throwaway capture on `stream`; its sampled tokens are
    settled as zeros (nothing ran), so a next step can continue its sequences."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="relaxed"):
            pending = runner.launch_on(plan, table)
    except Exception as exc:  # noqa: BLE001 - what it cost is only the rest of this step
        log.debug("kernel precompile: a scratch step's capture stopped: %s", exc)
        return False
    finally:
        del graph
    if len(pending.rows):
        table.fill_tokens(pending.rows, pending.positions, pending.epochs,
                          np.zeros(len(pending.rows), np.int64))
    return True
