"""`python -m frontend.actors.stdout_detokenizer` as a user runs it, against live pipelines: it
attaches deterministically, names requests by their client ids, fails fast on a wrong address
and exits when the pipeline stops or dies."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from pipeline_config import tiny_engine

from frontend import Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import Ready, SamplingParams, StartupFailed
from protocol.sockets import MessageSocket

pytestmark = pytest.mark.slow  # launches whole engines

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

class Printer:
    """`python -m frontend.actors.stdout_detokenizer` in a subprocess, read by threads."""

    def __init__(self, model_dir: str, address: str, *extra: str,
                 argv: list[str] | None = None) -> None:
        self.started = time.monotonic()
        # faulthandler: a printer stuck past a test's deadline is sent SIGABRT and prints
        # where each of its threads stood (stuck_at).
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "frontend.actors.stdout_detokenizer",
                     "--model", model_dir, address, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        self.out: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.err: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, q=q: [q.put(line) for line in s],
                             daemon=True).start()

    def _until(self, q: queue.SimpleQueue, seen: list[str], text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = q.get(timeout=0.1)
            except queue.Empty:
                continue
            seen.append(line)
            if text in line:
                return line
        status = self.proc.poll()
        raise AssertionError(f"{text!r} never printed in {timeout:g} s (exit status {status}); "
                             f"stdout={self.stdout} stderr={seen}{self.stuck_at()}")

    def stuck_at(self) -> str:
        """The tracebacks of a printer that is still running, read after SIGABRT."""
        if self.proc.poll() is not None:
            return ""
        self.proc.send_signal(signal.SIGABRT)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "; it did not answer SIGABRT"
        time.sleep(0.2)  # let the reader thread take the last lines
        lines = []
        while not self.err.empty():
            lines.append(self.err.get())
        return "; where it stood:\n" + "".join(lines)

    def stdout_until(self, text: str, timeout: float = 90) -> str:
        return self._until(self.out, self.stdout, text, timeout)

    def stderr_until(self, text: str, timeout: float = 120) -> str:
        # Generous: two printers load the tokenizer at once beside a live pipeline, and a
        # busy 2-core machine has taken over 30 s for it.
        return self._until(self.err, self.stderr, text, timeout)

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.1)  # let the reader threads take the last lines
        for q, seen in ((self.out, self.stdout), (self.err, self.stderr)):
            while not q.empty():
                seen.append(q.get())
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_printer_shows_the_first_request_after_attaching_and_exits_with_the_pipeline(
        tiny_qwen3_dir):
    """Attached by its deltas_pub address and by the public client address, each printer
    prints the request submitted right after it says "attached", under the client's id."""
    pipeline = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir)))
    pipeline.start()
    printers = []
    try:
        printers = [Printer(tiny_qwen3_dir, pipeline.endpoints.deltas_pub),
                    Printer(tiny_qwen3_dir, pipeline.address)]
        for p in printers:
            p.stderr_until("attached to")
        with Client(pipeline.address) as client:
            out = client.generate("print me", params=GREEDY)
        for p in printers:
            p.stdout_until(f"[{out.request_id}] <finish: length>")
            assert f"[{out.request_id}] {out.text}\n" in "".join(p.stdout)
        pipeline.stop()
        stopped = time.monotonic()
        for p in printers:
            assert p.wait() == 0
            assert time.monotonic() - stopped < 10
            assert "the pipeline stopped" in p.stderr[-1]
            # The engine's stats share the socket; the printer skips them without a word.
            assert not [line for line in p.stderr if "bad frame" in line]
    finally:
        pipeline.stop()
        for p in printers:
            p.kill()


def _unused_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["missing ipc socket", "missing run directory", "silent tcp",
                                  "http address", "tcp without a port"])
def test_a_wrong_address_fails_within_seconds(tiny_qwen3_dir, tmp_path, kind):
    address, expected = {
        "missing ipc socket": (f"ipc://{tmp_path}/deltas_pub", "the socket file does not exist"),
        "missing run directory": (str(tmp_path / "gone"), "neither a zmq address nor a run"),
        "silent tcp": (_unused_tcp_address(), "no pipeline answered at"),
        "http address": ("http://127.0.0.1:8000", "is not a pipeline address"),
        "tcp without a port": ("tcp://127.0.0.1", "is not a pipeline address: no HOST:PORT"),
    }[kind]
    printer = Printer(tiny_qwen3_dir, address, "--attach-timeout", "2")
    try:
        assert printer.wait(timeout=15) == 1
    finally:
        printer.kill()
    assert time.monotonic() - printer.started < 10
    assert printer.stdout == []
    assert len(printer.stderr) == 1 and expected in printer.stderr[0]


