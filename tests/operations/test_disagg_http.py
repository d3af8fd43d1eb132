"""`nanopipe serve MODEL --prefill-replicas 1 --decode-replicas 1 --kv-transfer-timeout 5`
over HTTP: clients that hang up on a stream right after its first token (the moment its KV
moves to the decode replica) leave no block held on either replica, and the lost prefill
replica reads as degraded on /health, with new requests refused in a line that says why."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from process_watch import descendants
from prometheus_client.parser import text_string_to_metric_families
from serve_cli import complete, start_serve, stop_serve, wait_ready

pytestmark = pytest.mark.slow
SETTLED = {"nanopipe:num_requests_running": 0, "nanopipe:num_requests_waiting": 0,
           "nanopipe:kv_cache_usage_perc": 0, "nanopipe:kv_transfer_waiting_in": 0,
           "nanopipe:kv_transfer_waiting_out": 0}


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.labels}


def _prefill_scheduler(launcher: int) -> int:
    """Replica 0's scheduler: the one that binds no replica-prefixed input."""
    schedulers = [pid for pid in descendants(launcher) if "scheduler_proc.scheduler_loop"
                  in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(schedulers) == 2
    decode = [pid for pid in schedulers if any(
        c.laddr.endswith("/r1_scheduler_in") for c in psutil.Process(pid).net_connections("unix"))]
    return next(pid for pid in schedulers if pid not in decode)


def test_hang_ups_mid_hand_off_free_every_block_and_a_lost_prefill_replica_is_unavailable(
        tiny_qwen3_dir):
    proc, base = start_serve(tiny_qwen3_dir, "--prefill-replicas", "1", "--decode-replicas",
                             "1", "--kv-transfer-timeout", "5", "--max-model-len", "512",
                             "--log-stats-interval", "0")
    try:
        wait_ready(base, proc)
        for i in range(6):
            body = {"prompt": f"{i}: " + "tell me a long story " * 6, "max_tokens": 80,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200, resp.read()
                first = next(line for line in resp.iter_lines() if line)
                assert first.startswith("data: ")  # the first token: its hand-off begins
        deadline = time.monotonic() + 60
        while any((got := _metrics(base)).get(k) != v for k, v in SETTLED.items()):
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        done = complete(base)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3

        os.kill(_prefill_scheduler(proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{base}/health", timeout=5)).json()["status"] == "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.status_code == 503 and health.json() == {
            "status": "unavailable",
            "reason": "replica 0 is down: replica 0 scheduler 0 was killed by SIGKILL; no "
                      "prefill replica is alive: new requests are refused, the decode "
                      "replicas finish the requests they hold"}
        refused = complete(base)
        assert refused.status_code == 503, refused.text
        assert "no prefill replica is alive" in refused.text
        assert proc.poll() is None
    finally:
        assert stop_serve(proc) == 0
