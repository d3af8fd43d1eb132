"""The periodic stats line: rates from two EngineStats, and the launcher's thread that logs it.

    nanopipe: 1,234.5 gen tok/s, 456.7 prompt tok/s, running 12, waiting 3, KV 41.2% used,
    prefix hits 37.5%, preemptions 0, GPU busy 94.0%[, spec accepted 61.0%]

("CPU busy" on a CPU engine: the share is of the device the workers compute on.)

The scheduler publishes cumulative counters on `deltas_pub` (EngineStats); every rate here is
the difference of two of them over the difference of their scheduler timestamps, so a line
says what happened in its interval however late it is printed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from protocol import ProtocolError
from protocol.auth import CurveKeys
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats
from protocol.sockets import MessageSocket

POLL_MS = 100
INTERVAL_SLACK = 0.9
"""Stats arrive on the scheduler's clock (every half second): a line is due once this share
of the interval has passed, so an interval of 0.5 s logs every message rather than every
other one."""


@dataclass(frozen=True, slots=True)
class StatsRates:
    """What one stats line says about the interval between two EngineStats."""

    interval_s: float
    generated_tok_s: float
    prompt_tok_s: float
    running: int
    waiting: int
    kv_used: float
    """Share of the KV blocks held by sequences (0..1)."""
    prefix_hits: float | None
    """Share of the interval's prefill tokens served from the prefix cache; since start when
    the interval had no prefill; None when there never was any."""
    preemptions: int
    """In the interval."""
    gpu_busy: float = 0.0
    """Share of the interval the workers' forward and sample kept the device busy (0..1)."""
    spec_accepted: float | None = None
    """Share of the interval's speculative proposals accepted; None without proposals."""
    host_tier: str | None = None
    """The host KV tier in the interval: tokens loaded, blocks stored / loaded, share used;
    None without a tier."""
    kv_transfer: str | None = None
    """Prefill/decode hand-offs in the interval (out and in, bytes, waiting, mean transfer
    time); None on a replica that never took part in one."""

    @property
    def idle(self) -> bool:
        return not (self.generated_tok_s or self.prompt_tok_s or self.running or self.waiting)


def rates(prev: EngineStats, cur: EngineStats) -> StatsRates:
    """The rates between two EngineStats of one scheduler, `prev` the earlier."""
    dt = cur.time_s - prev.time_s
    if dt <= 0:
        raise ValueError(f"stats at {cur.time_s} do not follow stats at {prev.time_s}")
    prompt = cur.prompt_tokens - prev.prompt_tokens
    cached = cur.cached_prompt_tokens - prev.cached_prompt_tokens
    if prompt + cached == 0:
        prompt, cached = cur.prompt_tokens, cur.cached_prompt_tokens
    return StatsRates(
        interval_s=dt,
        generated_tok_s=(cur.generated_tokens - prev.generated_tokens) / dt,
        prompt_tok_s=(cur.prompt_tokens - prev.prompt_tokens) / dt,
        running=cur.running,
        waiting=cur.waiting,
        kv_used=cur.kv_blocks_used / cur.kv_blocks_total if cur.kv_blocks_total else 0.0,
        prefix_hits=cached / (prompt + cached) if prompt + cached else None,
        preemptions=cur.preemptions - prev.preemptions,
        gpu_busy=min(1.0, max(0.0, (cur.gpu_busy_s - prev.gpu_busy_s) / dt)),
        spec_accepted=(cur.spec_accepted_tokens - prev.spec_accepted_tokens) / proposed
        if (proposed := cur.spec_proposed_tokens - prev.spec_proposed_tokens) else None,
        host_tier=_host_tier(prev, cur),
        kv_transfer=kv_transfer_text(prev, cur),
    )


