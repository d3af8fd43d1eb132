"""The device time of one step's forward and sample, measured without a host sync.

On CUDA two timing events bracket the step's work on the stream; their difference is read
only once the end event has completed (ModelRunner reads it when a later finish() finds it
done), so timing never makes the host wait. The span counts from the step's first kernel to
its last, gaps between launches included: with CUDA graphs for decode those are small. On the
CPU the forward is synchronous and its wall time is the figure.

The timer sits on every step's launch, the host work that paces small-batch decoding, so it
is kept cheap: event pairs are reused once read, and they are recorded on the stream given
at construction (torch.cuda.current_stream() costs more host time than the record itself).
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, stream: torch.cuda.Stream | None,
                 events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> None:
        """stream None: the CPU, timed by the wall clock. events: a pair to reuse."""
        self._stream = stream
        self._elapsed_s: float | None = None
        self._stopped = False
        if stream is None:
            self._t0 = time.perf_counter()
            return
        self.events = events or (torch.cuda.Event(enable_timing=True),
                                 torch.cuda.Event(enable_timing=True))
        self.events[0].record(stream)

    def stop(self) -> None:
        if self._stream is None:
            self._elapsed_s = time.perf_counter() - self._t0
        else:
            self.events[1].record(self._stream)
        self._stopped = True

    def ready(self) -> bool:
        """Whether the step's work has finished on the device (never blocks)."""
        return self._elapsed_s is not None or (self._stopped and self.events[1].query())

    def seconds(self) -> float:
        """The step's device time; only once ready()."""
        if self._elapsed_s is None:
            self._elapsed_s = self.events[0].elapsed_time(self.events[1]) / 1e3
        return self._elapsed_s


class BusyTimes:
    """The timers of launched steps not reported yet, oldest first (ModelRunner times rank
    0's steps of its serving table; StepResult.gpu_busy_s reports them)."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        """stream: where the steps run (None: on the CPU)."""
        self.stream = stream
        self._timers: list[StepTimer] = []
        self._spare: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """Event pairs of timers already read, to record again."""

    def start(self) -> StepTimer:
        return StepTimer(self.stream, self._spare.pop() if self._spare else None)

    def stop(self, timer: StepTimer | None) -> None:
        if timer is not None:
            timer.stop()
            self._timers.append(timer)

    def take(self) -> float:
        """The device seconds of every stopped step that has finished on the device and was
        not taken yet: a step whose end nobody waited for is counted by a later take()."""
        busy, waiting = 0.0, []
        for timer in self._timers:
            if not timer.ready():
                waiting.append(timer)
                continue
            busy += timer.seconds()
            if self.stream is not None:
                self._spare.append(timer.events)
        self._timers = waiting
        return busy
