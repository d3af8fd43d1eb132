"""/health of `nanopipe serve MODEL --dp 2 --port N` when one replica is lost: 200 "degraded"
with a reason naming the replica, while the other replica keeps answering completions."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
from process_watch import descendants
from serve_cli import complete, start_serve, stop_serve, wait_ready


def test_health_is_degraded_while_one_replica_is_down(tiny_qwen3_dir):
    proc, base = start_serve(tiny_qwen3_dir, "--dp", "2", "--log-stats-interval", "0")
    try:
        wait_ready(base, proc)
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
            done = complete(base)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        assert proc.poll() is None
    finally:
        assert stop_serve(proc) == 0


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


def test_no_prefill_replica_left_is_unavailable_not_degraded():
    """Disaggregation with every prefill replica down: the decode replicas still finish what
    they hold, but no new request can be served, so a load balancer must look elsewhere."""
    from types import SimpleNamespace

    from frontend.engine.disagg import replicas_down
    from frontend.openai_server.health import health_of

    cfg = SimpleNamespace(prefill_replicas=2)
    serving = SimpleNamespace(welcome=object(), dead_reason=None, lost_reason=None)
    one = replicas_down(cfg, {1: "replica 1 scheduler 0 was killed by SIGKILL"})
    assert health_of(serving, one).body() == {
        "status": "degraded", "reason": "replica 1 is down: replica 1 scheduler 0 was killed "
                                        "by SIGKILL"}
    both = replicas_down(cfg, {0: "gone", 1: "gone too"})
    state = health_of(serving, both)
    assert state.http_status == 503 and state.status.value == "unavailable"
    assert state.reason.startswith("replica 0 is down: gone; replica 1 is down: gone too; no "
                                   "prefill replica is alive")
    decode_lost = replicas_down(cfg, {2: "gone"})  # replicas 0-1 prefill, 2+ decode
    assert health_of(serving, decode_lost).http_status == 200
