"""/health as a load balancer or an orchestrator sees `nanopipe serve MODEL --port N`: 503
"starting" (saying what start-up is doing) from the moment the port is bound, then 200
"ready"; /v1/models gives the context length."""

from __future__ import annotations

import socket
import time

import httpx
from serve_cli import start_serve, stop_serve


def test_health_goes_from_starting_to_ready(tiny_qwen3_dir):
    proc, base = start_serve(tiny_qwen3_dir)
    answers: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                resp = httpx.get(f"{base}/health", timeout=5)
            except httpx.TransportError:
                assert not answers, "the port stopped answering during start-up"
                time.sleep(0.05)
                continue
            answers.append((resp.status_code, resp.json()))
            if resp.status_code == 200:
                break
            time.sleep(0.05)
        assert answers and answers[-1] == (200, {"status": "ready", "reason": None}), answers
        starting = [body for code, body in answers if code == 503]
        assert starting, "the engine was ready at the first answer: no 'starting' seen"
        assert {body["status"] for body in starting} == {"starting"}
        reasons = [body["reason"] for body in starting]
        assert all(reasons) and any("KV cache" in r or "worker" in r for r in reasons), reasons
        assert len(answers) == len(starting) + 1  # never ready, then starting again

        models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert [m["max_model_len"] for m in models] == [128]
        done = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert done.json()["usage"]["completion_tokens"] == 3
    finally:
        assert stop_serve(proc) == 0


def test_other_routes_are_503_while_starting():
    """The responder alone, on a bound socket: what a client calling too early is told."""
    from frontend.openai_server.starting import StartingResponder

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    responder = StartingResponder(sock)
    responder.reason = "loading weights"
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        resp = httpx.post(f"{base}/v1/completions", json={"prompt": "p"}, timeout=5)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "engine_starting"
        assert "loading weights" in resp.json()["error"]["message"]
        health = httpx.get(f"{base}/health?verbose=1", timeout=5)
        assert health.json() == {"status": "starting", "reason": "loading weights"}
        with socket.create_connection(sock.getsockname(), timeout=5) as silent:
            # A prober that sends nothing holds the responder for its read timeout only.
            assert httpx.get(f"{base}/health", timeout=10).status_code == 503
            silent.close()
    finally:
        responder.close()
        sock.close()
