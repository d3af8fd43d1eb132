"""A launcher killed (SIGKILL: no chance to clean up) at any point of start-up leaves nothing
behind: every child dies with it and the last one out removes the run directory."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from process_watch import alive, descendants, run_dir_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("when, after_s, extra", [
    ("starting", 0.3, ()),  # the worker is importing torch, its launcher's death unseen
    ("loading weights", 0.0, ()),
    ("KV cache:", 0.0, ()),  # the scheduler, tokenizer and detokenizer are being started
    ("KV cache:", 1.5, ()),  # ... and are building themselves
    ("KV cache:", 1.5, ("--dp", "2")),
])
def test_killing_the_launcher_during_start_up_leaves_nothing(when, after_s, extra,
                                                             tiny_qwen3_dir):
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "launch.sh"), "--model", tiny_qwen3_dir, "--device", "cpu",
         "--max-model-len", "128", "--no-http", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr],
                     daemon=True).start()
    seen: set[int] = set()
    run_dir = None
    try:
        deadline = time.monotonic() + 120
        said = ""
        while when not in said:
            assert proc.poll() is None and time.monotonic() < deadline, said
            try:
                said = lines.get(timeout=0.01)
            except queue.Empty:
                pass
            seen |= descendants(proc.pid)
            run_dir = run_dir or run_dir_of(proc.pid)
        kill_at = time.monotonic() + after_s
        while time.monotonic() < kill_at:
            seen |= descendants(proc.pid)
            time.sleep(0.01)
        seen |= descendants(proc.pid)
        run_dir = run_dir or run_dir_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # launch.sh execs python: this is the launcher
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert run_dir is not None
    deadline = time.monotonic() + 20
    while (os.path.exists(run_dir) or any(alive(pid) for pid in seen)) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in seen if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "children outlived their launcher"
    assert not os.path.exists(run_dir), "the run directory was left behind"
