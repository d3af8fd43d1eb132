"""A burst sent the moment earlier requests return is routed on fresh figures: each replica
publishes its stats as soon as a step finishes requests, so the router no longer counts the
finished first requests as work ahead and every request follows its group's prefix.

The first request of group A is long and that of group B short: on stale figures the router
would still count A's long prompt as work ahead on A's replica and send A's burst away from its
prefix (the affinity gain of 3 blocks is less than half that imbalance)."""

from __future__ import annotations

import time

import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from frontend.bench.common import StatsFollower
from protocol import SamplingParams

pytestmark = pytest.mark.slow  # starts two replicas

BLOCK = 16
PREFIX = 3 * BLOCK
LONG_TAIL = 160
SHORT_TAIL = 2
PER_GROUP = 4
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1)
"""One step: the first requests finish before a periodic publication would have said so."""


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 500 + 3 for i in range(n)]


def test_a_burst_right_after_the_first_requests_follows_their_prefixes(tiny_qwen3_dir):
    prefix = {g: tokens(seed, PREFIX) for seed, g in enumerate("AB", 1)}
    first = {"A": prefix["A"] + tokens(7, LONG_TAIL), "B": prefix["B"] + tokens(8, SHORT_TAIL)}
    # The rest, the groups interleaved: so the load the burst adds stays even.
    rest = [prefix[g] + [11 + i, 200 + 3 * i] for i in range(1, PER_GROUP) for g in "AB"]
    with LLM(**tiny_engine(tiny_qwen3_dir, data_parallel_size=2, routing="affinity",
                           block_size=BLOCK)) as llm:
        followers = [StatsFollower(r.deltas_pub, r.keys) for r in llm.pipeline.replicas]
        try:
            before = [f.after(time.monotonic()) for f in followers]
            llm.generate([first["A"], first["B"]], FIRST, use_tqdm=False)
            out = llm.generate(rest, PARAMS, use_tqdm=False)  # at once: no wait for stats
            done = time.monotonic()
            after = [f.after(done) for f in followers]
        finally:
            for f in followers:
                f.close()
    assert all(len(r["token_ids"]) == 4 for r in out)
    finished = [a.finished_requests - b.finished_requests for a, b in zip(after, before)]
    computed = [a.prompt_tokens - b.prompt_tokens for a, b in zip(after, before)]
    cached = [a.cached_prompt_tokens - b.cached_prompt_tokens for a, b in zip(after, before)]
    # One group per replica, and each of the rest found its prefix there: only the tails and
    # the first requests were computed.
    tail = (PER_GROUP - 1) * SHORT_TAIL
    assert finished == [PER_GROUP, PER_GROUP], (finished, computed, cached)
    assert sorted(computed) == [len(first["B"]) + tail, len(first["A"]) + tail], computed
    assert cached == [(PER_GROUP - 1) * PREFIX] * 2, (computed, cached)
