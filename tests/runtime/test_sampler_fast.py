"""The one-pass sampler against the plain reference: the same tokens from the same noise,
the same support sets, the same distributions, and no full-vocabulary work it can skip."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_workers.sampler import TOP_P_CANDIDATES, Sampler, SamplingBatch, row_seed
from gpu_workers.sampler_reference import ReferenceSampler


class OpLog(TorchDispatchMode):
    """Records the names of the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def batch(temperature, top_k, top_p, min_p, seeded=(), logprobs=False) -> SamplingBatch:
    temp = torch.tensor(temperature, dtype=torch.float32)
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    m = torch.tensor(min_p, dtype=torch.float32)
    rand = temp > 0
    return SamplingBatch(
        temperature=temp, top_k=k, top_p=p, min_p=m,
        all_greedy=bool((~rand).all()), any_greedy=bool((~rand).any()),
        max_top_k=int(k[rand].max()) if rand.any() else 0,
        use_top_p=bool((p[rand] < 1).any()), use_min_p=bool((m[rand] > 0).any()),
        seeded=list(seeded), logprobs=logprobs)


def mixed_batch(rows: int, seed: int) -> SamplingBatch:
    """Every combination of filters, greedy rows and seeded rows, drawn per row."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return [options[int(i)] for i in torch.randint(len(options), (rows,), generator=g)]

    return batch(pick([0.0, 0.5, 1.0, 1.7]), pick([0, 0, 1, 5, 40]),
                 pick([1.0, 1.0, 0.5, 0.9, 0.99]), pick([0.0, 0.0, 0.05, 0.3]),
                 seeded=[(r, row_seed(r, 3)) for r in range(0, rows, 5)], logprobs=True)


def logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_noise_gives_the_reference_tokens(seed, dtype):
    x = logits(96, 3000, seed).to(dtype)
    b = mixed_batch(96, seed)
    fast, fast_lp = Sampler("cpu", seed)(x, b)
    ref, ref_lp = ReferenceSampler("cpu", seed)(x, b)
    assert torch.equal(fast, ref)
    assert torch.allclose(fast_lp, ref_lp, atol=1e-5)


@pytest.mark.parametrize("one_pass", [False, True], ids=["torch", "one-pass"])
def test_support_sets_equal_the_reference(one_pass):
    """Many draws of one row per setting land exactly on the reference's nonzero set."""
    x = logits(1, 60, 7).expand(3000, -1).clone()
    ref = ReferenceSampler("cpu", 0)
    for temp, k, p, m in [(1.0, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (0.7, 0, 1.0, 0.2),
                          (1.0, 20, 0.8, 0.05), (2.0, 3, 0.99, 0.0)]:
        b = batch([temp] * 3000, [k] * 3000, [p] * 3000, [m] * 3000)
        support = set(torch.nonzero(ref.probs(x[:1], b)[0]).squeeze(1).tolist())
        drawn = set(Sampler("cpu", 1, one_pass=one_pass)(x, b)[0].tolist())
        assert drawn == support, (temp, k, p, m)


@pytest.mark.parametrize("one_pass", [False, True], ids=["torch", "one-pass"])
def test_filtered_distribution_matches_the_reference(one_pass):
    x = logits(1, 40, 3, scale=1.0).expand(40000, -1).clone()
    b = batch([0.8] * 40000, [12] * 40000, [0.9] * 40000, [0.02] * 40000)
    probs = ReferenceSampler("cpu", 0).probs(x[:1], b)[0]
    probs = probs / probs.sum()
    tokens = Sampler("cpu", 11, one_pass=one_pass)(x, b)[0]
    freq = torch.bincount(tokens, minlength=40).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.01)


def test_top_p_falls_back_to_a_sort_when_the_candidates_hold_too_little_mass():
    vocab = 4 * TOP_P_CANDIDATES
    rows = 40  # more rows than the fallback sorts at once
    x = logits(rows, vocab, 5, scale=0.1)  # nearly flat: 0.9 of the mass spans most of the vocab
    x[2] *= 100  # a peaked row, decided by its candidates alone
    b = batch([1.0] * rows, [0] * rows, [0.9, 0.5, 0.9, 1.0] * 10, [0.0] * rows)
    with OpLog() as log:
        fast = Sampler("cpu", 4)(x, b)[0]
    assert "sort" in log.ops
    assert torch.equal(fast, ReferenceSampler("cpu", 4)(x, b)[0])
    x[2] /= 100
    x *= 100  # every row peaked: no sort
    with OpLog() as log:
        Sampler("cpu", 4)(x, b)
    assert "sort" not in log.ops


def test_an_all_greedy_batch_is_one_argmax_over_the_logits_as_given():
    x = logits(8, 500, 9).to(torch.bfloat16)
    b = batch([0.0] * 8, [0] * 8, [1.0] * 8, [0.0] * 8)
    with OpLog() as log:
        tokens, lp = Sampler("cpu", 0)(x, b)
    assert log.ops == ["argmax"] and lp is None
    assert torch.equal(tokens, x.float().argmax(-1))


def test_temperature_only_batch_needs_no_softmax_topk_or_sort():
    x = logits(8, 500, 9)
    b = batch([0.6] * 8, [0] * 8, [1.0] * 8, [0.0] * 8)
    with OpLog() as log:
        tokens, _ = Sampler("cpu", 3)(x, b)
    assert not {"softmax", "_softmax", "topk", "sort"} & set(log.ops)
    assert torch.equal(tokens, ReferenceSampler("cpu", 3)(x, b)[0])


@pytest.mark.parametrize("one_pass", [False, True], ids=["torch", "one-pass"])
def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch(one_pass):
    x = logits(6, 800, 2)
    seeded = [(4, row_seed(77, 9))]
    first, second = Sampler("cpu", 0, one_pass=one_pass), Sampler("cpu", 5, one_pass=one_pass)
    a = first(x, batch([1.0] * 6, [0, 0, 0, 0, 30, 0], [1.0] * 4 + [0.9, 1.0], [0.0] * 6,
                       seeded))[0]
    b = second(x, batch([0.0, 1.0, 0.4, 1.0, 1.0, 0.0], [3, 0, 0, 100, 30, 0],
                        [0.2, 1.0, 0.99, 1.0, 0.9, 1.0], [0.0, 0.3, 0.0, 0.0, 0.0, 0.0],
                        seeded))[0]
    assert a[4] == b[4]
