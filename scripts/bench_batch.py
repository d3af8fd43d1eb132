"""Host time to prepare one decode step for its CUDA graph, the part of a worker's launch that
runs before any device call: the mirror's plan, the sampling graph's inputs, the in-flight
token patch and the batch built into the graph's static inputs.

    python scripts/bench_batch.py [--num-seqs 1,16,150] [--reps 3000]

No model and no GPU: the batch is built for the CPU (on CUDA the same work ends in one
pinned host-to-device copy). Each figure is the median of five timed runs of --reps steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gpu_workers.batch import build_batch
from gpu_workers.cuda_graphs import bucket_sizes, input_capacities
from gpu_workers.graph_sampling import sample_inputs
from gpu_workers.mirror import SequenceTable
from gpu_workers.pending_step import pending_patch
from gpu_workers.sampler import Sampler
from gpu_workers.static_inputs import StaticInputs
from gpu_workers.token_layout import entry_offsets
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan

BLOCK_SIZE, WIDTH, PROMPT = 256, 16, 600


def decoding_table(num_seqs: int) -> tuple[SequenceTable, list[int]]:
    """num_seqs rows mid-decode at W1's temperature, each with a token in flight."""
    table = SequenceTable(num_seqs, BLOCK_SIZE * WIDTH, WIDTH, vocab_size=151_936,
                          num_blocks=num_seqs * WIDTH, block_size=BLOCK_SIZE)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
    seqs = [NewSequence(i, rng.integers(0, 10_000, PROMPT).tolist(), PROMPT, 0, PROMPT,
                        list(range(i * WIDTH, i * WIDTH + 3)), params) for i in range(num_seqs)]
    _, rows, _ = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    table.num_computed[rows] = PROMPT
    table.append_placeholders(rows)
    return table, list(range(num_seqs))


def step_time(num_seqs: int, reps: int) -> float:
    """Seconds per step to apply a decode plan and build its batch as ModelRunner does."""
    table, ids = decoding_table(num_seqs)
    sampler = Sampler("cpu", 0, one_pass=True)
    bs = next(s for s in bucket_sizes(max(num_seqs, 8)) if s >= num_seqs)
    inputs = StaticInputs(input_capacities(bs, 1, WIDTH), torch.device("cpu"))
    plan = StepPlan(1, [], [], CachedSequences(ids, [1] * num_seqs, [[]] * num_seqs))
    snapshot = table.num_computed.copy()

    def one_step() -> None:
        table.num_computed[:] = snapshot
        _, rows, num_new = table.apply(plan)
        start = table.num_computed[rows]
        drawn = sample_inputs(table, rows, sampler)
        extra = dict(drawn) | pending_patch(table, rows, start, num_new,
                                            entry_offsets(num_new, 1))
        build_batch(table, rows, num_new, BLOCK_SIZE, torch.device("cpu"), pad_to=bs,
                    block_width=WIDTH, into=inputs, extra=extra, sample=False)

    for _ in range(reps // 10):
        one_step()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            one_step()
        runs.append((time.perf_counter() - t0) / reps)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", default="1,16,150")
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args()
    for n in (int(x) for x in args.num_seqs.split(",")):
        print(f"{n:4d} sequences: {step_time(n, args.reps) * 1e6:7.1f} µs per decode step "
              f"(plan applied, graph inputs sampled and patched, batch built)", flush=True)


if __name__ == "__main__":
    main()
