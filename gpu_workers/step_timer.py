"""The device time of one step's forward and sample, measured without a host sync.

On CUDA two timing events bracket the step's work on the stream; their difference is read
only once the end event has completed (ModelRunner reads it when a later finish() finds it
done), so timing never makes the host wait. The span counts from the step's first kernel to
its last, gaps between launches included: with CUDA graphs for decode those are small. On the
CPU the forward is synchronous and its wall time is the figure.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._end: torch.cuda.Event | None = None
        self._elapsed_s: float | None = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._elapsed_s = time.perf_counter() - self._t0

    def ready(self) -> bool:
        """Whether the step's work has finished on the device (never blocks)."""
        return self._elapsed_s is not None or (self._end is not None and self._end.query())

    def seconds(self) -> float:
        """The step's device time; only once ready()."""
        if self._elapsed_s is None:
            self._elapsed_s = self._start.elapsed_time(self._end) / 1e3
        return self._elapsed_s


class BusyTimes:
    """The timers of launched steps not reported yet, oldest first (ModelRunner times rank
    0's steps of its serving table; StepResult.gpu_busy_s reports them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._timers: list[StepTimer] = []

    def start(self) -> StepTimer:
        return StepTimer(self.device)

    def stop(self, timer: StepTimer | None) -> None:
        if timer is not None:
            timer.stop()
            self._timers.append(timer)

    def take(self) -> float:
        """The device seconds of every stopped step that has finished on the device and was
        not taken yet: a step whose end nobody waited for is counted by a later take()."""
        ready = [t.ready() for t in self._timers]
        busy = sum(t.seconds() for t, r in zip(self._timers, ready, strict=True) if r)
        self._timers = [t for t, r in zip(self._timers, ready, strict=True) if not r]
        return busy
