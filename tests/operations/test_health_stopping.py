"""`nanopipe serve --port N` as a load balancer sees it stop: from the moment SIGTERM arrives
/health is a 503 `shutting_down`, never `ready` again, and HEAD /metrics (an uptime probe's
check) answers like GET."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_says_shutting_down_from_the_sigterm_on(tiny_qwen3_dir):
    port = _free_port()
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", tiny_qwen3_dir, "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "128", "--max-num-batched-tokens", "256", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as http:  # one keep-alive connection
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None and time.monotonic() < deadline
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            head = http.head("/metrics")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-type"].startswith("text/plain")

            proc.send_signal(signal.SIGTERM)
            answers = []
            for _ in range(50):
                try:
                    resp = http.get("/health")
                except httpx.TransportError:
                    break  # the server has closed the connection: stopped
                answers.append((resp.status_code, resp.json()["status"]))
        assert answers, "no answer after SIGTERM"
        assert set(answers) == {(503, "shutting_down")}, answers
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