def test_a_tcp_pipelines_client_address_asks_for_its_run_directory(tiny_qwen3_dir):
    """Its deltas are encrypted with keys kept in the run directory: the client address alone
    cannot attach, and the printer says what to give instead of "no pipeline answered"."""
    pipeline = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir), transport="tcp"))
    pipeline.start()
    try:
        printer = Printer(tiny_qwen3_dir, pipeline.address, "--attach-timeout", "20")
        try:
            assert printer.wait(timeout=30) == 1
        finally:
            printer.kill()
    finally:
        pipeline.stop()
    assert len(printer.stderr) == 1, printer.stderr
    assert "is a tcp pipeline" in printer.stderr[0] and "run directory" in printer.stderr[0]


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_the_printer_exits_when_the_engine_dies(tiny_qwen3_dir, victim):
    """A dead worker: the scheduler says goodbye with the reason. A dead scheduler says
    nothing: its heartbeats stop."""
    pipeline = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir)))
    pipeline.start()
    printer = None
    try:
        printer = Printer(tiny_qwen3_dir, pipeline.endpoints.run_dir, "--silence-timeout", "2")
        printer.stderr_until("attached to")
        proc = next(c for c in pipeline.children if c.role == victim)
        os.kill(proc.pid, signal.SIGKILL)
        assert printer.wait() == 1
        expected = ("engine dead: worker 0 was killed by SIGKILL" if victim == "worker"
                    else "no word from")
        assert expected in printer.stderr[-1]
    finally:
        pipeline.stop()
        if printer is not None:
            printer.kill()


def _as_launched(model_dir: str, address: str, control: str) -> list[str]:
    """How the launcher starts it: run_attached with the control address to report to."""
    code = ("import sys; from frontend.actors.stdout_detokenizer import run_attached; "
            "run_attached(sys.argv[1], sys.argv[2], control_address=sys.argv[3])")
    return [sys.executable, "-c", code, model_dir, address, control]


@pytest.mark.parametrize("reachable", [True, False])
def test_started_by_a_launcher_it_reports_to_the_control_socket(tiny_qwen3_dir, tmp_path,
                                                               reachable):
    """READY means attached: a request submitted right after it is printed whole. A printer
    that cannot attach says why with StartupFailed instead."""
    ctx = zmq.Context()
    control_address = f"ipc://{tmp_path}/control"
    control = MessageSocket(ctx, zmq.PULL, control_address, bind=True,
                            accepts=(Ready, StartupFailed))
    pipeline = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) if reachable else None
    printer = None
    try:
        if pipeline is not None:
            pipeline.start()
        address = pipeline.endpoints.deltas_pub if pipeline else f"ipc://{tmp_path}/nothing"
        printer = Printer("", "", argv=_as_launched(tiny_qwen3_dir, address, control_address))
        assert control.poll(90_000)
        report = control.recv()
        if not reachable:
            assert isinstance(report, StartupFailed)
            assert report.role == "stdout_detokenizer" and "no pipeline at" in report.error
            assert printer.wait() == 1
            return
        assert report == Ready("stdout_detokenizer", 0, 0, f"attached to {address}")
        with Client(pipeline.address) as client:
            out = client.generate("launched", params=GREEDY)
        printer.stdout_until(f"[{out.request_id}] <finish: length>")
        assert f"[{out.request_id}] {out.text}\n" in "".join(printer.stdout)
    finally:
        if pipeline is not None:
            pipeline.stop()
        if printer is not None:
            printer.kill()
        control.close()
        ctx.term()


def _lines_until(lines: queue.Queue, wanted, deadline: float, stderr_path: Path) -> list[str]:
    """The launcher's stdout lines up to the first that `wanted` accepts. Past the deadline the
    test fails with the launcher's stderr, which says where start-up or the printer stood."""
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no such line in time; stdout {seen!r}; stderr:\n"
                        f"{stderr_path.read_text()[-4000:]}")
        if line is None:
            pytest.fail(f"the launcher closed stdout; stderr:\n{stderr_path.read_text()[-4000:]}")
        seen.append(line)
        if wanted(line):
            return seen


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_launch_stdout_prints_the_first_request_sent_right_after_ready(tiny_qwen3_dir,
                                                                       transport, tmp_path):
    """`launch.sh --stdout` says "ready" only once its printer is attached (over tcp, with
    the run's keys for the authenticated internal links)."""
    stderr_path = tmp_path / "launcher.err"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [str(ROOT / "scripts" / "launch.sh"), "--model", tiny_qwen3_dir, "--device", "cpu",
             "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "512",
             "--stdout", "--zmq-transport", transport, "--log-level", "debug", "--no-http"],
            stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        ready = _lines_until(lines, lambda line: line.startswith("clients connect to: "),
                             deadline, stderr_path)
        address = ready[-1].split(": ", 1)[1].strip()
        with Client(address) as client:
            out = client.generate("first words", params=GREEDY)
        expected = f"[{out.request_id}] <finish: length>"
        printed = _lines_until(lines, lambda line: expected in line, deadline, stderr_path)
        assert f"[{out.request_id}] {out.text}\n" in "".join(printed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
