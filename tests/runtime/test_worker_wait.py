"""How a worker with a step in flight waits for the next plan or the step's tokens: polling
without sleeping first (each sleep costs ~70 µs of timer slack on the chain that paces
small-batch decoding), sleeping only once a step runs long."""

from __future__ import annotations

import time

import pytest

from gpu_workers import worker_proc


class Steps:
    """A plan socket whose plan arrives at the n-th poll (never: None)."""

    def __init__(self, arrives_at: int | None) -> None:
        self.arrives_at, self.polls = arrives_at, 0

    def poll(self, timeout: int) -> bool:
        self.polls += 1
        return self.arrives_at is not None and self.polls >= self.arrives_at


class InFlight:
    """A step whose tokens reach the host after `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.ready_at = time.perf_counter() + seconds

    def done(self) -> bool:
        return time.perf_counter() >= self.ready_at


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(worker_proc.time, "sleep", sleep)
    return slept


def test_tokens_of_a_short_step_are_seen_without_sleeping(sleeps):
    assert worker_proc._plan_before_tokens(Steps(None), InFlight(0.001)) is False
    assert sleeps == []


def test_a_plan_arriving_first_is_taken_without_sleeping(sleeps):
    assert worker_proc._plan_before_tokens(Steps(50), InFlight(10.0)) is True
    assert sleeps == []


def test_a_long_step_is_waited_for_with_sleeps(sleeps, monkeypatch):
    monkeypatch.setattr(worker_proc, "SPIN_S", 0.002)
    assert worker_proc._plan_before_tokens(Steps(None), InFlight(0.05)) is False
    assert sleeps and set(sleeps) == {worker_proc.LOOKAHEAD_POLL_S}
