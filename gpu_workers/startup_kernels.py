"""A first start's Triton kernels, compiled in parallel before its scratch steps run.

On a start that has not run before with this configuration (no entry in nanopipe's cache for
its key, the peak-memory key: gpu_workers.peak_memory), the start-up's scratch steps (the
profiling step and the warm-up's: gpu_workers.warm_up) and each CUDA graph's first forward
(gpu_workers.step_graphs) are first run with Triton's compiles skipped and written down
(gpu_workers.kernel_precompile), inside CUDA graph captures that are thrown away: the device
runs none of it, so what the skipped kernels would have written is never read. The variants
found are compiled by a pool of processes into Triton's cache; the scratch steps then load
them from there. A step whose capture fails (an operation a capture refuses) loses only the
variants after the failure: they compile when first used, as without this. The entry written
afterwards lists the variants.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from gpu_workers.graph_sampling import graph_samplers
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
from gpu_workers.sampler import Sampler
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.step_graphs import StepGraphs
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
    sampler: Sampler

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
    """The Triton kernel variants the scratch steps and the graphs' warm-ups launch, found
    without compiling or running them."""
    c = runner.config
    peak, blocks = peak_step(c)
    warm = warm_up_steps(c, 1 << 62)  # every shape whole, as the pool that serves holds them
    blocks = max(blocks, *(sum(len(s.block_table) for s in seqs) for seqs in warm))
    kv = KVCache(runner.model_config, blocks, c.block_size, runner.device)
    kv.bind(runner.model.attention_layers())
    capture = partial(_captured, torch.cuda.Stream(runner.device),
                      (runner.sampler.generator, runner.sampler.row_generator))
    torch.cuda.synchronize(runner.device)
    with SpecRecorder() as recorder:
        for plans in [[prefill_plan(peak)], *([prefill_plan(s), decode_plan(s)] for s in warm)]:
            table = runner.new_table()
            for plan in plans:
                if not capture(partial(_launch_settled, runner, plan, table)):
                    break
        for warm_up in _graph_warm_ups(runner):
            capture(warm_up)
    KVCache.unbind(runner.model.attention_layers())  # the peak measured next must not see it
    del kv
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    return list(recorder.specs.values())


def _graph_warm_ups(runner: RecordingRunner) -> list[Callable[[], object]]:
    """What capturing the CUDA graphs launches first, per graph (none with enforce_eager)."""
    if runner.config.enforce_eager:
        return []
    samplers = graph_samplers(runner.model, runner.sampler, runner.world_size, masks=False)
    graphs = StepGraphs(runner.model, runner.config, runner.device, lambda text: None,
                        capture=False, **samplers)
    return graphs.warm_ups()


def _captured(stream: torch.cuda.Stream, generators: tuple[torch.Generator, ...],
              launch: Callable[[], object]) -> bool:
    """Run `launch` inside a capture on `stream` that is thrown away (nothing executes);
    False where the capture stopped (what `launch` had left to launch is not recorded).
    The sampler's `generators` are registered with it, as a capture requires of any
    generator used inside it (their state outside captures is left as it was). No
    synchronize or cache emptying around it, as torch.cuda.graph does: nothing it captures
    ever runs."""
    graph = torch.cuda.CUDAGraph()
    try:
        for generator in generators:
            graph.register_generator_state(generator)
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="relaxed")
            try:
                launch()
            finally:
                graph.capture_end()
    except Exception as exc:  # noqa: BLE001 - what it cost is only the rest of this launch
        log.debug("kernel precompile: a capture stopped: %s", exc)
        return False
    finally:
        del graph
    return True


def _launch_settled(runner: RecordingRunner, plan: StepPlan, table: SequenceTable) -> None:
    """Launch a scratch step and settle its sampled tokens as zeros (nothing ran), so a next
    step can continue its sequences."""
    pending = runner.launch_on(plan, table)
    if len(pending.rows):
        table.fill_tokens(pending.rows, pending.positions, pending.epochs,
                          np.zeros(len(pending.rows), np.int64))
