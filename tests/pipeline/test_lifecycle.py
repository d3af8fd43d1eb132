"""Start, serve and stop as a user does: launch.sh, signals, dead processes, attached printers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_config import tiny_engine
from process_watch import alive, descendants

from frontend import Client, EngineDeadError
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import SamplingParams

pytestmark = pytest.mark.slow  # lifecycle: launches and signals whole engines

ROOT = Path(__file__).resolve().parents[2]
OK = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _launch(model_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ROOT / "scripts" / "launch.sh"), "--model", model_dir, "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "512",
         "--no-http", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    proc.kill()
    raise AssertionError(f"{pattern!r} not printed; output:\n{''.join(seen)}")


def test_launch_serves_and_sigterm_leaves_nothing_behind(tiny_qwen3_dir):
    proc = _launch(tiny_qwen3_dir, "--tp", "2")
    # The start-up line says where the time went (the slower of the two workers' phases):
    # its phases add up to its total, each rounded to a tenth.
    ready = _read_until(proc, r"nanopipe: ready in ([\d.]+) s \(checks ([\d.]+), "
                        r"processes ([\d.]+), weights ([\d.]+), kv ([\d.]+), "
                        r"warm-up ([\d.]+), graphs ([\d.]+), frontend ([\d.]+)\)$")
    total, *phases = map(float, ready.groups())
    assert total > 0 and abs(sum(phases) - total) <= 0.05 * (len(phases) + 1)
    address = _read_until(proc, r"clients connect to: (\S+)").group(1)
    run_dir = Path(address.removeprefix("ipc://")).parent
    children = descendants(proc.pid)
    assert len(children) >= 5  # two workers, scheduler, tokenizer, detokenizer
    with Client(address) as client:
        assert len(client.generate("hello", params=OK).token_ids) == 8
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)]
    assert not run_dir.exists()


def test_sigterm_during_startup_stops_everything(tiny_qwen3_dir):
    proc = _launch(tiny_qwen3_dir)
    time.sleep(1.5)  # workers are starting
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)]


def test_children_exit_when_the_launcher_is_killed(tiny_qwen3_dir):
    proc = _launch(tiny_qwen3_dir)
    address = _read_until(proc, r"clients connect to: (\S+)").group(1)
    run_dir = Path(address.removeprefix("ipc://")).parent
    children = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # launch.sh execs python: this is the launcher itself
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)]
    assert not run_dir.exists()  # the orphaned scheduler removed the socket files


@pytest.mark.parametrize("role", ["worker", "scheduler", "detokenizer", "tokenizer"])
def test_a_dead_process_fails_in_flight_and_new_requests(tiny_qwen3_dir, role):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipeline:
        client = Client(pipeline.address)
        stream = client.stream("keep going", params=SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        next(iter(stream))
        victim = next(c for c in pipeline.children if c.role == role)
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as in_flight:
            for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as new:
            client.generate("after death", params=OK)
        client.close()
        # Whichever connection dropped, the client reports the launcher's reason.
        assert f"{role} 0 was killed by SIGKILL" in str(in_flight.value)
        assert f"{role} 0 was killed by SIGKILL" in str(new.value)
        assert pipeline.dead_reason == f"{role} 0 was killed by SIGKILL"


def test_stdout_detokenizer_prints_generated_text(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipeline:
        printer = subprocess.Popen(
            [sys.executable, "-m", "frontend.actors.stdout_detokenizer", "--model", tiny_qwen3_dir,
             pipeline.endpoints.deltas_pub],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        try:
            # Once it says so, it misses nothing: the very next request is printed whole.
            while "attached to" not in (line := printer.stderr.readline()):
                assert line, "the printer exited without attaching"
            with Client(pipeline.address) as client:
                out = client.generate("print me", params=SamplingParams(
                    temperature=0, max_tokens=12, ignore_eos=True))
        except BaseException:
            printer.kill()
            raise
    # The pipeline has stopped: the printer finishes its output and exits by itself.
    printed, errors = printer.communicate(timeout=60)
    assert printer.returncode == 0, errors
    assert out.text.strip()
    assert f"[{out.request_id}] {out.text}\n[{out.request_id}] <finish: length>\n" in printed


def test_two_pipelines_side_by_side(tiny_qwen3_dir, tiny_llama_dir):
    """No fixed port or socket name: an ipc and a tcp pipeline serve at the same time."""
    first = Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir)))
    second = Pipeline(EngineConfig(**tiny_engine(tiny_llama_dir, transport="tcp")))
    with first, second:
        assert second.address.startswith("tcp://127.0.0.1:")
        with Client(first.address) as a, Client(second.address) as b:
            assert a.model != b.model
            assert len(a.generate("one", params=OK).token_ids) == 8
            assert len(b.generate("two", params=OK).token_ids) == 8


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_that_a_library_swallows_during_startup_still_stops_everything(
        tiny_qwen3_dir, tmp_path, sig):
    """SIGTERM or Ctrl-C lands where a library catches the KeyboardInterrupt it becomes
    (torch's C start-up does, inside its import of numpy): the launcher still stops, children
    and all. Here a wrapper of start-up swallows it, every time."""
    source = f"""
import os, signal, sys
import frontend.engine.pipeline as pipeline
from frontend.engine.cli import launch_main

real_start = pipeline.Pipeline.start

def start_swallowing_a_sigterm(self):
    try:
        os.kill(os.getpid(), {int(sig)})
        for _ in range(1000):  # the handler runs between these bytecodes
            pass
    except BaseException:
        print("swallowed", flush=True)
    real_start(self)

pipeline.Pipeline.start = start_swallowing_a_sigterm
sys.exit(launch_main(["--model", {tiny_qwen3_dir!r}, "--device", "cpu", "--dtype", "float32",
                      "--max-model-len", "256", "--max-num-batched-tokens", "512", "--no-http"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, _ = proc.communicate(timeout=120)
    assert "swallowed" in out and "nanopipe: stopping" in out, out[-2000:]
    assert "nanopipe ready" not in out  # stopped at the end of start-up, not serving
