"""The engine's own counters (EngineStats) as a benchmark reads them from a live pipeline.

The scheduler publishes them on `deltas_pub` every half second; a benchmark takes one after its
warm-up and one after its workload, and the difference is what the workload cost, e.g. the GPU
busy time the workers measured (idle share = 1 - busy / wall).
"""

from __future__ import annotations

import threading
import time

import zmq

from frontend.bench.common.workloads import W1_WARMUP_PROMPT, w1_params
from protocol import ProtocolError
from protocol.auth import CurveKeys
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats
from protocol.sockets import MessageSocket


class StatsFollower:
    """Keeps the latest EngineStats a scheduler publishes at `address` (its endpoints'
    `deltas_pub`; `keys`: their CURVE keys, where the links use them)."""

    def __init__(self, address: str, keys: CurveKeys | None = None) -> None:
        self._ctx = zmq.Context()
        self._sub = MessageSocket(self._ctx, zmq.SUB, address, bind=False,
                                  accepts=(EngineStats,), security=keys)
        self._sub.socket.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._sub.socket.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
        self.latest: EngineStats | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sub.poll(50):
                    try:
                        self.latest = self._sub.recv()
                    except ProtocolError:
                        continue
        finally:
            self._sub.close()

    def after(self, moment: float, timeout: float = 10.0) -> EngineStats:
        """The first stats the scheduler took after time.monotonic() reached `moment`."""
        deadline = time.monotonic() + timeout
        while self.latest is None or self.latest.time_s < moment:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine stats after {moment:.3f} within {timeout} s")
            time.sleep(0.02)
        return self.latest

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.term()

    def __enter__(self) -> StatsFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timed_w1_busy(llm, work) -> tuple[int, float, float]:
    """W1 through a frontend.LLM as timed_w1 runs it, plus the GPU busy seconds the engine
    measured during the timed part: (output tokens, wall seconds, busy seconds)."""
    endpoints = llm.pipeline.endpoints
    with StatsFollower(endpoints.deltas_pub, endpoints.keys) as stats:
        llm.generate([W1_WARMUP_PROMPT], w1_params(16), use_tqdm=False)
        before = stats.after(time.monotonic())
        params = [w1_params(m) for _, m in work]
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = stats.after(time.monotonic())
    produced = sum(len(o["token_ids"]) for o in outputs)
    return produced, elapsed, after.gpu_busy_s - before.gpu_busy_s
