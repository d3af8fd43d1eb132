"""One pipeline's Prometheus metrics, in a registry of its own (never the global one, so two
pipelines in one process do not mix).

Gauges and counters are read from the latest EngineStats at scrape time: its counters are
cumulative already, so a missed message loses nothing. With data-parallel replicas each
publishes its own: the latest of each are summed (`combined`). Histograms are observed from
the finished-request records each EngineStats carries once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.engine_messages import EngineStats
from protocol.outcomes import FINISH_REASON_STRINGS

PREFIX = "nanopipe:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                     0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


GAUGES = ("running", "waiting", "kv_blocks_used", "kv_blocks_total", "host_blocks_used",
          "host_blocks_total", "kv_handoffs_out_waiting", "kv_handoffs_in_waiting")
SILENT_AFTER_S = 5.0
"""A replica that published no stats for this long (they come every half second) is down: its
gauges no longer count, its counters keep their last values."""


def combined(stats: list[EngineStats], live: list[bool]) -> EngineStats:
    """Several replicas' latest stats as one: counters summed over all, gauges over the `live`
    ones (a stopped replica's last gauges would otherwise stay on forever)."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(EngineStats):
        name = f.name
        if name == "finished":
            values[name] = []
        elif name == "time_s":
            values[name] = max(s.time_s for s in stats)
        elif name == "finished_by_reason":
            width = max(len(s.finished_by_reason) for s in stats)
            values[name] = [sum(s.finished_by_reason[i] for s in stats
                                if i < len(s.finished_by_reason)) for i in range(width)]
        else:
            pool = [s for s, up in zip(stats, live, strict=True) if up] if name in GAUGES \
                else stats
            values[name] = sum(getattr(s, name) for s in pool)
    return EngineStats(**values)


class _LatestStats(Collector):
    """Gauges and counters from the latest EngineStats (zeros before the first)."""

    def __init__(self, owner: EngineMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        s = self._owner.latest
        g = lambda name, doc, value: GaugeMetricFamily(PREFIX + name, doc, value=value)
        c = lambda name, doc, value: CounterMetricFamily(PREFIX + name, doc, value=value)
        running = s.running if s else 0
        waiting = s.waiting if s else 0
        used = s.kv_blocks_used / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
        computed = s.prompt_tokens if s else 0
        cached = s.cached_prompt_tokens if s else 0
        yield g("num_requests_running", "Requests in the running batch.", running)
        yield g("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield g("kv_cache_usage_perc", "Share of the KV cache blocks in use (0..1).", used)
        yield g("prefix_cache_hit_rate", "Share of prefill tokens served from the prefix "
                "cache since start (0..1).", cached / (computed + cached) if cached else 0.0)
        yield c("prompt_tokens", "Prefill tokens computed (prompts, and recomputation after "
                "preemption).", computed)
        yield c("prompt_tokens_cached", "Prefill tokens served from the prefix cache.", cached)
        yield c("generation_tokens", "Tokens generated.", s.generated_tokens if s else 0)
        yield c("num_preemptions", "Sequences preempted (their KV freed, recomputed later).",
                s.preemptions if s else 0)
        yield c("engine_steps", "Steps the scheduler planned.", s.steps if s else 0)
        yield c("engine_steps_two_ahead", "Steps planned while two others were in flight "
                "(--plans-ahead: where the host's per-step chain paces decoding).",
                s.steps_two_ahead if s else 0)
        yield c("gpu_busy_seconds", "Device time of the steps' forward and sample, as the "
                "workers time it (rank 0); its rate is the share of time the GPU was busy.",
                s.gpu_busy_s if s else 0.0)
        yield c("spec_proposed_tokens", "Speculative tokens proposed and verified.",
                s.spec_proposed_tokens if s else 0)
        yield c("spec_accepted_tokens", "Speculative tokens the model accepted.",
                s.spec_accepted_tokens if s else 0)
        yield c("host_tier_hit_tokens", "Prefill tokens loaded from the host KV tier (part "
                "of prompt_tokens_cached).", s.host_hit_tokens if s else 0)
        yield c("host_tier_blocks_stored", "KV blocks copied to the host tier.",
                s.host_blocks_stored if s else 0)
        yield c("host_tier_blocks_loaded", "KV blocks copied back from the host tier.",
                s.host_blocks_loaded if s else 0)
        yield c("host_tier_swaps_out", "Preempted sequences swapped out to the host tier "
                "instead of recomputed (part of num_preemptions).",
                s.host_swaps_out if s else 0)
        yield c("host_tier_swaps_in", "Swapped-out sequences resumed with their KV loaded "
                "back from the host tier.", s.host_swaps_in if s else 0)
        yield g("host_tier_usage_perc", "Share of the host KV tier's blocks in use (0..1).",
                s.host_blocks_used / s.host_blocks_total if s and s.host_blocks_total else 0.0)
        yield from _kv_transfer(s, g, c)
        finished = CounterMetricFamily(PREFIX + "requests_finished", "Requests finished, by "
                                       "finish reason.", labels=["finished_reason"])
        counts = s.finished_by_reason if s else []
        for reason, name in FINISH_REASON_STRINGS.items():
            finished.add_metric([name], counts[reason] if reason < len(counts) else 0)
        yield finished


def _kv_transfer(s: EngineStats | None, g, c) -> Iterator[Metric]:
    """Prefill/decode disaggregation: the KV that moved between replicas (docs/
    disaggregation.md); out is counted by prefill replicas, in by decode ones."""
    v = lambda name: getattr(s, name) if s else 0
    yield c("kv_transfer_handoffs_out", "Requests whose KV a decode replica took.",
            v("kv_handoffs_out"))
    yield c("kv_transfer_handoffs_in", "Requests whose KV landed on a decode replica.",
            v("kv_handoffs_in"))
    yield c("kv_transfer_failures", "Hand-offs given up (timeout, refused frames); their "
            "requests failed.", v("kv_handoff_failures"))
    for way in ("out", "in"):
        yield c(f"kv_transfer_blocks_{way}", f"KV blocks transferred {way}.",
                v(f"kv_transfer_blocks_{way}"))
        yield c(f"kv_transfer_bytes_{way}", f"KV bytes transferred {way} (all ranks).",
                v(f"kv_transfer_bytes_{way}"))
        yield g(f"kv_transfer_waiting_{way}", "Hand-offs not finished on this side "
                f"({'offered or exporting' if way == 'out' else 'waiting for blocks or KV'}).",
                v(f"kv_handoffs_{way}_waiting"))
    yield c("kv_transfer_blocks_reused", "KV blocks of handed-off requests that the decode "
            "replica held already (its prefix cache), so not transferred.",
            v("kv_handoff_blocks_reused"))
    yield c("kv_transfer_seconds", "Transfer time summed over the hand-offs in (blocks "
            "accepted -> landed on every rank).", v("kv_transfer_s"))


class EngineMetrics:
    """Prometheus metrics of one pipeline; feed it every EngineStats (`update`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cache_config: dict[str, str] | None = None) -> None:
        """`cache_config`: labels of the `cache_config_info` gauge (always 1), the KV cache's
        settings a dashboard shows beside its usage (block size, dtype)."""
        self._clock = clock
        self.registry = CollectorRegistry()
        if cache_config:
            info = Gauge(PREFIX + "cache_config_info", "The KV cache's settings, as labels.",
                         sorted(cache_config), registry=self.registry)
            info.labels(**cache_config).set(1)
        self._latest: dict[int, tuple[EngineStats, float]] = {}
        """Per source (a replica): its latest stats and when they arrived (by `clock`)."""
        self._lock = threading.Lock()
        self.registry.register(_LatestStats(self))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival to first generated token.", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between generated "
                              "tokens after the first, per request.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Arrival to first scheduled (tokenizing included).",
                               LATENCY_BUCKETS)
        self.kv_transfer = histogram("kv_transfer_time_seconds", "Per handed-off request: "
                                     "its KV's transfer from the prefill to the decode "
                                     "replica.", TOKEN_GAP_BUCKETS)

    @property
    def latest(self) -> EngineStats | None:
        """Every source's latest stats as one (None before the first)."""
        with self._lock:
            entries = list(self._latest.values())
        if not entries:
            return None
        now = self._clock()
        live = [now - seen < SILENT_AFTER_S for _, seen in entries]
        if len(entries) == 1 and live[0]:
            return entries[0][0]
        return combined([s for s, _ in entries], live)

    def update(self, stats: EngineStats, source: int = 0) -> None:
        """Take one EngineStats of `source` (a replica's index): its gauges and counters, and
        its finished requests."""
        with self._lock:
            previous = self._latest.get(source)
            if previous is None or stats.time_s >= previous[0].time_s:
                self._latest[source] = (stats, self._clock())
            for m in stats.finished:
                self.e2e.observe(m.e2e_s)
                if m.queue_time_s is not None:
                    self.queue.observe(m.queue_time_s)
                if m.ttft_s is not None:
                    self.ttft.observe(m.ttft_s)
                if m.tpot_s is not None:
                    self.tpot.observe(m.tpot_s)
                if m.kv_transfer_s is not None:
                    self.kv_transfer.observe(m.kv_transfer_s)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric now."""
        return generate_latest(self.registry)
