"""What paces decoding: the device's step, or the host's chain from one step's tokens to the
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
