"""The offline API as a user's first script uses it: no main guard, no close().

Each form (a script file, `python -`, `python -c`) runs `LLM` end to end on a tiny model,
prints the pids of the engine's processes and its run directory, and simply ends. The
interpreter must exit by itself, leaving no process and no run directory behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from process_watch import alive

pytestmark = pytest.mark.slow  # runs user scripts that each start an engine

SCRIPT = """\
import json
from frontend import LLM, SamplingParams

llm = LLM({model!r}, device="cpu", dtype="float32", max_model_len=128,
          max_num_batched_tokens=256)
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
print("ENGINE", json.dumps({{"pids": [c.pid for c in llm.pipeline.children],
                             "run_dir": llm.pipeline.endpoints.run_dir,
                             "tokens": out[0]["token_ids"]}}), flush=True)
"""


def _engine_info(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("ENGINE "))
    return json.loads(line.removeprefix("ENGINE "))


def _assert_nothing_left(info: dict) -> None:
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in info["pids"] if alive(pid)]
    assert not os.path.exists(info["run_dir"])


@pytest.mark.parametrize("form", ["file", "stdin", "dash_c"])
def test_a_plain_script_runs_and_exits_without_close(form, tiny_qwen3_dir, tmp_path):
    source = SCRIPT.format(model=tiny_qwen3_dir)
    if form == "file":
        path = tmp_path / "first_try.py"
        path.write_text(source)
        cmd, stdin = [sys.executable, str(path)], None
    elif form == "stdin":
        cmd, stdin = [sys.executable, "-"], source
    else:
        cmd, stdin = [sys.executable, "-c", source], None
    # Run from an unrelated folder, as a user's script is.
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    info = _engine_info(done.stdout)
    assert len(info["tokens"]) == 4
    assert len(info["pids"]) == 4  # worker, scheduler, detokenizer, tokenizer
    _assert_nothing_left(info)


def _as_from_a_terminal() -> None:
    """The script gets Ctrl-C as a terminal's foreground job does. A shell starts background
    jobs (a CI runner's `cmd &`, nohup) with SIGINT ignored, every child inherits that, and
    Python then installs no KeyboardInterrupt handler: the script could never see Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_generate_leaves_nothing_behind(tiny_qwen3_dir, tmp_path):
    source = SCRIPT.format(model=tiny_qwen3_dir) + """
print("GENERATING", flush=True)
llm.generate(["go on"] * 1024, SamplingParams(max_tokens=100, ignore_eos=True),
             use_tqdm=False)
import time
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=_as_from_a_terminal)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("GENERATING"):
            break
    info = _engine_info("".join(lines))
    time.sleep(0.5)  # into the call: a Ctrl-C before it interrupts the script's own line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and err.rstrip().endswith("\nKeyboardInterrupt"), err
    # As any interrupted call: the user's line and the call, no chained exceptions inside.
    traceback = err[err.index("Traceback"):]
    for inside in ("During handling", "CancelledError", "RuntimeError", "asyncio"):
        assert inside not in traceback, err
    assert "in generate" in traceback, err  # it interrupted generate, not the sleep after
    assert traceback.count("Traceback") == 1 and len(traceback.splitlines()) <= 10, err
    _assert_nothing_left(info)


def test_ctrl_c_while_asyncio_sets_up_is_a_keyboard_interrupt_too(tiny_qwen3_dir, tmp_path):
    """Ctrl-C handled just after asyncio.run installed its SIGINT handler (the signal arrived
    a moment before): CPython's runner then lets CancelledError out instead of turning it into
    KeyboardInterrupt. The script raises the signal at that moment, every time."""
    source = SCRIPT.format(model=tiny_qwen3_dir) + """
import signal
real_signal = signal.signal

def ctrl_c_as_asyncio_sets_up(signum, handler):
    previous = real_signal(signum, handler)
    if signum == signal.SIGINT and handler is not signal.default_int_handler:
        signal.raise_signal(signal.SIGINT)
    return previous

signal.signal = ctrl_c_as_asyncio_sets_up
llm.generate(["go on"], SamplingParams(max_tokens=8), use_tqdm=False)
"""
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          cwd=tmp_path, preexec_fn=_as_from_a_terminal, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr[-2000:]
    assert "CancelledError" not in proc.stderr
    _assert_nothing_left(_engine_info(proc.stdout))
