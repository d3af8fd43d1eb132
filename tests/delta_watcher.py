"""The one watcher of the tests on the scheduler's published deltas: the engine's own view
of each request (tokens produced, how it finished), whatever the clients were told.

tests/ is on sys.path through tests/conftest.py: `from delta_watcher import DeltaWatcher`.
"""

from __future__ import annotations

import threading
import time

import zmq

from protocol import Decoder, FinishReason, ProtocolError, RequestError, TokenDeltas
from protocol.engine_messages import WatchGoodbye, WatchHeartbeat, WatchRequest


class DeltaWatcher:
    """Subscribes to `deltas_pub`; counts tokens per request id and records each outcome."""

    def __init__(self, address: str) -> None:
        self.tokens: dict[int, int] = {}
        self.finished: dict[int, tuple[FinishReason, RequestError | None]] = {}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # a SUB socket misses what is published before it joins

    def _run(self) -> None:
        decoder = Decoder(TokenDeltas, WatchHeartbeat, WatchRequest, WatchGoodbye)
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            try:
                msg = decoder.decode(self._sub.recv())
            except ProtocolError:
                continue
            if not isinstance(msg, TokenDeltas):
                continue  # heartbeats, request announcements, the goodbye
            for rid, toks, fin, err in zip(msg.request_ids, msg.token_ids, msg.finish_reasons,
                                           msg.errors, strict=True):
                self.tokens[rid] = self.tokens.get(rid, 0) + len(toks)
                if fin is not None:
                    self.finished[rid] = (fin, err)

    def finished_with(self, reason: FinishReason) -> list[int]:
        return [rid for rid, (fin, _) in list(self.finished.items()) if fin is reason]

    def wait_for(self, rid: int, timeout: float = 30.0
                 ) -> tuple[FinishReason, RequestError | None]:
        deadline = time.monotonic() + timeout
        while rid not in self.finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} never finished")
            time.sleep(0.02)
        return self.finished[rid]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()
