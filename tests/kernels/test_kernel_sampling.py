"""One-pass sampling: the Triton kernel (interpreted on CPU) draws exactly the reference's
tokens, greedy rows are argmax, and the draws follow softmax(logits / T)."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import (
    exponential_noise_ref,
    sample_from_logits,
    sample_from_logits_ref,
    sample_from_logits_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temps = torch.tensor([0.0, 0.6, 1.0, 0.0, 1.7, 0.3][:rows], dtype=torch.float32)
    inv = torch.where(temps > 0, 1 / temps.clamp(min=1e-6), torch.zeros_like(temps))
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64)
    return logits.to(DEVICE), inv.to(DEVICE), seeds.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 20_000])
def test_kernel_draws_the_reference_tokens(dtype, vocab):
    logits, inv, seeds = _case(6, vocab, dtype)
    got = sample_from_logits_triton(logits, inv, seeds)
    want = sample_from_logits_ref(logits, inv, seeds)
    assert got.tolist() == want.tolist()
    greedy = inv == 0
    assert got[greedy].tolist() == logits.float().argmax(-1)[greedy].tolist()


def test_the_same_seed_draws_the_same_token_and_other_seeds_differ():
    logits = torch.zeros(64, 50, device=DEVICE)  # uniform: every token equally likely
    inv = torch.ones(64, device=DEVICE)
    seeds = torch.full((64,), 12345, dtype=torch.int64, device=DEVICE)
    assert len(set(sample_from_logits(logits, inv, seeds).tolist())) == 1
    seeds = torch.arange(64, dtype=torch.int64, device=DEVICE)
    assert len(set(sample_from_logits(logits, inv, seeds).tolist())) > 20


def test_the_noise_is_exponential():
    noise = exponential_noise_ref(torch.arange(8, dtype=torch.int64), 20_000)
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs(noise.var().item() - 1.0) < 0.03


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    """Chi-square over 8 tokens, 20,000 seeded draws: p < 0.001 fails (critical value 24.32)."""
    draws = 20_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    logits = base.repeat(draws, 1)
    inv = torch.full((draws,), 1 / temperature)
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 + 17
    tokens = sample_from_logits_ref(logits, inv, seeds)
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(base.double() / temperature, -1) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.32, (chi2, observed.tolist(), expected.tolist())


def test_masked_logits_are_never_drawn():
    logits, inv, seeds = _case(6, 3000, torch.float32, seed=3)
    logits[:, ::2] = float("-inf")
    tokens = sample_from_logits(logits, inv, seeds)
    assert all(t % 2 == 1 for t in tokens.tolist())


def test_bad_shapes_are_refused():
    logits, inv, seeds = _case(3, 100, torch.float32)
    with pytest.raises(ValueError, match="seeds"):
        sample_from_logits(logits, inv, seeds.to(torch.int32))
    with pytest.raises(ValueError, match="inv_temperature"):
        sample_from_logits(logits, inv[:2], seeds)


def test_a_threshold_keeps_only_the_tokens_that_reach_it():
    logits, inv, seeds = _case(6, 3000, torch.float32, seed=5)
    scaled = logits * inv[:, None]
    tau = scaled.topk(5, dim=-1).values[:, -1]  # top-5 as a threshold
    got = sample_from_logits_triton(logits, inv, seeds, tau)
    assert got.tolist() == sample_from_logits_ref(logits, inv, seeds, tau).tolist()
    for row, tok in enumerate(got.tolist()):
        if inv[row] > 0:
            assert scaled[row, tok] >= tau[row]
        else:
            assert tok == int(logits[row].argmax())


@pytest.mark.parametrize("tied", [[9000, 1500, 17000], [1026, 2], [8195, 8194], [5, 4100]])
def test_a_greedy_row_with_tied_maxima_takes_the_first_as_argmax_does(tied):
    """Ties in one lane across steps, across lanes of one block and across chunks."""
    logits = torch.zeros(1, 20_000)
    logits[0, tied] = 5.0
    inv = torch.zeros(1, dtype=torch.float32)
    seeds = torch.zeros(1, dtype=torch.int64)
    got = sample_from_logits_triton(logits.to(DEVICE), inv.to(DEVICE), seeds.to(DEVICE))
    assert got.tolist() == [min(tied)] == logits.argmax(-1).tolist()


def test_profiles_count_the_kernels_as_the_sampler():
    """Sampling inside a CUDA graph has no profiler range on the device: the per-step
    breakdowns (`nanopipe profile step`) find the kernels by name."""
    from gpu_workers.profiling.summary import categorize
    from kernels import sampling

    for kernel in (sampling._sample_partial_kernel, sampling._sample_pick_kernel):
        name = getattr(kernel, "fn", kernel).__name__
        assert categorize(name) == "sampler", name
    assert categorize("_qk_norm_rope_store_kernel") == "rotary/kv-store"
