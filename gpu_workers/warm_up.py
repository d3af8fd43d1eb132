"""Scratch steps a CUDA runner takes at start-up, on tables of their own: one that measures
the peak activation memory (the KV cache gets what is left), one per shape the Triton kernels
specialise on (so the first requests do not pay seconds of JIT compilation); on rank 0 also
the kernel that applies structured outputs' token bitmask (gpu_workers.token_bitmask).

They take the runner as a ScratchRunner, what they use of it, so this module needs nothing of
gpu_workers.model_runner, which calls them while it starts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_workers.config import ModelConfig, WorkerConfig
from gpu_workers.grammar_book import GrammarBook
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
    grammars: GrammarBook | None
    startup: PhaseClock

    def new_table(self, num_blocks: int | None = None) -> SequenceTable: ...

    def run_on(self, plan: StepPlan, table: SequenceTable) -> StepResult | None: ...


@torch.inference_mode()
def measure_peak_memory(runner: ScratchRunner) -> PeakMemory:
    """Run the largest batch the scheduler may send, so the peak activation memory is known:
    the step's transient bytes, and the device memory it left in use (see PeakMemory)."""
    c = runner.config
    total = c.max_num_batched_tokens
    n = max(1, min(c.max_num_seqs, total))  # the widest sampling batch too
    lens = [total // n + (i < total % n) for i in range(n)]
    lens = [min(max(1, x), c.max_model_len) for x in lens]
    blocks_needed = [-(-x // c.block_size) for x in lens]
    # The peak counter is per process: forget what freed tensors (another runner, weights'
    # staging copies) once reached, so only this forward's transient memory is counted.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, _ = torch.cuda.mem_get_info()
    kv = KVCache(runner.model_config, sum(blocks_needed), c.block_size, runner.device)
    kv.bind(runner.model.attention_layers())
    seqs, next_block = [], 0
    # The costliest sampling path, so its transient memory is part of the measured peak.
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05,
                            repetition_penalty=1.1, frequency_penalty=0.1)
    for i, (length, nb) in enumerate(zip(lens, blocks_needed, strict=True)):
        block_table = list(range(next_block, next_block + nb))
        next_block += nb
        seqs.append(NewSequence(i, [0] * length, length, 0, length, block_table, params))
    runner.run_on(StepPlan(0, [], seqs, CachedSequences([], [], [])), runner.new_table())
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
    """Compile the Triton kernels for the shapes they specialise on (counts of 1, multiples
    of 16, others). The scratch steps write KV into blocks that no sequence holds yet."""
    c = runner.config
    bs = c.block_size
    shapes = [[1], [c.max_model_len - 1], [17, 5, 64], [16] * 16, [3] * 17]
    params = SamplingParams(temperature=0.0)
    for lens in shapes:
        lens = [max(1, min(n, c.max_model_len - 1, c.max_num_batched_tokens // len(lens)))
                for n in lens]
        table = runner.new_table()
        seqs, next_block = [], 0
        for i, n in enumerate(lens):
            nb = -(-(n + 1) // bs)
            if next_block + nb > runner.num_kv_blocks:
                break
            seqs.append(NewSequence(i, [0] * n, n, 0, n, list(range(next_block,
                                                                  next_block + nb)), params))
            next_block += nb
        runner.run_on(StepPlan(0, [], seqs, CachedSequences([], [], [])), table)
        ids = [s.seq_id for s in seqs]
        runner.run_on(StepPlan(1, [], [], CachedSequences(ids, [1] * len(ids),
                                                          [[] for _ in ids])), table)
    if runner.grammars is not None:  # the logits' dtype and row stride (the padded vocab)
        stride = runner.model.lm_head.shard * runner.world_size
        runner.grammars.bitmask.warm_up(runner.device, runner.model_config.dtype, stride)
    torch.cuda.synchronize()
