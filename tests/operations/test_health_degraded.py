"""/health of `nanopipe serve MODEL --dp 2 --port N` when one replica is lost: 200 "degraded"
with a reason naming the replica, while the other replica keeps answering completions."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from process_watch import descendants

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready (exit code {proc.poll()})")


def _complete(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})


def test_health_is_degraded_while_one_replica_is_down(tiny_qwen3_dir):
    port = _free_port()
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", tiny_qwen3_dir, "--dp", "2", "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "128", "--max-num-batched-tokens", "256", "--port", str(port),
           "--log-stats-interval", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        health = httpx.get(f"{base}/health", timeout=5)
        assert (health.status_code, health.json()) == (200, {"status": "ready", "reason": None})

        schedulers = [pid for pid in descendants(proc.pid) if "scheduler_proc.scheduler_loop"
                      in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(schedulers) == 2
        signal_sent = time.monotonic()
        os.kill(schedulers[1], signal.SIGKILL)
        while True:
            health = httpx.get(f"{base}/health", timeout=5)
            if health.json()["status"] != "ready" or time.monotonic() - signal_sent > 30:
                break
            time.sleep(0.1)
        assert health.status_code == 200, health.json()
        body = health.json()
        assert body["status"] == "degraded", body
        assert re.fullmatch(r"replica (\d) is down: replica \1 scheduler 0 was killed by SIGKILL",
                            body["reason"]), body
        for _ in range(3):  # the surviving replica takes every request
            done = _complete(base)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_dead_outranks_degraded_and_degraded_is_still_served():
    """The order of the states for one connection: dead (503) before degraded (200)."""
    from types import SimpleNamespace

    from frontend.openai_server.health import health_of

    why = "replica 1 is down: replica 1 worker 0 exited with code 1"
    serving = SimpleNamespace(welcome=object(), dead_reason=None, lost_reason=None)
    state = health_of(serving, why)
    assert (state.http_status, state.body()) == (200, {"status": "degraded", "reason": why})
    assert health_of(serving).body() == {"status": "ready", "reason": None}
    dead = SimpleNamespace(welcome=object(), dead_reason="engine dead: tokenizer 0 exited",
                           lost_reason=None)
    assert health_of(dead, why).http_status == 503
    assert health_of(dead, why).body()["status"] == "dead"
