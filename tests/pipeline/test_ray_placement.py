"""Data-parallel replicas placed by Ray (`ray_address`): on a local Ray cluster of two
logical nodes, each replica's scheduler and worker run as Ray-hosted actor programs in a
placement group of their own, one per node, and the greedy tokens through a Client equal
one engine's; killing one replica's scheduler leaves the pipeline degraded, serving on the
other. Skipped where ray is not installed (the `ray` extra)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from pipeline_config import tiny_engine

from frontend import LLM, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.engine.ray_launch import RayProc
from protocol import SamplingParams

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [[(7 * i + 3 * j) % 300 + 2 for j in range(6 + i)] for i in range(6)]


@pytest.mark.slow
def test_replicas_on_two_ray_nodes_give_one_engines_tokens(tiny_qwen3_dir):
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        config = EngineConfig(**tiny_engine(tiny_qwen3_dir, data_parallel_size=2,
                                            max_model_len=128, ray_address=cluster.address))
        with Pipeline(config) as pipeline:
            hosted = sorted(c.name for c in pipeline.children if isinstance(c.proc, RayProc))
            assert hosted == ["replica 0 scheduler 0", "replica 0 worker 0",
                              "replica 1 scheduler 0", "replica 1 worker 0"]
            nodes = [set(placement_group_table(g)["bundles_to_node_id"].values())
                     for g in pipeline._ray.groups]
            assert all(len(n) == 1 for n in nodes) and nodes[0] != nodes[1], nodes
            with Client(pipeline.address) as client:
                streams = [client.stream(prompt_token_ids=p, params=GREEDY) for p in PROMPTS]
                got = [[t for d in s for t in d.token_ids] for s in streams]
                # A Ray-hosted process is watched like a local one: its death takes its
                # replica down and the other serves on.
                victim = next(c for c in pipeline.children
                              if c.name == "replica 1 scheduler 0")
                os.kill(victim.pid, signal.SIGKILL)  # the local cluster's nodes share this host
                deadline = time.monotonic() + 30
                while pipeline.degraded is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert pipeline.degraded == ("replica 1 is down: replica 1 scheduler 0 was "
                                             "killed by SIGKILL")
                after = client.generate(prompt_token_ids=PROMPTS[0], params=GREEDY)
                assert after.token_ids == got[0]
        assert not ray.is_initialized()  # the pipeline connected, so it disconnected
    finally:
        cluster.shutdown()
    with LLM(**tiny_engine(tiny_qwen3_dir, max_model_len=128)) as llm:
        one = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert got == [r["token_ids"] for r in one]
