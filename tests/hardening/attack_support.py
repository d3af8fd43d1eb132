"""What the hardening tests share: the engine they attack, the reference request, and a
watcher of the scheduler's published deltas (a plain module: test files import it by name)."""

from __future__ import annotations

import threading
import time

import zmq

from protocol import (
    Decoder,
    FinishReason,
    ProtocolError,
    RequestError,
    SamplingParams,
    TokenDeltas,
)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=512)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The engine still answers"
MAX_REQUEST_BYTES = 200_000
"""The HTTP body cap of the `base_url` server (413 tests)."""


class DeltaWatcher:
    """Collects every TokenDeltas the scheduler publishes: per request, tokens and outcome."""

    def __init__(self, address: str) -> None:
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
        decoder = Decoder(TokenDeltas)
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            try:
                msg = decoder.decode(self._sub.recv())
            except ProtocolError:
                continue  # the publisher's heartbeats and request announcements
            for rid, fin, err in zip(msg.request_ids, msg.finish_reasons, msg.errors,
                                     strict=True):
                if fin is not None:
                    self.finished[rid] = (fin, err)

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
