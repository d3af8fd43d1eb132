"""What the dashboard knows: the engine's counters and every request it has seen, fed one
published message at a time, and a frozen view of them for one frame. No sockets, no clock:
the caller passes the time, so a view is a pure function of what arrived."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from frontend.engine.stats_log import StatsRates, rates
from protocol import TokenDeltas
from protocol.engine_messages import EngineStats, WatchRequest

RATE_WINDOW_S = 2.0
"""Rates are taken over about this much of the scheduler's time (stats come every 0.5 s)."""
MIN_RATE_SPAN_S = 0.5
"""A request's tok/s is shown once its tokens have spanned this long."""
KEEP_FINISHED = 8
"""Finished requests stay in the table, newest first, until this many newer ones finish."""


@dataclass(frozen=True, slots=True)
class StepSplit:
    """Where the scheduler's time per step went, over the rate window."""

    steps_per_s: float
    step_ms: float
    """Wall time per step, as the scheduler saw it."""
    schedule_ms: float
    """Planning the step."""
    result_ms: float
    """Applying its result."""
    gpu_ms: float = 0.0
    """The workers' device time (forward and sample) per step, as they measured it."""

    @property
    def other_ms(self) -> float:
        """The rest: waiting for the workers (and the scheduler's idle time)."""
        return max(0.0, self.step_ms - self.schedule_ms - self.result_ms)


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: int
    client_request_id: str
    tokens: int
    """Generated tokens seen since the dashboard attached."""
    tok_s: float | None
    age_s: float
    state: str
    """"queued" (no token yet: waiting or in prefill), "generating", or how it finished."""
    joined_late: bool
    """It began before the dashboard attached: its token count is partial."""


@dataclass(frozen=True, slots=True)
class TopView:
    """Everything one frame shows."""

    address: str
    stats: EngineStats | None
    """The latest counters (None until the first arrive)."""
    rates: StatsRates | None
    """None until two stats a window apart have arrived."""
    steps: StepSplit | None
    prefix_hits_recent: float | None
    """Share of the rate window's prefill tokens served from the prefix cache (None when it
    had no prefill)."""
    prefix_hits_total: float | None
    """Share of all prefill tokens since start served from the prefix cache."""
    requests: list[RequestView]
    status: str
    """"attached", or why the stream ended."""


@dataclass(slots=True)
class _Request:
    request_id: int
    client_request_id: str
    seen_s: float
    joined_late: bool
    tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish: str | None = None
    finished_s: float | None = None

    def view(self, now: float) -> RequestView:
        end = self.finished_s if self.finished_s is not None else now
        tok_s = None
        if self.first_token_s is not None and self.last_token_s is not None:
            span = self.last_token_s - self.first_token_s
            # Frames queued while the watcher was busy arrive together: a short span says
            # more about reading than about the engine.
            tok_s = (self.tokens - 1) / span if span >= MIN_RATE_SPAN_S else None
        state = self.finish or ("generating" if self.tokens else "queued")
        return RequestView(self.request_id, self.client_request_id, self.tokens, tok_s,
                           end - self.seen_s, state, self.joined_late)


class TopState:
    """Feed it every message from deltas_pub (`on_*`), then take `view(now)` per frame."""

    def __init__(self, address: str, window_s: float = RATE_WINDOW_S,
                 keep_finished: int = KEEP_FINISHED) -> None:
        self.address = address
        self.window_s = window_s
        self.status = "attached"
        self._greeted = True
        """Requests announced before the first stats began before we attached (the greeting
        lists them ahead of its stats)."""
        self._stats: deque[EngineStats] = deque()
        self._running: dict[int, _Request] = {}
        self._finished: deque[_Request] = deque(maxlen=keep_finished)

    def on_request(self, msg: WatchRequest, now: float) -> None:
        if msg.request_id not in self._running:
            self._running[msg.request_id] = _Request(msg.request_id, msg.client_request_id,
                                                     now, joined_late=self._greeted)

    def on_deltas(self, msg: TokenDeltas, now: float) -> None:
        for rid, tokens, finish, error in zip(msg.request_ids, msg.token_ids,
                                              msg.finish_reasons, msg.errors):
            req = self._running.get(rid)
            if req is None:  # it began before we attached, and was not announced to us
                req = self._running[rid] = _Request(rid, "", now, joined_late=True)
            if tokens:
                req.tokens += len(tokens)
                if req.first_token_s is None:
                    req.first_token_s = now
                req.last_token_s = now
            if finish is not None or error is not None:
                req.finish = f"error: {error.message}" if error is not None else str(finish)
                req.finished_s = now
                self._finished.appendleft(self._running.pop(rid))

    def on_stats(self, msg: EngineStats) -> None:
        self._greeted = False
        if self._stats and msg.time_s <= self._stats[-1].time_s:
            return  # a repeat (the publisher greets every new subscriber with one)
        self._stats.append(msg)
        while len(self._stats) > 2 and msg.time_s - self._stats[1].time_s >= self.window_s:
            self._stats.popleft()

    @property
    def stats_span_s(self) -> float:
        """How much of the scheduler's time the stats at hand cover (rates need some)."""
        return self._stats[-1].time_s - self._stats[0].time_s if self._stats else 0.0

    def view(self, now: float) -> TopView:
        latest = self._stats[-1] if self._stats else None
        r = steps = None
        if len(self._stats) >= 2:
            first = self._stats[0]
            r = rates(first, latest)
            steps = _step_split(first, latest)
        recent = total = None
        if latest is not None:
            total = _hit_share(latest.prompt_tokens, latest.cached_prompt_tokens)
            first = self._stats[0]
            recent = _hit_share(latest.prompt_tokens - first.prompt_tokens,
                                latest.cached_prompt_tokens - first.cached_prompt_tokens)
        rows = sorted(self._running.values(), key=lambda q: q.seen_s)
        requests = [q.view(now) for q in rows] + [q.view(now) for q in self._finished]
        return TopView(self.address, latest, r, steps, recent, total, requests, self.status)


def _hit_share(computed: int, cached: int) -> float | None:
    return cached / (computed + cached) if computed + cached else None


def _step_split(prev: EngineStats, cur: EngineStats) -> StepSplit | None:
    n = cur.steps - prev.steps
    if n <= 0:
        return None
    dt = cur.time_s - prev.time_s
    return StepSplit(steps_per_s=n / dt, step_ms=dt / n * 1e3,
                     schedule_ms=(cur.schedule_time_s - prev.schedule_time_s) / n * 1e3,
                     result_ms=(cur.result_time_s - prev.result_time_s) / n * 1e3,
                     gpu_ms=(cur.gpu_busy_s - prev.gpu_busy_s) / n * 1e3)
