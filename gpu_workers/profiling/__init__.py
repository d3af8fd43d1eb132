"""Profiling the workers' steps: off the serving path, loaded only when asked for.

A worker serves through `profiled(runner)`; unless NANOPIPE_PROFILE_DIR is set that is the
runner itself and nothing of torch.profiler or the summaries is imported
(gpu_workers.profiling.step_profiler describes the window the variable opens).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

DIR_ENV = "NANOPIPE_PROFILE_DIR"


def profiled(runner: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """What the worker serves with: the runner itself unless DIR_ENV is set."""
    if not environ.get(DIR_ENV):
        return runner
    from gpu_workers.profiling.step_profiler import profiled as with_window

    return with_window(runner, environ)
