"""`nanopipe serve` as a user starts it, timed from outside: the command's start to the first
200 from /health, one short completion, and a stop that leaves no process behind.

The server runs in a session of its own, so the bench's Ctrl-C reaches it only through the
bench's own stop: SIGINT to the launcher, as a terminal's Ctrl-C, then SIGKILL past the grace
period. The launcher's actors run in sessions of their own and end when it does; the stop
still kills any of the processes it saw under the launcher that outlive it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import psutil

POLL_S = 0.05
"""How often /health is asked while the server starts."""

_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Requests to the server on loopback, never through a proxy the environment names."""

STOP_GRACE_S = 30.0
"""How long a SIGINT'ed server may take to stop before its process group is killed."""


def process_tree(pid: int) -> list[psutil.Process]:
    """The live descendants of `pid`. psutil keeps each one's start time, so a pid the kernel
    reuses later is never taken for one of them."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(proc: psutil.Process) -> bool:
    """Still running as the same process, and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_survivors(seen: dict[int, psutil.Process]) -> int:
    """SIGKILL each process of `seen` still alive as the same process; how many were."""
    killed = 0
    for proc in seen.values():
        if _alive(proc):
            try:
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
    return killed


def process_alive(seen: dict[int, psutil.Process]) -> bool:
    """Whether any process of `seen` is still alive as the same process."""
    return any(_alive(proc) for proc in seen.values())


def free_port() -> int:
    """A loopback port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str | None, port: int, device: str, extra: list[str]) -> list[str]:
    """`nanopipe serve [MODEL] --port P --device D EXTRA...`, as this interpreter runs it."""
    return [sys.executable, "-m", "frontend.engine.cli", *([model] if model else []),
            "--port", str(port), "--device", device, *extra]


class ServeProcess:
    """One `nanopipe serve` child: its output kept (last lines) and read on threads, so a
    chatty server never blocks on a full pipe."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # The child runs this checkout's nanopipe, wherever the bench was started from.
        root = str(Path(__file__).resolve().parents[3])
        path = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(command, env=dict(env, PYTHONPATH=path),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     encoding="utf-8", errors="replace",
                                     start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}
        """The launcher's descendants as last looked at (the stop's list of what to end)."""
        self.stderr: list[str] = []
        self.tail: deque[str] = deque(maxlen=40)
        self._readers = [threading.Thread(target=self._read, args=(s, keep), daemon=True)
                         for s, keep in ((self.proc.stdout, False), (self.proc.stderr, True))]
        for t in self._readers:
            t.start()

    def _read(self, stream, keep: bool) -> None:
        for line in stream:
            self.tail.append(line.rstrip("\n"))
            if keep:
                self.stderr.append(line)

    def output_tail(self, lines: int = 12) -> str:
        return "\n".join(list(self.tail)[-lines:])

    def wait_healthy(self, port: int, timeout_s: float) -> float:
        """Seconds from the command's start to /health's first 200, asked every POLL_S.
        RuntimeError when the server exits first or takes longer than `timeout_s`."""
        url = f"http://127.0.0.1:{port}/health"
        polls = 0
        while True:
            try:
                with _LOCAL.open(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - self.started
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, 503 while it starts, or cut off
            if polls % 10 == 0:  # the launcher's actors, should it die and orphan them
                self.seen.update((p.pid, p) for p in process_tree(self.proc.pid))
            polls += 1
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was "
                                   f"ready:\n{self.output_tail()}")
            if time.perf_counter() - self.started > timeout_s:
                raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n"
                                   f"{self.output_tail()}")
            time.sleep(POLL_S)

    def first_answer(self, port: int, prompt: str, max_tokens: int) -> tuple[float, str]:
        """(seconds, text) of one greedy /v1/completions request, the server's first."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with _LOCAL.open(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        return time.perf_counter() - t0, answer["choices"][0]["text"]

    def stderr_text(self, wait_for: str = "", timeout_s: float = 5.0) -> str:
        """What the server wrote on stderr so far; first waits up to `timeout_s` for a line
        holding `wait_for` (the reader thread may be a moment behind the server)."""
        deadline = time.perf_counter() + timeout_s
        while wait_for and time.perf_counter() < deadline:
            if any(wait_for in line for line in self.stderr):
                break
            time.sleep(0.02)
        return "".join(self.stderr)

    def stop(self) -> None:
        """SIGINT (the server's own Ctrl-C stop), then SIGKILL past STOP_GRACE_S; then every
        process seen under the launcher that is still there is killed too."""
        try:
            self.seen.update((p.pid, p) for p in process_tree(self.proc.pid))
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    print(f"the server did not stop within {STOP_GRACE_S:.0f} s: killed",
                          file=sys.stderr, flush=True)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            deadline = time.perf_counter() + 5.0  # the actors see their launcher go
            while process_alive(self.seen) and time.perf_counter() < deadline:
                time.sleep(0.1)
            if _kill_survivors(self.seen):
                print("killed server processes that outlived their launcher", file=sys.stderr,
                      flush=True)
            for t in self._readers:
                t.join(timeout=2.0)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
