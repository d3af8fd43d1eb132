"""A thread that follows a pipeline's EngineStats on its `deltas_pub` socket (subscribed to
the stats topic only) and hands each one to a callback."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from frontend.metrics.engine_metrics import EngineMetrics
from protocol import ProtocolError
from protocol.auth import CurveKeys
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.metrics")

POLL_MS = 100


class StatsSubscriber:
    def __init__(self, address: str, keys: CurveKeys | None,
                 on_stats: Callable[[EngineStats], None]) -> None:
        self.on_stats = on_stats
        self._ctx = zmq.Context()
        self._sub = MessageSocket(self._ctx, zmq.SUB, address, bind=False,
                                  accepts=(EngineStats,), security=keys)
        self._sub.socket.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._sub.socket.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
        self._stop = threading.Event()
        # The socket is this thread's from here on (starting a thread is a memory barrier).
        self._thread = threading.Thread(target=self._run, name="nanopipe-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sub.poll(POLL_MS):
                    continue
                try:
                    stats = self._sub.recv()
                except ProtocolError as exc:
                    log.warning("metrics: dropped a bad stats frame: %s", exc)
                    continue
                self.on_stats(stats)
        finally:
            self._sub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.term()


def follow(address: str, keys: CurveKeys | None) -> tuple[EngineMetrics, StatsSubscriber]:
    """Metrics of the pipeline whose `deltas_pub` is `address`, kept up to date until the
    subscriber is closed."""
    metrics = EngineMetrics()
    return metrics, StatsSubscriber(address, keys, metrics.update)
