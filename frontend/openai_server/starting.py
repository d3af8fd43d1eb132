"""The HTTP port's answer while the engine starts: 503 to everything, and on /health
`{"status": "starting", "reason": <what start-up is doing>}`.

`nanopipe serve --port` binds its port before the engine starts (a taken port fails at
once); without this, probes would meet a refused connection for the whole start-up and could
not tell a starting server from a missing one. One thread answers on the listening socket
until `close()`; the socket then goes to the real server, and connections made in between
wait in its backlog.
"""

from __future__ import annotations

import json
import select
import socket
import threading

from frontend.openai_server.errors import error_body
from frontend.openai_server.health import Health, HealthStatus

BACKLOG = 128
READ_TIMEOUT_S = 2.0
MAX_HEAD_BYTES = 8192


class StartingResponder:
    def __init__(self, sock: socket.socket) -> None:
        self.reason = "starting the engine"
        """What start-up is doing now (the launcher's progress lines)."""
        self._sock = sock
        sock.listen(BACKLOG)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-starting", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=READ_TIMEOUT_S + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self._sock], [], [], 0.1)
            if not readable or self._stop.is_set():
                continue
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # the socket was closed: start-up failed
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass  # the prober went away

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
            chunk = conn.recv(4096)
            if not chunk:
                break
            head += chunk
        parts = head.split(b"\r\n", 1)[0].split()
        path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) > 1 else ""
        health = Health(HealthStatus.STARTING, self.reason)
        if path == "/health":
            body = health.body()
        else:
            body = error_body(f"the engine is starting ({self.reason}); retry shortly",
                              "engine_starting", code="engine_starting")
        data = json.dumps(body).encode()
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\n"
                     b"content-type: application/json\r\n"
                     b"retry-after: 1\r\n"
                     b"connection: close\r\n"
                     + f"content-length: {len(data)}\r\n\r\n".encode() + data)
