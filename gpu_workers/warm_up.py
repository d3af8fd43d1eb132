"""Scratch steps a CUDA runner takes at start-up, on tables of their own: one that measures
the peak activation memory (the KV cache gets what is left), one per shape the Triton kernels
specialise on (so the first requests do not pay seconds of JIT compilation). The kernel that
applies structured outputs' token bitmask is not among them: it needs xgrammar, whose import
(transformers with it) took seconds of every start on an H200 host, for a kernel that
compiles once per Triton cache; the first constrained step compiles it, beside the grammar
compiler that the first structured request loads anyway (gpu_workers.token_bitmask).

They take the runner as a ScratchRunner, what they use of it, so this module needs nothing of
gpu_workers.model_runner, which calls them while it starts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_workers.config import ModelConfig, WorkerConfig
from gpu_workers.kv_cache import KVCache
from gpu_workers.models import CausalLM
from gpu_workers.peak_memory import PeakMemory
from gpu_workers.sequence_table import SequenceTable
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan, StepResult
from protocol.startup_phases import PhaseClock


class ScratchRunner(Protocol):
    """What the scratch steps use of a ModelRunner."""

    config: WorkerConfig
    model_config: ModelConfig
    model: CausalLM
    device: torch.device
    world_size: int
    num_kv_blocks: int
    startup: PhaseClock

    def new_table(self, num_blocks: int | None = None) -> SequenceTable: ...

    def run_on(self, plan: StepPlan, table: SequenceTable) -> StepResult | None: ...


def peak_step(c: WorkerConfig) -> tuple[list[NewSequence], int]:
    """The largest step the scheduler may send (the widest sampling batch too, with the
    costliest sampling path), and the KV blocks it writes."""
    total = c.max_num_batched_tokens
    n = max(1, min(c.max_num_seqs, total))
    lens = [total // n + (i < total % n) for i in range(n)]
    lens = [min(max(1, x), c.max_model_len) for x in lens]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05,
                            repetition_penalty=1.1, frequency_penalty=0.1)
    seqs, next_block = [], 0
    for i, length in enumerate(lens):
        nb = -(-length // c.block_size)
        seqs.append(NewSequence(i, [0] * length, length, 0, length,
                                list(range(next_block, next_block + nb)), params))
        next_block += nb
    return seqs, next_block


def warm_up_steps(c: WorkerConfig, num_blocks: int) -> list[list[NewSequence]]:
    """One prefill per shape the Triton kernels specialise on (counts of 1, multiples of 16,
    others), each sequence then decoding one token; within num_blocks blocks."""
    shapes = [[1], [c.max_model_len - 1], [17, 5, 64], [16] * 16, [3] * 17]
    params = SamplingParams(temperature=0.0)
    steps = []
    for lens in shapes:
        lens = [max(1, min(n, c.max_model_len - 1, c.max_num_batched_tokens // len(lens)))
                for n in lens]
        seqs, next_block = [], 0
        for i, n in enumerate(lens):
            nb = -(-(n + 1) // c.block_size)
            if next_block + nb > num_blocks:
                break
            seqs.append(NewSequence(i, [0] * n, n, 0, n, list(range(next_block,
                                                                  next_block + nb)), params))
            next_block += nb
        steps.append(seqs)
    return steps


def prefill_plan(seqs: list[NewSequence]) -> StepPlan:
    return StepPlan(0, [], seqs, CachedSequences([], [], []))


def decode_plan(seqs: list[NewSequence]) -> StepPlan:
    """The step after prefill_plan(seqs): each sequence decodes its sampled token."""
    ids = [s.seq_id for s in seqs]
    return StepPlan(1, [], [], CachedSequences(ids, [1] * len(ids), [[] for _ in ids]))


@torch.inference_mode()
def measure_peak_memory(runner: ScratchRunner) -> PeakMemory:
    """Run the largest batch the scheduler may send, so the peak activation memory is known:
    the step's transient bytes, and the device memory it left in use (see PeakMemory)."""
    seqs, blocks = peak_step(runner.config)
    # The peak counter is per process: forget what freed tensors (another runner, weights'
    # staging copies) once reached, so only this forward's transient memory is counted.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, _ = torch.cuda.mem_get_info()
    kv = KVCache(runner.model_config, blocks, runner.config.block_size, runner.device)
    kv.bind(runner.model.attention_layers())
    runner.run_on(prefill_plan(seqs), runner.new_table())
    torch.cuda.synchronize()
    del kv
    torch.cuda.empty_cache()
    stats = torch.cuda.memory_stats()
    free_after, _ = torch.cuda.mem_get_info()
    return PeakMemory(
        transient=stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"],
        overhead=max(0, free_before - free_after))


@torch.inference_mode()
def warm_up_kernels(runner: ScratchRunner) -> None:
    """Compile the Triton kernels for the shapes they specialise on. The scratch steps write
    KV into blocks that no sequence holds yet."""
    for seqs in warm_up_steps(runner.config, runner.num_kv_blocks):
        table = runner.new_table()
        runner.run_on(prefill_plan(seqs), table)
        runner.run_on(decode_plan(seqs), table)
    torch.cuda.synchronize()
