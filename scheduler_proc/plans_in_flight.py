"""How many plans are in flight (sent to the workers, result not yet back): one rule, owned
here by PlanDepth, and the meter behind its last branch.

The rule. The depth is at most protocol.limits.plans_in_flight (the workers size their
buffers by it): 1 without overlap, 1 + plans_ahead with it.
- Without overlap (--no-overlap): 1. The scheduler plans step N+1 after result N.
- With overlap: 2 (plans_ahead 1). Step N+1 is planned while N runs, assuming every decoding
  sequence survives N, so the scheduler's planning is off the path from one step to the next.
- A third (plans_ahead 2): step N+2 is planned before result N. With the depth left to auto
  (EngineConfig: on a GPU, with overlap and worker lookahead, without speculation) the third
  plan is made only where it pays: while at most `deep_plan_max_seqs` (protocol.limits.
  DEEP_PLAN_MAX_SEQS) sequences run, none waits and every running one has all its prompt
  planned (deep_plan_pays: a step that admits or prefills would only queue behind one more
  decode step), and while the PacingMeter says the host's chain is measured slower than the
  device's step. Given explicitly (--plans-ahead 2), the third plan is made whenever the
  planner has something to plan.
Nothing else decides the depth: the step loop counts its plans in flight and asks
`PlanDepth.may_plan` before each plan.

Why a depth above 1 pays: worker lookahead. A worker with a step in flight takes the next
plan if it arrives before that step's tokens reach the host, and queues it on the device
behind the running step (it already holds the input tokens on the device); then the step
in flight's result goes out. Without lookahead (--no-worker-lookahead) a worker finishes
each step before it reads the next plan, so the device waits for the round trip every step,
and plans_ahead 2 is refused. How the waits are made: the worker with a step in flight polls
for the next plan or the step's tokens without sleeping for `SPIN_S` (gpu_workers.
worker_proc), then sleeps between polls; the step loop polls for results without sleeping
for `result_spin_s` (protocol.limits.GPU_RESULT_SPIN_S on a GPU) while plans are in flight
(`PlanDepth.spin_s`). With nothing in flight both block in their sockets' poll: an idle
engine does not spin.

What paces decoding: the device's step, or the host's chain from one step's tokens to the
launch of the next (the result's hop, this loop, the plan's hop, the worker's launch).
One plan ahead, a decode step can start only once that chain has run for the step before it;
when the chain is longer than the device's step, the GPU waits on the host every step, and
planning a second step ahead hides the chain. When the device is the slower side, a second
plan gains nothing and costs a new prompt one more step in the queue. The meter tells the two
apart from what the scheduler already sees: the time between consecutive results of decode
steps planned one ahead (the chain, or the device's step if that is longer) against the
device's busy time that the workers report per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from protocol import StepPlan, StepResult
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.state import SchedulerState
from scheduler_proc.stats import SchedulerStats

WINDOW = 16
"""Steps each mean is taken over."""
MARGIN = 1.15
"""The chain must exceed the device's step by this factor: a second plan ahead is only worth
its cost where it hides a clear gap."""


class PacingMeter:
    """Means over the last WINDOW decode steps of the device's busy time and of the period
    between results one plan ahead; `host_paced` compares them."""

    def __init__(self, window: int = WINDOW, margin: float = MARGIN) -> None:
        self.margin = margin
        self._depth: dict[int, int] = {}  # decode step id -> plans in flight when planned
        self._busy: deque[float] = deque(maxlen=window)
        self._periods: deque[float] = deque(maxlen=window)
        self._last_step: int | None = None
        self._last_s = 0.0

    def planned(self, step_id: int, depth: int, decode_only: bool) -> None:
        """Note a plan: how many were in flight when it was made, and whether it only
        decodes (prefill steps say nothing about the decode chain)."""
        if decode_only:
            self._depth[step_id] = depth

    def result(self, step_id: int, busy_s: float, now_s: float) -> None:
        """A step's result arrived at `now_s` (any clock with seconds)."""
        depth = self._depth.pop(step_id, None)
        consecutive = self._last_step == step_id - 1
        last_s = self._last_s
        self._last_step, self._last_s = step_id, now_s
        if depth is None:
            return
        # One plan was in flight when this one was made, and the meter kept the scheduler
        # to one ahead: the step was launched as soon as the chain allowed, so the time since
        # the previous result is that chain (or the device's step, if that was longer). Two
        # ahead, a plan made after two results came in together is also one ahead, but its
        # period is not the chain's.
        if depth == 1 and consecutive and not self.host_paced():
            self._periods.append(now_s - last_s)
        self._busy.append(busy_s)

    @property
    def chain_s(self) -> float | None:
        """Mean period between results one plan ahead, once a window of them is in."""
        periods = self._periods
        return sum(periods) / len(periods) if len(periods) == periods.maxlen else None

    @property
    def device_step_s(self) -> float | None:
        busy = self._busy
        return sum(busy) / len(busy) if busy else None

    def host_paced(self) -> bool:
        """Whether the chain exceeds the device's step by the margin. Until a window of
        periods one ahead is in, no; while planning two ahead no new period comes in, and the
        last window stands until the device's step grows past it."""
        chain, device = self.chain_s, self.device_step_s
        return chain is not None and device is not None and chain > self.margin * device


def deep_plan_pays(state: SchedulerState, max_seqs: int) -> bool:
    """Whether the deepest plan pays for this batch: at most `max_seqs` sequences run, all
    with their whole prompt planned, and none waits."""
    running = state.running
    if state.waiting or len(running) > max_seqs:
        return False
    return all(seq.num_computed >= seq.num_prefill for seq in running)


@dataclass(slots=True)
class PlanDepth:
    """The rule above for one scheduler: asked before each plan, told of each plan and
    result (the meter's samples)."""

    limit: int
    """Most plans in flight (protocol.limits.plans_in_flight)."""
    deep_max_seqs: int | None = None
    """The deepest slot is made only where deep_plan_pays with this limit and the meter says
    host-paced; None: whenever there is room."""
    meter: PacingMeter | None = None
    """With a limit: whether the host's chain paces decoding (None: the batch alone decides)."""
    result_spin_s: float = 0.0

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> PlanDepth:
        deep = config.deep_plan_max_seqs if config.plans_ahead > 1 else None
        return cls(config.max_plans_in_flight, deep, None if deep is None else PacingMeter(),
                   config.result_spin_s)

    def may_plan(self, in_flight: int, state: SchedulerState) -> bool:
        """Whether another step may be planned with `in_flight` plans out."""
        if in_flight >= self.limit:
            return False
        if in_flight < self.limit - 1 or self.deep_max_seqs is None:
            return True
        meter = self.meter
        return (deep_plan_pays(state, self.deep_max_seqs)
                and (meter is None or meter.host_paced()))

    def planned(self, plan: StepPlan, in_flight: int, stats: SchedulerStats) -> None:
        """`plan` was made with `in_flight` others out."""
        if in_flight >= 2:
            stats.steps_two_ahead += 1
        if self.meter is not None:
            decode_only = not plan.new_seqs and max(plan.cached.num_new, default=0) == 1
            self.meter.planned(plan.step_id, in_flight, decode_only)

    def result(self, result: StepResult, now_s: float) -> None:
        if self.meter is not None:
            self.meter.result(result.step_id, result.gpu_busy_s, now_s)

    def spin_s(self, in_flight: int) -> float:
        """How long the step loop polls without sleeping before it blocks: only while a
        result is due."""
        return self.result_spin_s if in_flight else 0.0
