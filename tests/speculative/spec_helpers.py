"""The real Scheduler driving a real ModelRunner in one process, with or without speculation,
step by step or overlapped (with or without the worker's lookahead: lookahead_driver)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for sub in ("runtime", "scheduler"):
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))

from fake_worker import Collector, drive  # noqa: E402
from lookahead_driver import drive_lookahead  # noqa: E402
from rt_helpers import make_runner  # noqa: E402

from frontend.bench.common.truncate import truncate_model  # noqa: E402,F401
from protocol import AddRequest, SamplingParams  # noqa: E402
from scheduler_proc import Scheduler, SchedulerConfig  # noqa: E402

MAX_MODEL_LEN = 128


class RunnerWorker:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.results = []

    def execute(self, plan):
        result = self.runner.execute(plan)
        self.results.append(result)
        return result


def repeating_prompt(rng: random.Random, length: int, period: int) -> list[int]:
    """A prompt that repeats a random phrase, so n-gram lookups find matches."""
    phrase = [rng.randrange(3, 500) for _ in range(period)]
    return (phrase * (length // period + 1))[:length]


def greedy_requests(rng_seed: int, n: int = 6, **params) -> list[AddRequest]:
    rng = random.Random(rng_seed)
    out = []
    for rid in range(n):
        prompt = repeating_prompt(rng, rng.randint(8, 40), rng.randint(3, 9))
        max_tokens = rng.randint(8, 48)
        p = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens,
                              "ignore_eos": True, **params})
        out.append(AddRequest(rid, prompt, p, [2]))
    return out


def generate(model_dir: str, reqs: list[AddRequest], k: int = 0, ngram: int = 2,
             kv_bytes: int = 1 << 20, budget: int = 256, check=None, max_num_seqs: int = 8,
             max_model_len: int = MAX_MODEL_LEN, draft: str | None = None,
             overlap: bool = False, lookahead: bool = False, hook=None, **runner_kw):
    """{request id: (tokens, finish reason)}, the scheduler and the worker. With `draft` (a
    model directory) the proposals come from that draft model instead of n-gram lookup.
    `overlap`: plan N+1 before result N; `lookahead` (implies overlap): the worker also
    launches N+1 before it finishes N. `hook(sched, step)` runs after each result."""
    spec = {}
    if k:
        spec = ({"speculative": "draft", "num_speculative_tokens": k, "draft_model": draft}
                if draft else {"speculative": "ngram", "num_speculative_tokens": k,
                               "ngram_size": ngram})
    runner = make_runner(model_dir, **{"max_model_len": max_model_len, "kv_cache_bytes": kv_bytes,
                                       "max_num_seqs": max_num_seqs,
                                       "max_num_batched_tokens": budget, **spec, **runner_kw})
    sched = Scheduler(SchedulerConfig(runner.num_kv_blocks, runner.config.block_size,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len,
                                      overlap=overlap or lookahead, num_speculative_tokens=k))
    for r in reqs:
        sched.add_request(r)
    worker = RunnerWorker(runner)
    if lookahead:
        out = drive_lookahead(sched, runner, Collector(), hook=hook or check).outputs
    else:
        out = drive(sched, worker, Collector(), hook=hook or check).outputs
    return {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}, sched, worker
