"""Where a pipeline's start-up time went, phase by phase, for the ready line.

The launcher notes when it started each process and when its Ready came; each process
reports how long its own named phases took (protocol.startup_phases). The line follows the
path that decides when the pipeline is ready: the checks made before anything starts, then
the slowest worker (its process start and imports, then its weights, KV sizing, kernel
warm-up and CUDA graph capture), then whatever the pipeline still waited for once the
workers were ready (the scheduler, which is sized from them, and the tokenizer and
detokenizer, which load their tokenizers while the workers start).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from frontend.engine.children import Child
from protocol.startup_phases import StartupPhase

WORKER_PHASES = ("weights", "kv", "warm-up", "graphs")
"""A worker's named phases, in the order it goes through them (ModelRunner)."""


@dataclass(frozen=True, slots=True)
class ProcessStartup:
    """One process's start-up as the launcher saw it."""

    name: str
    role: str
    ready_s: float
    """From the launcher's first spawn to this process's Ready."""
    phases: tuple[StartupPhase, ...]

    def phase(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    @property
    def parts(self) -> tuple[StartupPhase, ...]:
        """The parts of its phases it timed (`kv.profile`), in its order."""
        return tuple(p for p in self.phases if is_part(p.name))

    @property
    def unnamed_s(self) -> float:
        """Time outside its named phases: starting the interpreter, imports, sockets."""
        return max(0.0, self.ready_s - sum(p.seconds for p in self.phases
                                           if not is_part(p.name)))


def is_part(name: str) -> bool:
    """A part of a phase (`kv.profile`) is named after it; its seconds are the phase's."""
    return "." in name


@dataclass(frozen=True, slots=True)
class StartupTimes:
    """The pipeline's start-up: its total, the phases of its critical path, each process."""

    total_s: float
    phases: tuple[StartupPhase, ...]
    """checks, processes, weights, kv, warm-up, graphs, frontend: they add up to total_s."""
    processes: tuple[ProcessStartup, ...]
    parts: tuple[StartupPhase, ...] = ()
    """The slowest worker's parts of its phases (`kv.profile`), where it timed them."""

    def phase(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def line(self) -> str:
        """`ready in 3.2 s (checks 0.4, processes 0.9, weights 0.6, ...)`, then the parts of
        any phase the slowest worker timed: ` [kv: profile 4.1, pool 0.1, host 3.0]`."""
        text = ", ".join(f"{p.name} {p.seconds:.1f}" for p in self.phases)
        line = f"ready in {self.total_s:.1f} s ({text})"
        by_phase: dict[str, list[str]] = {}
        for p in self.parts:
            phase, _, part = p.name.partition(".")
            by_phase.setdefault(phase, []).append(f"{part} {p.seconds:.2f}")
        for phase, parts in by_phase.items():
            line += f" [{phase}: {', '.join(parts)}]"
        return line


def startup_times(began: float, children: list[Child], end: float) -> StartupTimes:
    """The times of a pipeline whose start() began at `began` and was ready at `end`
    (time.monotonic()), from what its children's records say."""
    first_spawn = min((c.started_at for c in children), default=began)
    procs = [(c, ProcessStartup(c.name, c.role, c.ready_at - first_spawn,
                                tuple(c.ready.phases)))
             for c in children if c.ready is not None and c.ready_at is not None]
    phases = [StartupPhase("checks", first_spawn - began)]
    workers_ready, parts = first_spawn, ()
    workers = [(c.ready_at, p) for c, p in procs if c.role == "worker"]
    if workers:
        workers_ready, slowest = max(workers, key=lambda w: w[0])
        phases.append(StartupPhase("processes", slowest.unnamed_s))
        phases += [StartupPhase(name, slowest.phase(name)) for name in WORKER_PHASES]
        parts = slowest.parts
    phases.append(StartupPhase("frontend", end - workers_ready))
    return StartupTimes(end - began, tuple(phases), tuple(p for _, p in procs), parts)


_READY_LINE = re.compile(r"ready in (\d+(?:\.\d+)?) s \(([^()]*)\)((?: \[[\w-]+: [^\[\]]*\])*)")
_PARTS = re.compile(r"\[([\w-]+): ([^\[\]]*)\]")


def _timed(text: str, prefix: str = "") -> list[StartupPhase] | None:
    """`a 1.0, b 2.5` as phases (named prefix + name); None when a part is not `name secs`."""
    phases = []
    for part in text.split(","):
        name, _, seconds = part.strip().rpartition(" ")
        try:
            phases.append(StartupPhase(prefix + name, float(seconds)))
        except ValueError:
            return None
    return phases


def parse_ready_line(text: str) -> StartupTimes | None:
    """The total, phases and parts of the first ready line (as StartupTimes.line() writes it)
    in `text`, e.g. a server's stderr; None when there is none. For tools that time a server
    from outside it: the line keeps one or two decimals, and names no processes."""
    found = _READY_LINE.search(text)
    if found is None:
        return None
    phases = _timed(found.group(2))
    if phases is None:
        return None
    parts: list[StartupPhase] = []
    for phase, listed in _PARTS.findall(found.group(3)):
        parts += _timed(listed, f"{phase}.") or []
    return StartupTimes(float(found.group(1)), tuple(phases), (), tuple(parts))
