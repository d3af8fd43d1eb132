"""Sampling inside the decode CUDA graphs: which batches the captured sampler may draw, the
inputs the host makes for it, and (on a GPU) that a step drawn in the graph gives the tokens
that sampling after the graph gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler_fast import batch, logits

from gpu_workers.decode_graphs import DecodeGraphs
from gpu_workers.graph_sampling import graph_sample_inputs, sample_inputs
from gpu_workers.sampler import Sampler, row_seed
from gpu_workers.sequence_table import SequenceTable
from kernels.sampling import sample_from_logits
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan


def decoding(*params: SamplingParams, prompt: int = 6, generated: int = 3
             ) -> tuple[SequenceTable, np.ndarray]:
    """A mirror whose rows (one per params) each decode their next token this step."""
    table = SequenceTable(8, 64, 4, vocab_size=100, num_blocks=16, block_size=16)
    n = prompt + generated
    seqs = [NewSequence(i, list(range(n)), prompt, n - 1, 1, [i], p)
            for i, p in enumerate(params)]
    _, rows, _ = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    return table, rows


def test_only_rows_of_temperature_and_seeds_are_drawn_in_the_graph():
    sampler = Sampler("cpu", 0, one_pass=True)
    plain = [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0)]
    assert sample_inputs(*decoding(*plain), sampler) is not None
    # A greedy row's filters are moot: it takes the argmax either way.
    greedy_top_k = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert sample_inputs(*decoding(greedy_top_k, *plain), sampler) is not None
    for needs_more in (SamplingParams(temperature=1.0, top_k=5),
                       SamplingParams(temperature=1.0, top_p=0.9),
                       SamplingParams(temperature=1.0, min_p=0.1),
                       SamplingParams(temperature=0.0, logprobs=True),
                       SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                       SamplingParams(temperature=0.0, presence_penalty=0.5),
                       SamplingParams(temperature=1.0, repetition_penalty=1.2)):
        assert sample_inputs(*decoding(*plain, needs_more), sampler) is None, needs_more
    # Without the one-pass kernel (the CPU's default) nothing is drawn in a graph.
    assert sample_inputs(*decoding(*plain), Sampler("cpu", 0)) is None


def test_a_step_with_an_entry_that_does_not_sample_draws_outside_the_graph():
    graphs = DecodeGraphs(None, 4, 4, 64, torch.device("cpu"))
    graphs.sample_graphs[1] = None  # as if captured: only the step decides now
    sampler = Sampler("cpu", 0, one_pass=True)
    table, rows = decoding(SamplingParams(temperature=0.7), SamplingParams(temperature=0.0))
    assert graph_sample_inputs(graphs, table, rows, np.ones(2, np.int64), sampler) is not None
    table.num_computed[rows[1]] -= 1  # its last two tokens: a prefill chunk's end, say
    assert graph_sample_inputs(graphs, table, rows, np.array([1, 1]), sampler) is None
    graphs.sample_graphs.clear()
    table, rows = decoding(SamplingParams(temperature=0.7))
    assert graph_sample_inputs(graphs, table, rows, np.ones(1, np.int64), sampler) is None


def test_the_graph_inputs_give_the_tokens_the_sampler_draws():
    """Greedy rows take the argmax, a seeded row its own seed's draw, whatever else the batch
    holds; the other rows draw fresh seeds, different from step to step."""
    x = logits(5, 900, 3)
    temps = [0.0, 0.7, 1.3, 0.0, 1.0]
    params = [SamplingParams(temperature=t, seed=41 if i == 2 else None)
              for i, t in enumerate(temps)]
    table, rows = decoding(*params, prompt=6, generated=3)
    seeded = [(2, row_seed(41, 3))]  # three tokens generated: the fourth one's draw
    b = batch(temps, [0] * 5, [1.0] * 5, [0.0] * 5, seeded)
    sampler = Sampler("cpu", 9, one_pass=True)
    drawn_inputs = sample_inputs(table, rows, sampler)
    inv = drawn_inputs["inv_temperature"].view(np.float32)
    seeds = drawn_inputs["seeds"].view(np.int64)
    np.testing.assert_allclose(inv, [0.0, 1 / 0.7, 1 / 1.3, 0.0, 1.0], rtol=1e-6)
    assert len(seeds) == 5 and seeds[2] == row_seed(41, 3)
    drawn = sample_from_logits(x, torch.from_numpy(inv.copy()), torch.from_numpy(seeds.copy()))
    expected = Sampler("cpu", 0, one_pass=True)(x, b)[0]
    assert drawn[[0, 2, 3]].tolist() == expected[[0, 2, 3]].tolist()
    assert drawn[[0, 3]].tolist() == x[[0, 3]].argmax(-1).tolist()
    again = sample_inputs(table, rows, sampler)["seeds"].view(np.int64)
    assert again[2] == seeds[2] and not np.array_equal(again[[1, 4]], seeds[[1, 4]])


@pytest.mark.gpu
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_a_decode_step_drawn_in_the_graph_equals_one_drawn_after_it(tiny_qwen3_dir, params):
    from random_prompts import random_prompts
    from rt_helpers import BLOCK_SIZE
    from rt_planner import Planner
    from test_gpu_prefill_graphs import _runner

    from gpu_workers.decode_graphs import DecodeGraphs

    drawn_in_graph = []
    sample_step = DecodeGraphs.sample_step

    def counted(self, bs, n):
        drawn_in_graph.append(bs)
        return sample_step(self, bs, n)

    prompts = random_prompts(3, [5, 40, 17, 90, 3])
    outputs = []
    for in_graph in (True, False):
        runner = _runner(tiny_qwen3_dir)
        decode = runner.graphs.decode
        assert decode.samples
        if not in_graph:
            decode.sample_graphs.clear()  # the forward graph only, sampling after it
        planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
        for i, p in enumerate(prompts):
            planner.add(i, p, 12, params)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DecodeGraphs, "sample_step", counted)
            outputs.append(planner.run(runner))
        assert bool(drawn_in_graph) == in_graph
        drawn_in_graph.clear()
    assert outputs[0] == outputs[1]
