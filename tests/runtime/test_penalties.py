"""Repetition, frequency and presence penalties: the kernel against a per-token reference, and
greedy generation against transformers with the same penalty (float32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner
from transformers import LogitsProcessor, LogitsProcessorList

from gpu_workers.penalties import PenaltyBatch, apply_penalties
from protocol import SamplingParams, SamplingParamsError

MAX_TOKENS = 24


def reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> list[float]:
    """The documented semantics, one token at a time."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_apply_penalties_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 40, 5
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    histories = [([1, 2, 2, 3], [2, 2, 5, 7, 7, 7]), ([], [0]), ([9] * 4, []),
                 ([39, 38], [39, 0, 39]), ([4], [4, 4])]
    settings = [(0.5, 0.25, 1.3), (0.0, 1.0, 1.0), (0.0, 0.0, 1.5), (-0.5, -0.3, 0.8),
                (2.0, 0.0, 1.0)]
    active = [0, 1, 2, 3]  # row 4 has a history but no penalty row in the batch

    def padded(seqs):
        width = max(len(s) for s in seqs)
        return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.int64)

    batch = PenaltyBatch(
        rows=torch.tensor(active), prompt_tokens=padded([histories[r][0] for r in active]),
        output_tokens=padded([histories[r][1] for r in active]),
        presence=torch.tensor([settings[r][0] for r in active], dtype=torch.float64),
        frequency=torch.tensor([settings[r][1] for r in active], dtype=torch.float64),
        repetition=torch.tensor([settings[r][2] for r in active], dtype=torch.float64))
    got = apply_penalties(logits, batch)
    for r in range(rows):
        want = (reference_penalties(logits[r].tolist(), *histories[r], *settings[r])
                if r in active else logits[r].tolist())
        assert got[r].tolist() == pytest.approx(want, abs=1e-12), r


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("inf")), ("presence_penalty", True),
])
def test_penalty_values_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


class OpenAIPenalties(LogitsProcessor):
    """Frequency and presence penalties on the generated tokens, written for transformers."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        for row in range(scores.shape[0]):
            generated = input_ids[row, self.prompt_len:]
            counts = torch.bincount(generated, minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def hf_penalized(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty,
                                          params.frequency_penalty))
    return hf_greedy(model_dir, prompt, MAX_TOKENS, repetition_penalty=params.repetition_penalty,
                     logits_processor=processors)


PENALIZED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, frequency_penalty=1.5),
    SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.0),  # no penalty, in the same batch
]


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_greedy_with_penalties_equals_transformers(model, request):
    model_dir = request.getfixturevalue(model)
    runner = make_runner(model_dir)
    ps = random_prompts(31, [9, 20, 14, 5])
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, (p, params) in enumerate(zip(ps, PENALIZED, strict=True)):
        planner.add(i, p, MAX_TOKENS, params=params)
    outputs = planner.run(runner)
    greedy = SamplingParams(temperature=0.0)
    for i, (p, params) in enumerate(zip(ps, PENALIZED, strict=True)):
        assert outputs[i] == hf_penalized(model_dir, p, params), params
        # each penalty changed what greedy decoding picks
        assert (outputs[i] != hf_penalized(model_dir, p, greedy)) == params.uses_penalties


def test_penalties_survive_preemption(tiny_qwen3_dir):
    """A re-sent sequence counts its earlier output as output, not as prompt."""
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    p = random_prompts(32, [12])[0]
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    planner.add(0, p, MAX_TOKENS, params=params)
    for _ in range(7):
        planner.apply(runner.execute(planner.plan()))
    planner.preempt(0)
    out = planner.run(runner)[0]
    assert out == hf_penalized(tiny_qwen3_dir, p, params)
    assert np.unique(out).size > 1


def test_sampler_picks_from_penalized_logits_but_reports_raw_logprobs():
    from gpu_workers.sampler import Sampler, SamplingBatch

    logits = torch.tensor([[5.0, 4.0, 0.0], [1.0, 3.0, 2.0]])
    penalties = PenaltyBatch(
        rows=torch.tensor([0]), prompt_tokens=torch.zeros(1, 0, dtype=torch.int64),
        output_tokens=torch.tensor([[0, 0]]), presence=torch.tensor([0.0]),
        frequency=torch.tensor([1.0]), repetition=torch.tensor([1.0]))
    greedy = torch.zeros(2)
    batch = SamplingBatch(
        temperature=greedy, top_k=torch.zeros(2, dtype=torch.int32), top_p=torch.ones(2),
        min_p=torch.zeros(2), all_greedy=True, any_greedy=True, max_top_k=0, use_top_p=False,
        use_min_p=False, seeded=[], logprobs=True, penalties=penalties)
    tokens, logprobs = Sampler("cpu", seed=0)(logits, batch)
    assert tokens.tolist() == [1, 1]  # row 0: 5 - 2 * 1 = 3 < 4
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs.tolist() == pytest.approx([raw[0, 1].item(), raw[1, 1].item()])
