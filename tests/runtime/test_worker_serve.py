"""The worker's serving loop with lookahead: each step in flight is finished inside the next
step's launch, once that step is queued and before its bookkeeping, and the results leave in
order with the tokens of step-by-step execution (a real ModelRunner on the CPU, its plan and
result sockets stood in by lists). The host tier is pinned in idle time only."""

from __future__ import annotations

import time

import numpy as np
from rt_helpers import BLOCK_SIZE, make_runner

from gpu_workers import worker_proc
from protocol import CachedSequences, NewSequence, SamplingParams, Shutdown, StepPlan

PROMPTS = ([5, 6, 7, 8, 9], [11, 3, 40])
DECODE_STEPS = 6


def plans() -> list[StepPlan]:
    """Two greedy sequences: a prefill, then decode steps; the second one is dropped before
    the last step, which then decodes the first alone."""
    blocks = -(-(max(map(len, PROMPTS)) + DECODE_STEPS + 1) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0)
    seqs = [NewSequence(i, p, len(p), 0, len(p), list(range(i * blocks, (i + 1) * blocks)),
                        params) for i, p in enumerate(PROMPTS)]
    out = [StepPlan(0, [], seqs, CachedSequences([], [], []))]
    for k in range(1, DECODE_STEPS):
        out.append(StepPlan(k, [], [], CachedSequences([0, 1], [1, 1], [[], []])))
    out.append(StepPlan(DECODE_STEPS, [1], [], CachedSequences([0], [1], [[]])))
    return out


class Results:
    def __init__(self, events: list) -> None:
        self.sent, self.events = [], events

    def send(self, result) -> None:
        self.events.append(("result", result.step_id))
        self.sent.append(result)


class Plans:
    """The plan socket: every plan has arrived already; the Shutdown after them arrives once
    every result has left."""

    def __init__(self, messages: list, results: Results) -> None:
        self.messages, self.results, self.total = list(messages), results, len(messages)

    def poll(self, timeout: int = 0) -> bool:
        return bool(self.messages) or len(self.results.sent) == self.total

    def recv(self):
        return self.messages.pop(0) if self.messages else Shutdown("done")


class Running:
    stop_reason = None


class Recorded:
    """The runner, noting when each launch begins and ends and what the mirror holds when a
    result leaves."""

    def __init__(self, runner, events: list) -> None:
        self.runner, self.events = runner, events

    def launch(self, plan, meanwhile=None):
        self.events.append(("launch", plan.step_id))

        def noted() -> None:
            self.events.append(("queued", plan.step_id, len(self.runner._unsettled),
                                int(self.runner.table.num_tokens[self.runner.table.rows[0]])))
            meanwhile()

        pending = self.runner.launch(plan, noted)
        self.events.append(("launched", plan.step_id))
        return pending

    def finish(self, pending, deliver=None):
        return self.runner.finish(pending, deliver)


def test_a_step_in_flight_is_finished_inside_the_next_launch(tiny_qwen3_dir):
    events: list = []
    runner = make_runner(tiny_qwen3_dir)
    results = Results(events)
    worker_proc._serve(Recorded(runner, events), Plans(plans(), results), results, Running(),
                       lookahead=True)

    step_by_step = make_runner(tiny_qwen3_dir)
    want = [step_by_step.execute(plan) for plan in plans()]
    assert [r.step_id for r in results.sent] == [r.step_id for r in want]
    assert [r.token_ids for r in results.sent] == [r.token_ids for r in want]
    assert not runner._unsettled

    for k in range(1, DECODE_STEPS + 1):
        start, end = events.index(("launch", k)), events.index(("launched", k))
        queued = next(e for e in events[start:end] if e[0] == "queued")
        # Step k is queued with step k-1 still unsettled and its own placeholder not yet in
        # the mirror (sequence 0 holds the tokens up to step k-1's placeholder)...
        assert queued[2] == 1
        assert queued[3] == len(PROMPTS[0]) + k
        # ...and step k-1's result leaves before step k's launch returns.
        assert start < events.index(("result", k - 1)) < end


def test_meanwhile_runs_once_for_a_step_with_nothing_to_queue(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    calls: list[int] = []
    empty = StepPlan(0, [], [], CachedSequences([], [], []))
    pending = runner.launch(empty, lambda: calls.append(1))
    assert calls == [1] and np.asarray(runner.finish(pending).token_ids).size == 0


class SlicesToPin:
    """A host tier with `left` slices to pin, noting when each is pinned."""

    def __init__(self, left: int) -> None:
        self.left, self.pinned_at = left, []

    @property
    def pinning(self) -> bool:
        return self.left > 0

    def pin_idle(self) -> bool:
        self.pinned_at.append(time.monotonic())
        self.left -= 1
        return True


class Quiet:
    """A plan socket with nothing for `for_s` seconds, then a Shutdown."""

    def __init__(self, for_s: float) -> None:
        self.until, self.timeouts = time.monotonic() + for_s, []

    def poll(self, timeout: int = 0) -> bool:
        self.timeouts.append(timeout)
        if time.monotonic() >= self.until:
            return True
        time.sleep(timeout / 1000)
        return False

    def recv(self):
        return Shutdown("done")


def test_the_host_tier_is_not_pinned_between_steps_that_keep_coming(tiny_qwen3_dir):
    runner, results, tier = make_runner(tiny_qwen3_dir), Results([]), SlicesToPin(3)
    worker_proc._serve(runner, Plans(plans(), results), results, Running(), lookahead=True,
                       host_tier=tier)
    assert len(results.sent) == len(plans()) and tier.pinned_at == []


def test_the_host_tier_is_pinned_a_slice_at_a_time_once_the_worker_idles():
    began, tier, plans_in = time.monotonic(), SlicesToPin(3), Quiet(0.4)
    worker_proc._serve(None, plans_in, None, Running(), host_tier=tier)
    assert len(tier.pinned_at) == 3 and tier.pinned_at[0] >= began + worker_proc.IDLE_S
    # While slices are left it checks for a plan between them; then it blocks as before.
    short = plans_in.timeouts.count(worker_proc.PIN_POLL_MS)
    assert short >= 3 and plans_in.timeouts[short:] == \
        [worker_proc.POLL_MS] * (len(plans_in.timeouts) - short) and short < len(plans_in.timeouts)
