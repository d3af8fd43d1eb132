"""Two launchers for one port: one serves, the other exits 1 with one line saying the port is
in use, whichever moment it finds out (its own check, its HTTP listen, or its tokenizer's bind
seconds later), and the first keeps serving."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from frontend.engine.usage import EXIT_FAILED, EXIT_STOPPED

pytestmark = pytest.mark.slow  # races whole launchers

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = ("nanopipe: starting ", "nanopipe: worker ", "nanopipe: KV cache: ")
"""What start-up prints before it can fail; not part of an error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model: str, flags: list[str], out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from frontend.engine.cli import main; "
           "sys.exit(main())", "serve", model, "--device", "cpu", "--max-model-len", "128",
           "--log-stats-interval", "0", *flags]
    return subprocess.Popen(cmd, stdout=(out / "stdout").open("w"),
                            stderr=(out / "stderr").open("w"), cwd=ROOT)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and not line.startswith(PROGRESS)]


def test_a_client_port_taken_while_the_workers_load_is_one_line(tiny_qwen3_dir, tmp_path):
    """The ZMQ client port is checked free before start-up but bound by the tokenizer seconds
    later; here a listener (as another launcher's tokenizer would be) takes it in between."""
    port = _free_port()
    proc = _launch(tiny_qwen3_dir, ["--no-http", "--zmq-transport", "tcp", "--zmq-port",
                                    str(port)], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "nanopipe: starting " not in (tmp_path / "stderr").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))
            other.listen()
            assert proc.wait(timeout=120) == EXIT_FAILED
            stderr = (tmp_path / "stderr").read_text()
            assert _error_lines(stderr) == [
                f"nanopipe: tokenizer 0 failed to start: the client port {port} on 127.0.0.1 "
                "is already in use (another process took it during start-up)"], stderr
            assert "Traceback" not in stderr
            assert "ready" not in (tmp_path / "stdout").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["http"])
def test_the_second_launcher_for_a_port_says_so_in_one_line(kind, tiny_qwen3_dir, tmp_path):
    """Both started at once."""
    port = _free_port()
    flags = (["--port", str(port)] if kind == "http" else
             ["--no-http", "--zmq-transport", "tcp", "--zmq-port", str(port)])
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    procs = [_launch(tiny_qwen3_dir, flags, d) for d in dirs]
    try:
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither launcher gave the port up"
            time.sleep(0.1)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = procs[1 - loser]
        stderr = (dirs[loser] / "stderr").read_text()
        assert procs[loser].returncode == EXIT_FAILED, stderr
        errors = _error_lines(stderr)
        assert len(errors) == 1 and "Traceback" not in stderr, stderr
        what = "the HTTP port" if kind == "http" else "the client port"
        other = (dirs[1 - loser] / "stderr").read_text()
        assert f"{what} {port} on 127.0.0.1 is already in use" in errors[0], stderr + other
        assert "ready" not in (dirs[loser] / "stdout").read_text()

        winner_out = dirs[1 - loser] / "stdout"
        while "nanopipe ready" not in winner_out.read_text():
            assert winner.poll() is None, (dirs[1 - loser] / "stderr").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        if kind == "http":
            while httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        else:
            assert f"clients connect to: tcp://127.0.0.1:{port}" in winner_out.read_text()
        assert winner.poll() is None
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(timeout=60) == EXIT_STOPPED
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
