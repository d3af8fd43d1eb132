"""`python -m frontend.top` as an operator runs it: in a terminal (a pseudo-terminal here),
against a live tiny pipeline; `q` detaches without disturbing the engine, the end of the
engine is shown, and a wrong address fails within seconds."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest
from pipeline_config import tiny_engine

from frontend import Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import SamplingParams

pytestmark = pytest.mark.slow  # launches whole engines

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


class Screen:
    """`python -m frontend.top ADDRESS` in a pseudo-terminal, its output read as plain text."""

    def __init__(self, address: str, *extra: str) -> None:
        self.proc = pexpect.spawn(sys.executable, ["-m", "frontend.top", address, *extra],
                                  cwd=str(ROOT), dimensions=(40, 140), encoding="utf-8",
                                  env={**os.environ, "TERM": "xterm-256color"})
        self.text = ""

    def until(self, pattern: str, timeout: float = 60) -> re.Match:
        """Read until the text since the last match shows `pattern` (a regex)."""
        deadline = time.monotonic() + timeout
        raw = ""
        while time.monotonic() < deadline:
            try:
                raw += self.proc.read_nonblocking(65536, timeout=0.2)
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                break
            self.text = ANSI.sub("", raw)
            found = re.search(pattern, self.text)
            if found:
                return found
        raise AssertionError(f"{pattern!r} never shown; screen: {self.text[-3000:]}")

    def exit_status(self, timeout: float = 15) -> int:
        self.proc.expect(pexpect.EOF, timeout=timeout)
        self.text += ANSI.sub("", self.proc.before or "")
        self.proc.close()
        return self.proc.exitstatus

    def kill(self) -> None:
        if self.proc.isalive():
            self.proc.kill(signal.SIGKILL)


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipeline:
        yield pipeline


def test_top_shows_requests_and_tokens_and_q_leaves_the_engine_serving(pipeline):
    screen = Screen(pipeline.address, "--interval", "0.2")
    try:
        screen.until(r"\(q quits\)")
        screen.until(r"running 0 ")  # the first stats: attached and measuring
        with Client(pipeline.address) as client:
            outs = [client.generate(f"watch me {i}", params=GREEDY) for i in range(2)]
        for out in outs:  # each request's row: its engine id, the client's id, 12 tokens
            screen.until(rf"\d+\s+{out.request_id}\s+12\s+([\d.,]+|-)\s+[\d.]+s\s+length")
        screen.until(r"finished 2 .*\n.*generated 24 ")
        screen.proc.send("q")
        assert screen.exit_status() == 0
    finally:
        screen.kill()
    with Client(pipeline.address) as client:  # the engine never noticed
        assert client.generate("still there", params=GREEDY).completion_tokens == 12


def test_ctrl_c_detaches_too(pipeline):
    screen = Screen(pipeline.address)
    try:
        screen.until(r"\(q quits\)")
        screen.proc.sendintr()
        assert screen.exit_status() == 0
    finally:
        screen.kill()
    with Client(pipeline.address) as client:
        assert client.generate("after ctrl-c", params=GREEDY).completion_tokens == 12


def test_once_prints_one_frame(pipeline):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "frontend.top", pipeline.endpoints.run_dir,
                           "--once"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert re.search(r"requests\s+running \d+   waiting \d+   finished \d+", done.stdout)
    assert re.search(r"KV blocks\s+░+ \d+/[\d,]+ ", done.stdout)
    assert "\x1b[" not in done.stdout  # no terminal, no escape codes


def _unused_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["missing ipc socket", "missing run directory", "silent tcp",
                                  "http address", "tcp without a port"])
def test_a_wrong_address_fails_within_seconds(tmp_path, kind):
    address, expected = {
        "missing ipc socket": (f"ipc://{tmp_path}/deltas_pub", "the socket file does not exist"),
        "missing run directory": (str(tmp_path / "gone"), "neither a zmq address nor a run"),
        "silent tcp": (_unused_tcp_address(), "no pipeline answered at"),
        "http address": ("http://127.0.0.1:8000", "is not a pipeline address"),
        "tcp without a port": ("tcp://127.0.0.1", "is not a pipeline address: no HOST:PORT"),
    }[kind]
    started = time.monotonic()
    screen = Screen(address)
    try:
        assert screen.exit_status(timeout=30) == 1
    finally:
        screen.kill()
    assert time.monotonic() - started < 15
    assert screen.text.startswith("nanopipe-top: ") and expected in screen.text
    assert len(screen.text.strip().splitlines()) == 1


@pytest.mark.parametrize("ending", ["stop", "worker killed"])
def test_the_end_of_the_engine_is_shown(tiny_qwen3_dir, ending):
    pipeline = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir)))
    pipeline.start()
    screen = Screen(pipeline.address, "--interval", "0.2")
    try:
        screen.until(r"running 0 ")
        if ending == "stop":
            pipeline.stop()
        else:
            os.kill(next(c for c in pipeline.children if c.role == "worker").pid,
                    signal.SIGKILL)
        code = screen.exit_status(timeout=30)
        expected = ("the pipeline stopped" if ending == "stop"
                    else "engine dead: worker 0 was killed by SIGKILL")
        assert code == (0 if ending == "stop" else 1)
        # The last frame stays on the screen with the reason, and the reason is said once more.
        assert re.search(rf"nanopipe top .*{expected}", screen.text), screen.text[-2000:]
        assert re.search(rf"\nnanopipe-top: {expected}[^\n]*$", screen.text.rstrip())
    finally:
        pipeline.stop()
        screen.kill()


def test_once_shows_the_host_tier_with_its_swaps(tiny_qwen3_dir):
    from pipeline_config import kv_bytes_per_token
    from test_swap import GREEDY as CROWD_PARAMS
    from test_swap import HOST_GIB, POOL_TOKENS, _prompts

    from frontend import LLM

    per_token = kv_bytes_per_token(tiny_qwen3_dir)
    cfg = tiny_engine(tiny_qwen3_dir, max_model_len=64, kv_cache_bytes=per_token * POOL_TOKENS,
                      kv_offloading_size=HOST_GIB)
    with LLM(**cfg) as llm:
        llm.generate(_prompts(), CROWD_PARAMS, use_tqdm=False)  # outgrows the pool: swaps
        done = subprocess.run([sys.executable, "-m", "frontend.top",
                               llm.pipeline.endpoints.run_dir, "--once"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    found = re.search(r"host tier\s+[█░]+ \d+/[\d,]+ .*\n\s*hits [\d,]+ tok   "
                      r"stored ([\d.]+) KiB   loaded [\d.]+ KiB\s*\n\s*swaps (\d+) out / (\d+) in",
                      done.stdout)
    assert found, done.stdout
    assert float(found[1]) > 0 and int(found[2]) > 0 and int(found[3]) > 0
