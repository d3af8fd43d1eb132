"""Where start-up's time went: the launcher's records of its children's READYs, the phases
they report, and the line that sums them up."""

from __future__ import annotations

import time

import pytest

from frontend.engine.children import Child
from frontend.engine.startup import await_ready
from frontend.engine.startup_times import parse_ready_line, startup_times
from protocol import Ready
from protocol.startup_phases import PhaseClock, StartupPhase


class _Running:
    def poll(self) -> None:
        return None


class _Control:
    """A control link that hands over the given messages, then stays quiet."""

    def __init__(self, *messages: object) -> None:
        self.messages = list(messages)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.messages)

    def recv(self) -> object:
        return self.messages.pop(0)


def _child(role: str, started_at: float, ready_at: float | None = None,
           phases: list[StartupPhase] | None = None) -> Child:
    child = Child(role, 0, f"{role}.module", _Running(), started_at=started_at)
    if ready_at is not None:
        child.ready = Ready(role, 0, 0, "", phases=phases or [])
        child.ready_at = ready_at
    return child


def test_a_ready_that_comes_early_is_kept_until_it_is_expected():
    worker, tokenizer = _child("worker", 0.0), _child("tokenizer", 0.0)
    early = Ready("tokenizer", 0, 0, "", phases=[StartupPhase("tokenizer", 0.5)])
    control = _Control(early, Ready("worker", 0, 64, ""))
    got = await_ready(control, [worker, tokenizer], {("worker", 0)}, time.monotonic() + 5,
                      print)
    assert [r.role for r in got] == ["worker"]  # the tokenizer's is not a worker's READY
    assert tokenizer.ready is early and tokenizer.ready_at is not None
    # Nothing more arrives: the kept READY answers at once.
    again = await_ready(control, [worker, tokenizer], {("tokenizer", 0)},
                        time.monotonic() + 5, print)
    assert again == [early]


def test_the_phases_follow_the_slowest_worker_and_add_up():
    workers = [_child("worker", 10.0, 14.0, [StartupPhase("weights", 2.0),
                                             StartupPhase("kv", 0.5)]),
               _child("worker", 10.1, 15.0, [StartupPhase("weights", 3.0),
                                             StartupPhase("kv", 0.25)])]
    tokenizer = _child("tokenizer", 10.2, 13.0, [StartupPhase("tokenizer", 1.5)])
    times = startup_times(9.0, [*workers, tokenizer], end=16.0)
    assert dict((p.name, p.seconds) for p in times.phases) == pytest.approx({
        "checks": 1.0, "processes": 5.0 - 3.25, "weights": 3.0, "kv": 0.25, "warm-up": 0.0,
        "graphs": 0.0, "frontend": 1.0})
    assert sum(p.seconds for p in times.phases) == pytest.approx(times.total_s) == 7.0
    assert times.line() == ("ready in 7.0 s (checks 1.0, processes 1.8, weights 3.0, kv 0.2, "
                            "warm-up 0.0, graphs 0.0, frontend 1.0)")
    assert [p.phase("tokenizer") for p in times.processes] == [0.0, 0.0, 1.5]


def test_a_phase_clock_times_consecutive_phases():
    clock = PhaseClock()
    time.sleep(0.02)
    clock.mark("weights")
    clock.mark("kv")
    names = [p.name for p in clock.phases]
    assert names == ["weights", "kv"]
    assert clock.phases[0].seconds >= 0.02 > clock.phases[1].seconds



def test_a_phase_clock_times_parts_inside_the_phase_running():
    clock = PhaseClock()
    clock.mark("weights")
    time.sleep(0.02)
    clock.part("kv.profile")
    clock.part("kv.pool")
    clock.mark("kv")
    assert [p.name for p in clock.phases] == ["weights", "kv"]
    assert [p.name for p in clock.parts] == ["kv.profile", "kv.pool"]
    assert clock.parts[0].seconds >= 0.02 > clock.parts[1].seconds
    assert clock.phases[1].seconds >= clock.parts[0].seconds + clock.parts[1].seconds


def test_the_slowest_workers_parts_follow_the_line_and_are_not_counted_twice():
    fast = _child("worker", 10.0, 13.0, [StartupPhase("kv", 1.0), StartupPhase("kv.host", 0.9)])
    slow = _child("worker", 10.0, 15.0, [StartupPhase("weights", 1.0), StartupPhase("kv", 2.0),
                                         StartupPhase("kv.profile", 1.5),
                                         StartupPhase("kv.pool", 0.125),
                                         StartupPhase("kv.host", 0.25)])
    times = startup_times(9.0, [fast, slow], end=15.5)
    # The parts are inside kv: "processes" is the time outside weights and kv alone.
    assert times.phase("processes") == pytest.approx(5.0 - 3.0)
    assert sum(p.seconds for p in times.phases) == pytest.approx(times.total_s)
    assert times.line() == ("ready in 6.5 s (checks 1.0, processes 2.0, weights 1.0, kv 2.0, "
                            "warm-up 0.0, graphs 0.0, frontend 0.5) "
                            "[kv: profile 1.50, pool 0.12, host 0.25]")
    # Tools that read the line from outside still find its phases.
    parsed = parse_ready_line("nanopipe: " + times.line() + "\n")
    assert parsed is not None and parsed.phase("kv") == 2.0 and parsed.total_s == 6.5
    # ... and its parts, which `nanopipe bench startup` prints again.
    assert [(p.name, p.seconds) for p in parsed.parts] == [
        ("kv.profile", 1.5), ("kv.pool", 0.12), ("kv.host", 0.25)]
    assert parsed.line() == times.line()
    two = times.line() + " [processes: imports 2.10, setup 0.30]"
    assert [p.name for p in parse_ready_line(two).parts][-2:] == ["processes.imports",
                                                                  "processes.setup"]


def test_a_worker_knows_how_long_its_process_took_to_reach_it():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import time; time.sleep(0.3); from gpu_workers.worker_proc import "
            "since_process_start; print(since_process_start())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert 0.3 <= float(out.stdout) < 60  # the sleep, the interpreter and torch's import
