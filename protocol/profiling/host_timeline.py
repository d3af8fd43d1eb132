"""A timeline of each step's host events in the actors that pass it along, written when asked.

torch.profiler shows where a step's device time goes but multiplies the host's (it records
every op), so on a step of under a millisecond it cannot say which link of the chain (plan out
of the scheduler, into a worker, launched, tokens back, result into the scheduler, the next
plan out) keeps the device waiting. Here each actor keeps a few clock stamps per step, a list
append each, and writes them when it stops; `time.perf_counter_ns` reads CLOCK_MONOTONIC,
one clock for every process of a host, so `nanopipe profile timeline` can line the files up.

Off unless NANOPIPE_HOST_TIMELINE names a directory (protocol.profile_settings.host_timeline
reads it and only then imports this module): then the scheduler writes `scheduler0.json` and
each worker `worker{rank}.json` there as it stops (one pipeline per directory: a later one's
files replace an earlier one's). Otherwise the actors get NO_TIMELINE, whose mark does nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("nanopipe")
MAX_EVENTS = 2_000_000
"""Stamps kept per process (the first ones): ~100 MB at most, hours of steps."""


class HostTimeline:
    """(step id, event, ns) stamps of one actor process, in the order they happened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[tuple[int, str, int]] = []

    def mark(self, step_id: int, event: str) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append((step_id, event, time.perf_counter_ns()))

    def write(self) -> None:
        """Write the stamps (a failure to write is logged, never raised: the actor is
        stopping, and what it was serving matters more)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(
                {"actor": self.path.stem, "clock": "perf_counter_ns", "events": self.events}))
        except OSError as exc:
            log.warning("host timeline: could not write %s: %s", self.path, exc)

