"""Sampling inside the decode CUDA graphs: which batches the captured sampler may draw, the
inputs the host makes for it, and (on a GPU) that a step drawn in the graph gives the tokens
that sampling after the graph gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler_fast import batch, logits

from gpu_workers.sampler import Sampler, row_seed
from kernels.sampling import sample_from_logits
from protocol import SamplingParams


def test_only_batches_of_temperature_and_seeds_are_drawn_in_the_graph():
    sampler = Sampler("cpu", 0, one_pass=True)
    plain = batch([0.0, 0.5, 1.0], [0] * 3, [1.0] * 3, [0.0] * 3)
    assert sampler.host_inputs(plain, np.array([0.0, 0.5, 1.0], np.float32)) is not None
    temps = np.ones(3, np.float32)
    for needs_more in (batch([1.0] * 3, [0, 5, 0], [1.0] * 3, [0.0] * 3),
                       batch([1.0] * 3, [0] * 3, [1.0, 0.9, 1.0], [0.0] * 3),
                       batch([1.0] * 3, [0] * 3, [1.0] * 3, [0.0, 0.1, 0.0]),
                       batch([1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, logprobs=True)):
        assert sampler.host_inputs(needs_more, temps) is None
    top = batch([1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3)
    top.top_logprobs = 2
    assert sampler.host_inputs(top, temps) is None
    # Without the one-pass kernel (the CPU's default) nothing is drawn in a graph.
    assert Sampler("cpu", 0).host_inputs(plain, temps) is None


def test_host_inputs_give_the_tokens_the_sampler_draws():
    """Greedy rows take the argmax, a seeded row its own seed's draw, whatever else the batch
    holds; the other rows draw fresh seeds, different from step to step."""
    x = logits(5, 900, 3)
    temps = [0.0, 0.7, 1.3, 0.0, 1.0]
    seeded = [(2, row_seed(41, 6))]
    b = batch(temps, [0] * 5, [1.0] * 5, [0.0] * 5, seeded)
    sampler = Sampler("cpu", 9, one_pass=True)
    inv, seeds = sampler.host_inputs(b, np.array(temps, np.float32))
    np.testing.assert_allclose(inv, [0.0, 1 / 0.7, 1 / 1.3, 0.0, 1.0], rtol=1e-6)
    assert inv.dtype == np.float32 and seeds.dtype == np.int64 and seeds[2] == row_seed(41, 6)
    drawn = sample_from_logits(x, torch.from_numpy(inv), torch.from_numpy(seeds))
    expected = Sampler("cpu", 0, one_pass=True)(x, b)[0]
    assert drawn[[0, 2, 3]].tolist() == expected[[0, 2, 3]].tolist()
    assert drawn[[0, 3]].tolist() == x[[0, 3]].argmax(-1).tolist()
    _, again = sampler.host_inputs(b, np.array(temps, np.float32))
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

    from gpu_workers.cuda_graphs import DecodeGraphs

    drawn_in_graph = []
    sample_step = DecodeGraphs.sample_step

    def counted(self, bs, inv, seeds):
        drawn_in_graph.append(bs)
        return sample_step(self, bs, inv, seeds)

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
