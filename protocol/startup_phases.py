"""How long each phase of a process's start-up took, measured by the process itself and
carried in its Ready (the launcher prints them: frontend.engine.startup_times).

A phase is named by what it does (`weights`, `kv`, `warm-up`, `graphs`, `tokenizer`); what a
process does outside its named phases (starting the interpreter, imports, sockets) is
counted by the launcher, which knows when it started the process and when its Ready came.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from protocol.wire_registry import struct


@struct
@dataclass(frozen=True, slots=True)
class StartupPhase:
    """One phase of one process's start-up."""

    name: str
    seconds: float


class PhaseClock:
    """Times consecutive phases: `mark(name)` ends the phase `name` that began at the
    previous mark (or at the clock's creation).

    `part(name)` times a part of the phase now running (`kv.profile`: its name is the
    phase's, a dot and the part's), from the previous part or mark, into `parts`: the
    launcher shows them after the ready line, so a slow phase says where its time went."""

    def __init__(self) -> None:
        self.phases: list[StartupPhase] = []
        self.parts: list[StartupPhase] = []
        self._since = self._part_since = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases.append(StartupPhase(name, now - self._since))
        self._since = self._part_since = now

    def part(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.append(StartupPhase(name, now - self._part_since))
        self._part_since = now

