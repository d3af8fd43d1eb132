"""Fair sharing between clients, through the real clients and every process: one client
floods the engine with long requests, and a second client's short request finishes while
the flood is still running (one engine, and two data-parallel replicas)."""

from __future__ import annotations

import pytest
from pipeline_config import tiny_engine

from frontend import Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import SamplingParams

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_short_request_is_not_stuck_behind_another_clients_flood(tiny_qwen3_dir, replicas):
    slots = 2  # per replica: the flood holds every one, with a backlog of five times more
    flood = 6 * slots * replicas
    config = EngineConfig(**tiny_engine(tiny_qwen3_dir, max_num_seqs=slots,
                                        data_parallel_size=replicas))
    with Pipeline(config) as pipeline, Client(pipeline.address) as hog, \
            Client(pipeline.address) as victim:
        streams = [hog.stream(f"flood {k} " * 20, LONG) for k in range(flood)]
        next(streams[0])  # the flood runs
        out = victim.generate("a short question", SHORT)
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        for s in streams:  # the flood stops here: what had finished by now ends "length"
            hog.abort(s.request_id)
        reasons = [[d.finish_reason for d in s][-1] for s in streams]
    # The victim came last; first come first served would have finished every long request
    # before it. It waited for none: at most the ones running when it came ended first.
    assert reasons.count("abort") >= flood - slots * replicas, reasons
