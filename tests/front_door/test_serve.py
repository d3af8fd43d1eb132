"""`nanopipe serve MODEL [--port N]` as an operator runs it: start-up says what it is doing,
the HTTP API answers under the served name, and the process exits (non-zero, cleaned up)
when its engine dies instead of serving 503s forever."""

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
import pytest
from process_watch import alive, descendants

pytestmark = pytest.mark.slow  # launches whole engines

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_http_reports_progress_and_exits_when_its_engine_dies(tiny_qwen3_dir):
    port = _free_port()
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", tiny_qwen3_dir, "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "128", "--max-num-batched-tokens", "256",
           "--port", str(port), "--served-model-name", "tiny-chat"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("HTTP API: "):
                break
        output = "".join(seen)
        assert "loading weights" in output and "KV cache" in output, output
        run_dir = Path(re.search(r"clients connect to: ipc://(\S+)/tokenizer", output).group(1))
        base = f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline:  # the listening socket is bound before start-up
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
        done = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny-chat", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        # The launcher's own stats follower feeds the HTTP server's /metrics.
        while "nanopipe:e2e_request_latency_seconds_count 1.0" not in (
                scraped := httpx.get(f"{base}/metrics", timeout=30).text):
            assert time.monotonic() < deadline, scraped
            time.sleep(0.2)
        assert "nanopipe:generation_tokens_total 3.0" in scraped

        children = sorted(descendants(proc.pid))
        worker = next(pid for pid in children
                      if "gpu_workers.worker_proc" in Path(f"/proc/{pid}/cmdline").read_text())
        os.kill(worker, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "engine dead: worker 0 was killed by SIGKILL" in rest
    assert not run_dir.exists()
    assert not [pid for pid in children if alive(pid)]


def _serve_until_http_line(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", model, "--device", "cpu", "--max-model-len", "128", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("HTTP API: "):
            return proc, line.strip()
    proc.wait()
    raise AssertionError("".join(seen))


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    return rest


def test_serve_without_a_port_serves_http_on_8000_as_vllm_does(tiny_qwen3_dir):
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", 8000))
        except OSError:
            pytest.skip("something else listens on port 8000")
    proc, line = _serve_until_http_line(tiny_qwen3_dir)
    try:
        assert line == "HTTP API: http://127.0.0.1:8000/v1"
        models = httpx.get("http://127.0.0.1:8000/v1/models", timeout=30)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == [Path(tiny_qwen3_dir).name]
    finally:
        rest = _stop(proc)
    assert proc.returncode == 0, rest


def test_no_http_says_so_at_start_up(tiny_qwen3_dir):
    proc, line = _serve_until_http_line(tiny_qwen3_dir, "--no-http")
    try:
        assert line == "HTTP API: off (--no-http)"
    finally:
        rest = _stop(proc)
    assert proc.returncode == 0, rest


def test_dp_start_up_lines_name_their_replica_in_order(tiny_qwen3_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from frontend.engine.cli import main; "
         "sys.exit(main())", "serve", tiny_qwen3_dir, "--device", "cpu", "--dp", "2",
         "--max-model-len", "128", "--no-http", "--log-stats-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("HTTP API: "):
                break
    finally:
        rest = _stop(proc)
    assert proc.returncode == 0, "\n".join(lines) + rest
    progress = [line.removeprefix("nanopipe: ") for line in lines
                if line.startswith("nanopipe: ") and ": " in line.removeprefix("nanopipe: ")]
    workers = [line for line in progress if "worker" in line.split(":")[0]]
    # Each replica's worker says what it loads and sizes, every line naming its replica.
    assert all(re.match(r"replica [01] worker 0: ", line) for line in workers), workers
    assert len(workers) == 4, workers
    replicas = [line.split()[1] for line in workers]
    assert replicas == sorted(replicas), workers  # replica 0's lines, then replica 1's
    kv = next(i for i, line in enumerate(progress) if line.startswith("KV cache: "))
    assert kv > max(progress.index(line) for line in workers)
