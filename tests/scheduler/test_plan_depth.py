"""The plan-depth rule (scheduler_proc.plans_in_flight.PlanDepth), branch by branch, and its
static half (protocol.limits.resolve_plan_depth): how many plans may be in flight, and when
the deepest one is made."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, make_request

from protocol.limits import (
    DEEP_PLAN_MAX_SEQS,
    GPU_RESULT_SPIN_S,
    PlanDepthSettings,
    plans_ahead_conflict,
    plans_in_flight,
    resolve_plan_depth,
)
from scheduler_proc import Scheduler, SchedulerConfig
from scheduler_proc.plans_in_flight import PacingMeter, PlanDepth
from scheduler_proc.stats import SchedulerStats


def scheduler(**kw) -> Scheduler:
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(SchedulerConfig(64, 4, **{**cfg, **kw}))


def paced_meter(busy_s: float, period_s: float = 1e-3, steps: int = 20) -> PacingMeter:
    """A meter that saw `steps` decode steps planned one ahead, a result every `period_s`,
    each step busy on the device for `busy_s`."""
    meter = PacingMeter(window=8)
    for step in range(steps):
        meter.planned(step, 1, True)
        meter.result(step, busy_s, (step + 1) * period_s)
    return meter


def running(sched: Scheduler, n: int, prompt: int = 6) -> None:
    """Admit `n` requests and plan their prompts (a plan each step, none answered)."""
    for rid in range(n):
        sched.add_request(make_request(rid, prompt, max_tokens=8))
    while sched.waiting or any(s.num_computed < s.num_prefill for s in sched.running):
        assert sched.schedule() is not None
    assert len(sched.running) == n


def test_one_plan_in_flight_without_overlap():
    sched = scheduler(overlap=False, plans_ahead=1, deep_plan_max_seqs=DEEP_PLAN_MAX_SEQS)
    sched.add_request(make_request(1, 6))
    assert sched.depth.limit == 1 and sched.pacing is None
    assert sched.may_plan(0) and not sched.may_plan(1)


def test_two_with_overlap_whatever_the_batch():
    """One plan ahead (auto on a CPU gets the limit too): the second slot is always open and
    no meter runs."""
    sched = scheduler(plans_ahead=1, deep_plan_max_seqs=DEEP_PLAN_MAX_SEQS)
    running(sched, 3)
    sched.add_request(make_request(9, 6))
    assert sched.depth == PlanDepth(2, None, None, 0.0)
    assert sched.may_plan(0) and sched.may_plan(1) and not sched.may_plan(2)


def test_two_ahead_given_explicitly_plans_the_third_whenever_there_is_room():
    sched = scheduler(plans_ahead=2)
    running(sched, 5, prompt=20)
    sched.add_request(make_request(9, 6))  # waiting, a large batch: still no gate
    assert sched.depth.limit == 3 and sched.pacing is None
    assert sched.may_plan(2) and not sched.may_plan(3)


@pytest.mark.parametrize("case,pays", [
    ("small decode batch, host paced", True),
    ("a request waits", False),
    ("more running than the limit", False),
    ("a prompt not all planned", False),
    ("the device paces", False),
    ("no window measured yet", False),
    ("no meter: the batch alone", True),
])
def test_the_third_plan_only_where_it_pays(case, pays):
    """plans_ahead 2 with a limit (the auto default on a GPU): the deepest slot opens only for
    at most `deep_plan_max_seqs` running sequences, all past their prompt, none waiting,
    while the host's chain is measured slower than the device's step. The shallower slots
    never depend on any of it."""
    sched = scheduler(plans_ahead=2, deep_plan_max_seqs=2,
                      max_num_batched_tokens=8 if "prompt" in case else 64)
    assert isinstance(sched.pacing, PacingMeter)  # a fresh meter has measured nothing
    sched.pacing = paced_meter(busy_s=0.5e-3)
    if case == "more running than the limit":
        running(sched, 3)
    elif case == "a prompt not all planned":
        running(sched, 1)
        sched.add_request(make_request(5, 20))
        assert sched.schedule() is not None  # admits it with part of its prompt
        assert not sched.waiting and len(sched.running) == 2
    else:
        running(sched, 2)
    if case == "a request waits":
        sched.add_request(make_request(9, 6))
    elif case == "the device paces":
        sched.pacing = paced_meter(busy_s=0.95e-3)
    elif case == "no window measured yet":
        sched.pacing = paced_meter(busy_s=0.5e-3, steps=4)
    elif case == "no meter: the batch alone":
        sched.pacing = None
    assert sched.may_plan(0) and sched.may_plan(1)
    assert sched.may_plan(2) is pays
    assert not sched.may_plan(3)


class RecordingMeter(PacingMeter):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, object, object]] = []

    def planned(self, step_id: int, depth: int, decode_only: bool) -> None:
        self.calls.append(("planned", step_id, depth, decode_only))
        super().planned(step_id, depth, decode_only)

    def result(self, step_id: int, busy_s: float, now_s: float) -> None:
        self.calls.append(("result", step_id, busy_s, now_s))
        super().result(step_id, busy_s, now_s)


def test_plans_and_results_reach_the_meter_and_the_two_ahead_count():
    """Each plan tells the meter how many were in flight and whether it only decodes; a
    plan made with two others out is counted as two ahead (what operators see)."""
    sched = scheduler(plans_ahead=2, deep_plan_max_seqs=2)
    meter = sched.pacing = RecordingMeter()
    sched.add_request(make_request(1, 6, max_tokens=8))
    prefill, decode1, decode2 = sched.schedule(), sched.schedule(), sched.schedule()
    assert [c[1:] for c in meter.calls] == [(0, 0, False), (1, 1, True), (2, 2, True)]
    assert sched.stats().steps_two_ahead == 1
    assert prefill.new_seqs and not decode1.new_seqs and decode2.step_id == 2
    worker = FakeWorker(64, 4)
    worker.busy_s = 0.25
    sched.process_result(worker.execute(prefill))
    assert meter.calls[-1][:3] == ("result", 0, 0.25)
    depth = PlanDepth(3)  # no meter: only the count
    stats = SchedulerStats()
    for in_flight in (0, 1, 2, 2):
        depth.planned(decode1, in_flight, stats)
    assert stats.steps_two_ahead == 2


def test_the_loop_spins_only_while_a_result_is_due():
    depth = PlanDepth.from_config(SchedulerConfig(64, 4, max_model_len=64, result_spin_s=5e-3))
    assert depth.spin_s(0) == 0.0
    assert depth.spin_s(1) == depth.spin_s(2) == 5e-3


GPU, CPU = GPU_RESULT_SPIN_S, 0.0


@pytest.mark.parametrize("given,overlap,lookahead,spec,gpu,want", [
    (None, True, True, False, True, PlanDepthSettings(True, 2, DEEP_PLAN_MAX_SEQS, True, GPU)),
    (None, True, True, False, False, PlanDepthSettings(True, 1, DEEP_PLAN_MAX_SEQS, True, CPU)),
    (None, True, False, False, True, PlanDepthSettings(True, 1, DEEP_PLAN_MAX_SEQS, False, GPU)),
    (None, False, True, False, True, PlanDepthSettings(False, 1, DEEP_PLAN_MAX_SEQS, False, GPU)),
    (None, True, True, True, True, PlanDepthSettings(True, 1, DEEP_PLAN_MAX_SEQS, True, GPU)),
    (2, True, True, False, False, PlanDepthSettings(True, 2, None, True, CPU)),
    (1, True, True, False, True, PlanDepthSettings(True, 1, None, True, GPU)),
    (1, False, True, False, True, PlanDepthSettings(False, 1, None, False, GPU)),
])
def test_the_options_resolve_in_one_place(given, overlap, lookahead, spec, gpu, want):
    """Auto plans two ahead on a GPU with overlap and lookahead and no speculation, gated;
    a number given is taken as it is, ungated; lookahead needs overlap; the step loop spins
    for results on a GPU only."""
    got = resolve_plan_depth(given, overlap=overlap, lookahead=lookahead, speculative=spec,
                             gpu=gpu)
    assert got == want
    assert got.plans_in_flight == plans_in_flight(overlap, got.plans_ahead)
    assert got.plans_in_flight == (1 + got.plans_ahead if overlap else 1)


@pytest.mark.parametrize("given,kw,why", [
    (2, dict(overlap=False), "needs overlap and worker lookahead"),
    (2, dict(lookahead=False), "needs overlap and worker lookahead"),
    (2, dict(speculative=True), "does not go with speculative decoding"),
    (1, dict(speculative=True, overlap=False, lookahead=False), None),
    (None, dict(speculative=True, overlap=False), None),
])
def test_two_ahead_is_refused_where_it_cannot_work(given, kw, why):
    got = plans_ahead_conflict(given, **{"speculative": False, **kw})
    assert (got is None) if why is None else (why in got)
    if given == 2 and kw.get("speculative"):
        with pytest.raises(ValueError, match="SchedulerConfig.plans_ahead > 1 does not go"):
            SchedulerConfig(64, 4, max_model_len=64, plans_ahead=2, num_speculative_tokens=2)
    if given == 2 and kw.get("overlap") is False:  # a scheduler built by hand is refused too
        with pytest.raises(ValueError, match="SchedulerConfig.plans_ahead > 1 needs overlap"):
            SchedulerConfig(64, 4, max_model_len=64, plans_ahead=2, overlap=False,
                            deep_plan_max_seqs=8)
