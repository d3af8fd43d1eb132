"""`nanopipe serve MODEL --port N` in a subprocess, as a load balancer or an operator sees it:
start it on a free port, wait for /health to say ready, ask for a completion, stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
              "--max-num-batched-tokens", "256")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(model_dir: str, *flags: str, stdout: IO | int = subprocess.DEVNULL
                ) -> tuple[subprocess.Popen, str]:
    """The launcher serving `model_dir` (the tiny model's flags, then `flags`) and its base URL."""
    port = free_port()
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", model_dir, *TINY_FLAGS, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready (exit code {proc.poll()})")


def complete(base: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})


def stop_serve(proc: subprocess.Popen) -> int:
    """SIGTERM, as an orchestrator stops it; its exit code (killed if it would not stop)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
