"""Sending from the scheduler's step loop without ever blocking it.

A PUSH socket with no peer attached yet (a worker whose connection is still being set up)
refuses a non-blocking send. The step loop must not wait for it, and must not lose the frame
either: what a socket cannot take now waits in order behind it, and the loop calls `flush`
until the socket takes it. Each message is encoded once, however many sockets it goes to.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from protocol import encode
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.scheduler")

FLUSH_RETRY_S = 1e-3


class Outbox:
    def __init__(self) -> None:
        self._waiting: dict[MessageSocket, deque[bytes]] = {}

    @property
    def has_waiting(self) -> bool:
        """Whether some frame still waits for its socket (the loop then retries soon)."""
        return bool(self._waiting)

    def send(self, socks: tuple[MessageSocket, ...] | list[MessageSocket], msg: object) -> None:
        frame = encode(msg)
        for sock in socks:
            queued = self._waiting.get(sock)
            if queued is not None:
                queued.append(frame)  # order per socket is kept: behind what already waits
            elif not _try_send(sock, frame):
                self._waiting[sock] = deque([frame])

    def flush(self) -> None:
        for sock in list(self._waiting):
            queued = self._waiting[sock]
            while queued and _try_send(sock, queued[0]):
                queued.popleft()
            if not queued:
                del self._waiting[sock]

    def forget(self, sock: MessageSocket) -> None:
        """Drop what waits for a socket whose peer is gone for good (a dead replica)."""
        self._waiting.pop(sock, None)

    def drain(self, timeout_s: float) -> bool:
        """Flush until nothing waits or `timeout_s` passes (at shutdown); True when empty."""
        deadline = time.monotonic() + timeout_s
        self.flush()
        while self._waiting and time.monotonic() < deadline:
            time.sleep(FLUSH_RETRY_S)
            self.flush()
        return not self._waiting


def _try_send(sock: MessageSocket, frame: bytes) -> bool:
    """False when the socket cannot take the frame yet; a socket that fails otherwise (its
    peer gone at shutdown: the launcher handles a death) drops it with a warning."""
    try:
        sock.send_bytes(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        log.warning("scheduler: send failed: %s", exc)
        return True
