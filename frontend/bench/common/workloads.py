"""The workloads of docs/benchmarks.md and the seeded random prompts the benchmarks send.

Every generator is deterministic for its seed, so two modes of one run, and a rerun, see the
same requests.
"""

from __future__ import annotations

import random
import time

from protocol import SamplingParams

ID_CAP = 10_000
"""Random prompt ids stay below this, as W1's do (randint(0, 10000))."""

W1_WARMUP_PROMPT = [1, 2, 3, 4]


def w1_workload(num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024,
                vocab_size: int | None = None) -> list[tuple[list[int], int]]:
    """W1 offline throughput (nano-vLLM's bench.py): (prompt, max_tokens) per sequence.

    The defaults are the workload itself: 142,827 prompt tokens, 133,966 output tokens. A
    vocabulary of at most ID_CAP ids (tiny test models) gets the ids folded into it. Lengths
    are drawn from 100 up (from the maximum itself where that is below 100: smoke runs).
    """
    if max_in < 1 or max_out < 1:
        raise ValueError("the W1 maximum lengths must be >= 1")
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min(100, max_in), max_in))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(min(100, max_out), max_out) for _ in range(num_seqs)]
    work = list(zip(prompts, max_tokens, strict=True))
    if vocab_size is not None and vocab_size <= ID_CAP:
        work = [([t % vocab_size for t in p], m) for p, m in work]
    return work


def w1_params(max_tokens: int) -> SamplingParams:
    """W1's sampling: temperature 0.6, every sequence runs to its max_tokens."""
    return SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, exactly max_tokens tokens (W2-W4 and the parity checks)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_ids(rng: random.Random, n: int, vocab_size: int, cap: int | None = ID_CAP
               ) -> list[int]:
    """n token ids uniform below min(vocab_size, cap); cap None draws from the whole vocab."""
    top = vocab_size if cap is None else min(vocab_size, cap)
    return [rng.randrange(top) for _ in range(n)]


def random_prompts(rng: random.Random, num: int, lo: int, hi: int, vocab_size: int
                   ) -> list[list[int]]:
    """num prompts, each of randint(lo, hi) ids drawn by random_ids."""
    return [random_ids(rng, rng.randint(lo, hi), vocab_size) for _ in range(num)]


def timed_w1(llm, work) -> tuple[int, float]:
    """W1 through a frontend.LLM: one warm-up request, then the whole workload at once.
    Returns (output tokens, wall seconds of the workload)."""
    llm.generate([W1_WARMUP_PROMPT], w1_params(16), use_tqdm=False)
    params = [w1_params(m) for _, m in work]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o["token_ids"]) for o in outputs), elapsed
