"""`python -m frontend.actors.stdout_detokenizer` on a Linux abstract ipc address
(`ipc://@name`), as a user runs it: there is no socket file to look for, so it attaches to a
publisher bound there, and a wrong address still fails with a message that says why."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from protocol import FinishReason, TokenDeltas
from protocol.engine_messages import WatchGoodbye, WatchHeartbeat, WatchRequest
from protocol.sockets import MessageSocket

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract unix sockets are Linux-only")

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.1


def abstract_address() -> str:
    """A name no other test or pipeline uses, so runs side by side never meet."""
    return f"ipc://@nanopipe-test-{uuid.uuid4().hex}"


def start_printer(model_dir: str, address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "frontend.actors.stdout_detokenizer", "--model", model_dir,
         address, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def stderr_lines(proc: subprocess.Popen) -> queue.SimpleQueue[str]:
    """The printer's stderr, read by a thread so the publisher keeps its heartbeat going."""
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr],
                     daemon=True).start()
    return lines


def publish_until_attached(pub: MessageSocket, proc: subprocess.Popen,
                           timeout_s: float = 120) -> list[str]:
    """Heartbeat as the scheduler does until the printer says it is attached; from then on
    everything published reaches it. A printer that exits instead fails the test at once."""
    lines = stderr_lines(proc)
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        pub.send(WatchHeartbeat(interval_s=HEARTBEAT_S, dead_reason=None))
        try:
            seen.append(lines.get(timeout=HEARTBEAT_S))
        except queue.Empty:
            continue
        if "attached to" in seen[-1]:
            return seen
    time.sleep(HEARTBEAT_S)  # let the reader take a dead printer's last words
    while not lines.empty():
        seen.append(lines.get())
    raise AssertionError(f"the printer never attached (exit status {proc.poll()}); "
                         f"stderr={seen}")


def finish(proc: subprocess.Popen, timeout_s: float = 60) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, proc.stdout.read()


def test_the_printer_prints_a_stream_published_on_an_abstract_address(tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    ids = tok.encode("Hello from an abstract socket")
    address = abstract_address()
    ctx = zmq.Context()
    pub = MessageSocket(ctx, zmq.PUB, address, bind=True)
    proc = start_printer(tiny_qwen3_dir, address)
    try:
        publish_until_attached(pub, proc)
        pub.send(WatchRequest(5, "abstract-1"))
        for step, token in enumerate(ids):
            last = step == len(ids) - 1
            pub.send(TokenDeltas(step_id=step, request_ids=[5], token_ids=[[token]],
                                 finish_reasons=[FinishReason.LENGTH if last else None],
                                 errors=[None], logprobs=None))
        pub.send(WatchGoodbye(reason="the pipeline stopped", engine_dead=False))
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
        ctx.term()
    assert code == 0
    assert out == ("[abstract-1] Hello from an abstract socket\n"
                   "[abstract-1] <finish: length>\n")


@pytest.mark.parametrize("kind", ["nothing bound there", "no name"])
def test_a_wrong_abstract_address_fails_with_a_reason(tiny_qwen3_dir, kind):
    """No file can show that nothing is bound at an abstract name: the printer waits
    --attach-timeout for an answer. A name that is empty is refused at once."""
    address, expected = {
        "nothing bound there": (abstract_address(), "no pipeline answered at"),
        "no name": ("ipc://@", "is not a pipeline address: no socket name"),
    }[kind]
    proc = start_printer(tiny_qwen3_dir, address, "--attach-timeout", "1")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert len(err.splitlines()) == 1 and expected in err, err
