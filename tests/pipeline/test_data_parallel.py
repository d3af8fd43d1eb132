"""Data-parallel replicas behind one address, driven as a user does: the greedy tokens of two
replicas equal one engine's, shared-prefix requests land on one replica (seen by attaching to
each replica's deltas_pub, as the stdout detokenizer does), and killing one replica's
scheduler fails only the requests placed there while the other replica serves on."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import zmq
from pipeline_config import tiny_engine

from frontend import LLM, Client, EngineDeadError
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import Decoder, SamplingParams, TokenDeltas
from protocol.engine_messages import EngineStats, WatchGoodbye, WatchHeartbeat, WatchRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


class ReplicaWatch:
    """Attached to every replica's deltas_pub: which client request ids each one accepted."""

    def __init__(self, addresses: list[str]) -> None:
        self.accepted: list[list[str]] = [[] for _ in addresses]
        self._ctx = zmq.Context()
        self._decoder = Decoder(WatchHeartbeat, WatchRequest, WatchGoodbye, TokenDeltas,
                                EngineStats)
        self._subs = []
        for address in addresses:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(address)
            self._subs.append(sub)
        for sub in self._subs:  # greeted once subscribed: from then on nothing is missed
            assert sub.poll(10_000), "no greeting from a replica's deltas_pub"
            self._decoder.decode(sub.recv())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(50):
                msg = self._decoder.decode(sub.recv())
                if isinstance(msg, WatchRequest):
                    self.accepted[self._subs.index(sub)].append(msg.client_request_id)

    def replica_of(self, client_request_id: str, timeout: float = 10.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i, ids in enumerate(self.accepted):
                if client_request_id in ids:
                    return i
            time.sleep(0.02)
        raise AssertionError(f"no replica accepted {client_request_id}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sub in self._subs:
            sub.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def dp2(tiny_qwen3_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir, data_parallel_size=2)) as llm:
        yield llm


def prompts() -> list[list[int]]:
    return [[(5 * i + 3 * j) % 300 + 2 for j in range(12 + i)] for i in range(8)]


def test_two_replicas_give_the_greedy_tokens_of_one(dp2, tiny_qwen3_dir, caplog):
    names = sorted(c.name for c in dp2.pipeline.children)
    assert names == ["detokenizer 0", "replica 0 scheduler 0", "replica 0 worker 0",
                     "replica 1 scheduler 0", "replica 1 worker 0", "tokenizer 0"]
    # Start-up's record names every process of both replicas, each READY taken once.
    assert sorted(p.name for p in dp2.pipeline.startup.processes) == names
    two = dp2.generate(prompts(), GREEDY, use_tqdm=False)
    with caplog.at_level(logging.INFO, logger="nanopipe.llm"), \
            LLM(**tiny_engine(tiny_qwen3_dir)) as llm:
        one = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert f"nanopipe: {llm.pipeline.startup.line()}" in caplog.messages  # the LLM's log line
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert all(len(r["token_ids"]) == 8 for r in two)


def test_shared_prefix_requests_go_to_one_replica(dp2):
    group = {g: [(37 * i + 200 * g) % 600 + 5 for i in range(128)] for g in (0, 1)}  # 8 blocks
    watch = ReplicaWatch([r.deltas_pub for r in dp2.pipeline.replicas])
    try:
        with Client(dp2.pipeline.address) as client:
            streams = {(g, i): client.stream(prompt_token_ids=group[g] + [7 * i + 1, 3 * i + 2],
                                             params=GREEDY)
                       for i in range(4) for g in (0, 1)}
            for stream in streams.values():
                assert [d for d in stream][-1].finish_reason == "length"
            where = {key: watch.replica_of(s.request_id) for key, s in streams.items()}
    finally:
        watch.close()
    for g in (0, 1):
        assert len({where[(g, i)] for i in range(4)}) == 1, where
    assert where[(0, 0)] != where[(1, 0)], where  # and the two groups share the load


def test_killing_one_replicas_scheduler_fails_only_its_requests(tiny_qwen3_dir):
    config = EngineConfig(**tiny_engine(tiny_qwen3_dir, data_parallel_size=2))
    with Pipeline(config) as pipeline:
        watch = ReplicaWatch([r.deltas_pub for r in pipeline.replicas])
        try:
            with Client(pipeline.address) as client:
                streams = [client.stream(prompt_token_ids=[3 + i, 9, 27, 81], params=LONG)
                           for i in range(2)]
                for s in streams:
                    next(s)
                on = [watch.replica_of(s.request_id) for s in streams]
                assert sorted(on) == [0, 1]  # two requests on idle replicas: one each
                victim = next(c for c in pipeline.children
                              if c.role == "scheduler" and c.replica == 1)
                os.kill(victim.pid, signal.SIGKILL)
                doomed, survivor = streams[on.index(1)], streams[on.index(0)]
                with pytest.raises(EngineDeadError, match="replica 1 scheduler 0 was killed"):
                    for _ in doomed:
                        pass
                assert [d for d in survivor][-1].finish_reason == "length"
                after = client.generate(prompt_token_ids=[5, 6, 7], params=GREEDY)
                assert len(after.token_ids) == 8
                assert not client.dead
            assert pipeline.dead_reason is None and pipeline.alive
            assert "replica 1 is down: replica 1 scheduler 0 was killed by SIGKILL" \
                in pipeline.degraded
            assert all(c.proc.poll() is not None for c in pipeline.children if c.replica == 1)
        finally:
            watch.close()
