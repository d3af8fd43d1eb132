"""`nanopipe serve --port N` as a load balancer sees it stop: from the moment SIGTERM arrives
/health is a 503 `shutting_down`, never `ready` again, and HEAD /metrics (an uptime probe's
check) answers like GET."""

from __future__ import annotations

import signal

import httpx
from serve_cli import start_serve, wait_ready


def test_health_says_shutting_down_from_the_sigterm_on(tiny_qwen3_dir):
    proc, base = start_serve(tiny_qwen3_dir)
    try:
        wait_ready(base, proc)
        with httpx.Client(base_url=base, timeout=30) as http:  # one keep-alive connection
            assert http.get("/health").status_code == 200
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
