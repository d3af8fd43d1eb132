"""An idle engine sleeps: started, served once, then left without requests, its processes use
well under one core between them. The step loop and the worker spin only while a step is in
flight; with nothing to do every loop blocks on its sockets and wakes a few times a second to
check its stop flag (docs/processes-and-messages.md has the figures)."""

from __future__ import annotations

import time

import psutil
import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from protocol import SamplingParams

pytestmark = pytest.mark.slow  # starts a whole engine

WINDOW_S = 5.0
MAX_CORES = 0.10
"""Generous: an idle engine measures about 0.01 of a core here; a hot poll loop takes 1.0."""


def _cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        times = p.cpu_times()
        out[p.pid] = times.user + times.system
    return out


def test_an_idle_engine_uses_well_under_one_core(tiny_qwen3_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(**tiny_engine(tiny_qwen3_dir)) as llm:
        assert len(llm.generate(["wake every actor"], params, use_tqdm=False)[0]
                   ["token_ids"]) == 8
        time.sleep(1.0)  # the last step's bookkeeping and the stats publisher settle
        actors = psutil.Process().children(recursive=True)
        names = {p.pid: " ".join(p.cmdline()[1:3]) for p in actors}
        before, start = _cpu_s(actors), time.monotonic()
        time.sleep(WINDOW_S)
        after, wall = _cpu_s(actors), time.monotonic() - start
    cores = {names[pid]: (after[pid] - before[pid]) / wall for pid in after}
    assert len(cores) >= 4  # the scheduler, a worker, the tokenizer and the detokenizer
    assert sum(cores.values()) < MAX_CORES, f"CPU cores used while idle, by actor: {cores}"
