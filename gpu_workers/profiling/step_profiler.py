"""A profiling window inside each worker process: torch.profiler over a range of this rank's
plans, then `rank{R}.json` in a directory, so that every tensor-parallel rank reports what its
steps cost (`nanopipe profile tp` starts a pipeline with it and reads the files).

Off unless NANOPIPE_PROFILE_DIR is set (vLLM's VLLM_TORCH_PROFILER_DIR works the same way):
then the worker does not even import this module (gpu_workers.worker_proc.served_by) and
serving pays nothing. When it is set the worker serves through a StepProfiler, which counts
the plans it launches and, inside the window only, runs the profiler and puts ranges around
the runner's build_batch, forward, sample and settle. Those are wrapped on the runner (and
build_batch in the module the runner's class comes from) for the window and put back after
it: the runner's code knows nothing of it.

NANOPIPE_PROFILE_STEPS=FIRST,LAST: plans [FIRST, LAST), counted from this rank's first
executed plan (default 300,340). The window opens as plan FIRST is launched and closes as plan
LAST is launched, so with worker lookahead it holds LAST-FIRST launches and as many finishes.
NANOPIPE_PROFILE_TRACE=1 also writes the window's Chrome trace, `rank{R}.trace.json`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gpu_workers.profiling.rank_profile import (
    BUILD_BATCH_RANGE,
    FINISH_RANGE,
    FORWARD_RANGE,
    LAUNCH_RANGE,
    SAMPLE_RANGE,
    SETTLE_RANGE,
    WINDOW_END,
    rank_profile,
)
from gpu_workers.profiling.summary import SAMPLER_RANGE
from protocol.profile_settings import PROFILE_DIR_ENV as DIR_ENV

log = logging.getLogger("nanopipe.worker")
STEPS_ENV = "NANOPIPE_PROFILE_STEPS"
TRACE_ENV = "NANOPIPE_PROFILE_TRACE"
DEFAULT_STEPS = (300, 340)


@dataclass(frozen=True)
class ProfileWindow:
    out_dir: Path
    first: int
    last: int
    trace: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ProfileWindow | None:
        """The window the environment asks for, or None when DIR_ENV is unset or empty."""
        out = environ.get(DIR_ENV)
        if not out:
            return None
        first, last = DEFAULT_STEPS
        raw = environ.get(STEPS_ENV)
        if raw:
            try:
                first, last = (int(x) for x in raw.split(","))
            except ValueError:
                raise ValueError(f"{STEPS_ENV} must be FIRST,LAST (two integers), "
                                 f"got {raw!r}") from None
            if not 0 <= first < last:
                raise ValueError(f"{STEPS_ENV} needs 0 <= FIRST < LAST, got {raw!r}")
        return cls(Path(out), first, last, environ.get(TRACE_ENV, "") not in ("", "0"))


def profiled(runner: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """What the worker serves with: the runner itself unless DIR_ENV is set."""
    window = ProfileWindow.from_env(environ)
    return runner if window is None else StepProfiler(runner, window)


class StepProfiler:
    """The runner's launch and finish, with a profiling window over plans [first, last)."""

    def __init__(self, runner: Any, window: ProfileWindow) -> None:
        self.runner = runner
        self.window = window
        self.plans = 0
        self._open: _OpenWindow | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def launch(self, plan: Any, meanwhile: Any = None) -> Any:
        k = self.plans
        self.plans += 1
        if k == self.window.first:
            self._open = _OpenWindow(self.runner)
        elif k == self.window.last and self._open is not None:
            self._close()
        if self._open is None:
            return self.runner.launch(plan, meanwhile)
        with record_function(LAUNCH_RANGE):
            return self.runner.launch(plan, meanwhile)

    def finish(self, pending: Any, deliver: Any = None) -> Any:
        if self._open is None:
            return self.runner.finish(pending, deliver)
        with record_function(FINISH_RANGE):
            return self.runner.finish(pending, deliver)

    def _close(self) -> None:
        opened, self._open = self._open, None
        prof, wall_s = opened.close()
        w, r = self.window, self.runner
        try:
            report = dict(rank=r.rank, world_size=r.world_size, device=r.device.type,
                          **rank_profile(prof.events(), (w.first, w.last), wall_s,
                                         r.device.type == "cuda"))
        except Exception:  # a profile that cannot be read must not stop serving either
            log.exception("worker %d: could not summarise its profile", r.rank)
            return
        try:
            w.out_dir.mkdir(parents=True, exist_ok=True)
            path = w.out_dir / f"rank{r.rank}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(path)  # readers never see half a file
            if w.trace:
                prof.export_chrome_trace(str(w.out_dir / f"rank{r.rank}.trace.json"))
        except OSError as exc:  # a profile that cannot be written must not stop serving
            log.error("worker %d: could not write its profile to %s: %s", r.rank, w.out_dir, exc)
            return
        log.info("worker %d: profile of plans %d-%d written to %s", r.rank, w.first, w.last,
                 path)


class _OpenWindow:
    """The profiler running, and the runner's ranges in place until close()."""

    def __init__(self, runner: Any) -> None:
        self._cuda = runner.device.type == "cuda"
        self._undo: list[Callable[[], None]] = []
        ranges = [(runner, "_settle", SETTLE_RANGE), (runner, "_sample", SAMPLE_RANGE),
                  (runner, "sampler", SAMPLER_RANGE), (runner.model, "forward", FORWARD_RANGE),
                  (getattr(runner, "graphs", None), "run", FORWARD_RANGE),
                  (getattr(runner, "verify_graphs", None), "run", FORWARD_RANGE),
                  (sys.modules[type(runner).__module__], "build_batch", BUILD_BATCH_RANGE)]
        for owner, attr, name in ranges:
            self._wrap(owner, attr, name)
        # No sync here: the step in flight runs on while the window opens, as in serving.
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()
        self._t0 = time.perf_counter()

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        if owner is None or not hasattr(owner, attr):
            return
        original = getattr(owner, attr)
        own = attr in vars(owner)
        setattr(owner, attr, Ranged(name, original))
        self._undo.append(lambda: setattr(owner, attr, original) if own
                          else delattr(owner, attr))

    def close(self) -> tuple[profile, float]:
        with record_function(WINDOW_END):
            wall_s = time.perf_counter() - self._t0
        if self._cuda:
            torch.cuda.synchronize()  # the window's last kernels reach the trace
        self._prof.stop()
        for undo in reversed(self._undo):
            undo()
        return self._prof, wall_s


class Ranged:
    """A callable inside a profiler range; its other attributes are the original's (the
    sampler's generator, for one)."""

    def __init__(self, name: str, fn: Callable) -> None:
        self._name, self._fn = name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(self._name):
            return self._fn(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)
