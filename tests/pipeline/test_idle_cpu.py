"""An idle engine sleeps: started, served once, then left without requests, its processes use
well under one core between them; and what runs each time it goes idle stays cheap on a pool
of millions of blocks (a small model on a large GPU), so a light load does not pay it per
request. The step loop and the worker spin only while a step is in flight; with nothing to do
every loop blocks on its sockets and wakes a few times a second to check its stop flag
(docs/processes-and-messages.md has the figures)."""

from __future__ import annotations

import time

import psutil
import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from protocol import SamplingParams

pytestmark = pytest.mark.slow  # starts a whole engine

WINDOW_S = 5.0
MAX_IDLE_CORES = 0.10
"""Generous: an idle engine measures about 0.01 of a core here; a hot poll loop takes 1.0."""
MAX_SCHEDULER_CORES = 0.05
"""The scheduler under requests 0.2 s apart: under 0.01 of a core here, 0.13 when every
request's end went over the whole pool of 2M blocks in Python."""
HUGE_POOL = dict(block_size=1, kv_cache_bytes=1 << 30)
"""2M blocks of one token (512 bytes each for the tiny model)."""


def _cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        times = p.cpu_times()
        out[p.pid] = times.user + times.system
    return out


def _cores_used(actors: list[psutil.Process], during) -> dict[str, float]:
    """Cores each actor used while `during()` ran, by its module."""
    names = {p.pid: p.cmdline()[p.cmdline().index("-m") + 1] for p in actors}
    before, start = _cpu_s(actors), time.monotonic()
    during()
    after, wall = _cpu_s(actors), time.monotonic() - start
    return {names[pid]: (after[pid] - before[pid]) / wall for pid in after}


def test_an_idle_engine_uses_well_under_one_core(tiny_qwen3_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def light_load() -> None:
        end = time.monotonic() + WINDOW_S
        while time.monotonic() < end:
            out = llm.generate(["a light load"], params, use_tqdm=False)
            assert len(out[0]["token_ids"]) == 8
            time.sleep(0.2)

    with LLM(**tiny_engine(tiny_qwen3_dir, **HUGE_POOL)) as llm:
        llm.generate(["wake every actor"], params, use_tqdm=False)
        time.sleep(1.0)  # the last step's bookkeeping and the stats publisher settle
        actors = psutil.Process().children(recursive=True)
        idle = _cores_used(actors, lambda: time.sleep(WINDOW_S))
        loaded = _cores_used(actors, light_load)
    assert len(idle) >= 4  # the scheduler, a worker, the tokenizer and the detokenizer
    assert sum(idle.values()) < MAX_IDLE_CORES, f"CPU cores used while idle, by actor: {idle}"
    scheduler = loaded["scheduler_proc.scheduler_loop"]
    assert scheduler < MAX_SCHEDULER_CORES, f"CPU cores under a light load: {loaded}"