def kv_transfer_text(prev: EngineStats | None, cur: EngineStats) -> str | None:
    """Hand-offs since `prev` (since start when None): what went out and came in, what waits,
    and the mean transfer time of those that landed here."""
    if not (cur.kv_handoffs_out or cur.kv_handoffs_in or cur.kv_handoffs_out_waiting
            or cur.kv_handoffs_in_waiting or cur.kv_handoff_failures):
        return None
    d = lambda name: getattr(cur, name) - (getattr(prev, name) if prev else 0)  # noqa: E731
    landed = d("kv_handoffs_in")
    mean = f", {d('kv_transfer_s') / landed * 1e3:.1f} ms each" if landed else ""
    return (f"KV hand-offs {d('kv_handoffs_out')} out "
            f"({d('kv_transfer_bytes_out') / 2**20:,.1f} MiB) / {landed} in "
            f"({d('kv_transfer_bytes_in') / 2**20:,.1f} MiB){mean}, waiting "
            f"{cur.kv_handoffs_out_waiting} out / {cur.kv_handoffs_in_waiting} in, failed "
            f"{d('kv_handoff_failures')}")


def _host_tier(prev: EngineStats, cur: EngineStats) -> str | None:
    if not cur.host_blocks_total:
        return None
    return (f"host tier {cur.host_hit_tokens - prev.host_hit_tokens:,} tok hit, "
            f"{cur.host_blocks_stored - prev.host_blocks_stored} blocks out / "
            f"{cur.host_blocks_loaded - prev.host_blocks_loaded} in, "
            f"swaps {cur.host_swaps_out - prev.host_swaps_out} out / "
            f"{cur.host_swaps_in - prev.host_swaps_in} in, "
            f"{cur.host_blocks_used / cur.host_blocks_total:.1%} used")


def device_label(device: str) -> str:
    """How the stats name the device whose busy share they report ("GPU", "CPU")."""
    return "GPU" if device == "cuda" else device.upper()


def format_line(r: StatsRates, device: str = "device") -> str:
    """One stats line; `device` names what "busy" measures (a device_label, or "device")."""
    hits = "-" if r.prefix_hits is None else f"{r.prefix_hits:.1%}"
    return (f"{r.generated_tok_s:,.1f} gen tok/s, {r.prompt_tok_s:,.1f} prompt tok/s, "
            f"running {r.running}, waiting {r.waiting}, KV {r.kv_used:.1%} used, "
            f"prefix hits {hits}, preemptions {r.preemptions}, {device} busy {r.gpu_busy:.1%}"
            + ("" if r.spec_accepted is None else f", spec accepted {r.spec_accepted:.1%}")
            + ("" if r.host_tier is None else f", {r.host_tier}")
            + ("" if r.kv_transfer is None else f", {r.kv_transfer}"))


def print_line(text: str) -> None:
    """On stderr, like the launcher's other notes (stdout carries what users copy)."""
    print(f"nanopipe: {text}", file=sys.stderr, flush=True)


class StatsLogger:
    """Subscribes to the stats of a pipeline's `deltas_pub` (nothing else is sent to it) and
    emits a line every `interval_s`; while idle, only the first idle line."""

    def __init__(self, ctx: zmq.Context, address: str, keys: CurveKeys | None,
                 interval_s: float, emit: Callable[[str], None] = print_line,
                 device: str | None = None) -> None:
        """`device`: what the workers compute on ("cpu", "cuda"), named in each line."""
        self.interval_s = interval_s
        self.device = "device" if device is None else device_label(device)
        self.emit = emit
        self._sub = MessageSocket(ctx, zmq.SUB, address, bind=False, accepts=(EngineStats,),
                                  security=keys)
        self._sub.socket.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._sub.socket.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
        self._stop = threading.Event()
        # The socket is this thread's from here on (starting a thread is a memory barrier).
        self._thread = threading.Thread(target=self._run, name="nanopipe-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: EngineStats | None = None
        was_idle = False
        try:
            while not self._stop.is_set():
                if not self._sub.poll(POLL_MS):
                    continue
                try:
                    cur = self._sub.recv()
                except ProtocolError:
                    continue  # a frame sent before our topic took effect
                if last is None or cur.time_s <= last.time_s:
                    last = cur
                    continue
                if cur.time_s - last.time_s < self.interval_s * INTERVAL_SLACK:
                    continue
                r = rates(last, cur)
                if not (r.idle and was_idle):
                    self.emit(format_line(r, self.device))
                was_idle = r.idle
                last = cur
        finally:
            self._sub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
