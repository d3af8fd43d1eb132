"""The profiling settings, read from the environment: the one place the runtime looks at them.

Profiling is off unless one of these names a directory, and the profiling code (the host
timeline in protocol.profiling, the workers' window in gpu_workers.profiling) is imported only
then: this module holds no profiling code, so a serving process never loads any. The settings
are the user's (docs/bench-tool.md); `nanopipe profile` sets them for the pipelines it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

HOST_TIMELINE_ENV = "NANOPIPE_HOST_TIMELINE"
"""A directory for the host timeline's files (protocol.profiling.host_timeline)."""
PROFILE_DIR_ENV = "NANOPIPE_PROFILE_DIR"
"""A directory for the workers' profiling window (gpu_workers.profiling.step_profiler)."""


class Timeline(Protocol):
    """What an actor stamps each step's host events into."""

    def mark(self, step_id: int, event: str) -> None: ...

    def write(self) -> None: ...


class NoTimeline:
    """The timeline of an actor nobody asked to record: stamps nothing, writes nothing."""

    __slots__ = ()

    def mark(self, step_id: int, event: str) -> None:
        pass

    def write(self) -> None:
        pass


NO_TIMELINE = NoTimeline()


def host_timeline(actor: str, rank: int = 0,
                  environ: Mapping[str, str] = os.environ) -> Timeline:
    """This actor's timeline: recording into `{actor}{rank}.json` when HOST_TIMELINE_ENV names
    a directory, else NO_TIMELINE (and nothing of protocol.profiling is imported)."""
    out = environ.get(HOST_TIMELINE_ENV)
    if not out:
        return NO_TIMELINE
    from protocol.profiling.host_timeline import HostTimeline

    return HostTimeline(Path(out) / f"{actor}{rank}.json")


def profile_dir(environ: Mapping[str, str] = os.environ) -> str | None:
    """The workers' profiling window's directory, or None: no window, nothing imported."""
    return environ.get(PROFILE_DIR_ENV) or None
