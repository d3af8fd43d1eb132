"""A tokenizer or detokenizer stalled past the client heartbeat timeout (SIGSTOP, later
SIGCONT), as a swapped-out or debugged process is: `nanopipe serve` must come back by itself.
HTTP and a plain Client are driven before, during (an answer or a clear error, never a hang)
and after each stall; /health goes back to ready."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from process_watch import descendants
from serve_cli import complete, start_serve, stop_serve, wait_ready

from frontend.client import Client, ConnectionLostError
from frontend.client.core import DISCONNECT_GRACE_S
from protocol.client_link import HEARTBEAT_TIMEOUT_MS

pytestmark = pytest.mark.slow

STALL_S = HEARTBEAT_TIMEOUT_MS / 1000 + 3
"""Long enough for the heartbeats (a ping a second) to drop the links, with time to see it."""
SETTLE_S = DISCONNECT_GRACE_S + 10
"""After the stall, the most a recovery may take."""


def _actor_pid(launcher: int, actor: str) -> int:
    (pid,) = [p for p in descendants(launcher)
              if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2:3]
              == [f"frontend.actors.{actor}".encode()]]
    return pid


def _client_address(log: Path, proc) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("clients connect to: "):
                return line.split(": ", 1)[1]
        time.sleep(0.1)
    raise AssertionError("the launcher printed no client address")


class InFlight(threading.Thread):
    """One call made during the stall, and what it returned or raised."""

    def __init__(self, call) -> None:
        super().__init__(daemon=True)
        self.call, self.outcome = call, None
        self.start()

    def run(self) -> None:
        try:
            self.outcome = self.call()
        except Exception as exc:
            self.outcome = exc


def _served_or_unreachable(resp) -> bool:
    return resp.status_code == 200 or (
        resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unreachable")


@pytest.mark.parametrize("actor", ["tokenizer", "detokenizer"])
def test_a_stalled_frontend_actor_is_survived(tiny_qwen3_dir, tmp_path, actor):
    log = tmp_path / "launcher.out"
    with log.open("w") as out:
        proc, base = start_serve(tiny_qwen3_dir, stdout=out)
    try:
        wait_ready(base, proc)
        client = Client(_client_address(log, proc))
        assert complete(base).status_code == 200
        assert client.generate("hi", {"max_tokens": 3}).finish_reason == "length"

        pid = _actor_pid(proc.pid, actor)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            http_call = InFlight(lambda: complete(base, timeout=STALL_S + SETTLE_S))
            zmq_call = InFlight(lambda: client.generate("hi", {"max_tokens": 3}))
            statuses, client_lost = [], False
            while time.monotonic() - stopped < STALL_S:  # the server itself answers
                statuses.append(httpx.get(f"{base}/health", timeout=5).json()["status"])
                client_lost |= client.lost_reason is not None
                time.sleep(0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert set(statuses) == {"ready", "reconnecting"}, statuses
        assert statuses[-1] == "reconnecting" and client_lost, "the heartbeats dropped nothing"
        for call in (http_call, zmq_call):
            call.join(SETTLE_S)
            assert not call.is_alive(), "a request made during the stall hangs"
        assert _served_or_unreachable(http_call.outcome), http_call.outcome.text
        assert isinstance(zmq_call.outcome, ConnectionLostError) or \
            getattr(zmq_call.outcome, "finish_reason", None) == "length", zmq_call.outcome

        deadline = time.monotonic() + SETTLE_S
        while (httpx.get(f"{base}/health", timeout=5).status_code != 200
               or client.lost_reason is not None):
            assert time.monotonic() < deadline, "no recovery after the stall"
            time.sleep(0.2)
        assert httpx.get(f"{base}/health", timeout=5).json() == {"status": "ready",
                                                                  "reason": None}
        done = complete(base)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 3
        assert client.generate("hi", {"max_tokens": 3}).finish_reason == "length"
        assert not client.dead and proc.poll() is None
        client.close()
    finally:
        assert stop_serve(proc) == 0
