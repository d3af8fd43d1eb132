"""`--metrics-port`: a launcher without HTTP serves Prometheus metrics on a port of its own;
a port in use is a one-line error before anything starts."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
from launcher_lines import LauncherLines
from prometheus_client.parser import text_string_to_metric_families

from frontend import Client
from protocol import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [str(ROOT / "scripts" / "launch.sh"), "--device", "cpu", "--dtype", "float32",
          "--max-model-len", "256", "--log-stats-interval", "0", "--no-http"]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BURST = 200


def queued_connections(port: int, count: int, wait_s: float = 10) -> int:
    """Open `count` connections at once; how many the kernel completed within `wait_s`
    (a full listen backlog leaves the rest retrying their SYN)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        pending, deadline = set(socks), time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.2)
            pending -= {s for s in writable if s.getsockopt(socket.SOL_SOCKET,
                                                            socket.SO_ERROR) == 0}
        return count - len(pending)
    finally:
        for s in socks:
            s.close()


def samples(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=30).text
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels or "finished_reason" in s.labels}


def test_metrics_port_serves_what_the_requests_did(tiny_qwen3_dir):
    port = free_port()
    proc = subprocess.Popen([*LAUNCH, "--model", tiny_qwen3_dir, "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until = LauncherLines(proc).read_until

    try:
        address = read_until(r"clients connect to: (\S+)").group(1)
        url = read_until(r"Prometheus metrics: (\S+)").group(1)
        assert url == f"http://127.0.0.1:{port}/metrics"
        with Client(address) as client:
            outs = [client.generate(f"request number {i}", params=PARAMS) for i in range(3)]
        done = 'nanopipe:requests_finished_total[(\'finished_reason\', \'length\')]'
        deadline = time.monotonic() + 20
        while (got := samples(url)).get(done) != 3:
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got["nanopipe:generation_tokens_total[]"] == sum(len(o.token_ids) for o in outs)
        assert got["nanopipe:prompt_tokens_total[]"] >= sum(o.prompt_tokens for o in outs) - 32
        for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                     "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert got[f"nanopipe:{name}_count[]"] == 3
        info = [(s.labels, s.value) for family in text_string_to_metric_families(
            httpx.get(url, timeout=30).text) for s in family.samples
            if s.name == "nanopipe:cache_config_info"]
        assert info == [({"block_size": "16", "cache_dtype": "float32",
                          "kv_offloading_gib": "0.0"}, 1.0)]
        head = httpx.head(url, timeout=30)  # an uptime probe's check
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"].startswith("text/plain")
        # A burst of connections queues in the listen backlog while the launcher is busy
        # (here: stopped), instead of most of them waiting out SYN retries.
        proc.send_signal(signal.SIGSTOP)
        try:
            burst = queued_connections(port, BURST)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert burst == BURST
        assert samples(url)[done] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_metrics_port_in_use_is_a_one_line_error(tiny_qwen3_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([*LAUNCH, "--model", tiny_qwen3_dir, "--metrics-port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1  # a start-up failure, as every port in use is
    assert proc.stderr.strip() == (f"nanopipe: the metrics port {port} on 127.0.0.1 is "
                                   f"already in use")
    assert "ready" not in proc.stdout and time.monotonic() - start < 60
