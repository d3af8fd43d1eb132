"""/metrics over data-parallel replicas: each publishes its own EngineStats, and the metrics
are their sum (counters over every replica, gauges over those still publishing), so a
replica that stops leaves its counters and not its last running count."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics.engine_metrics import SILENT_AFTER_S, EngineMetrics
from protocol.engine_messages import EngineStats


def stats(t: float, generated: int, running: int, used: int, finished: list[int]) -> EngineStats:
    return EngineStats(time_s=t, steps=10, prompt_tokens=100, cached_prompt_tokens=20,
                       generated_tokens=generated, preemptions=1, finished_requests=sum(finished),
                       schedule_time_s=0.5, result_time_s=0.25, running=running, waiting=1,
                       kv_blocks_used=used, kv_blocks_total=100, finished_by_reason=finished)


def scrape(metrics: EngineMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            label = sample.labels.get("finished_reason")
            out[sample.name + (f"[{label}]" if label else "")] = sample.value
    return out


def test_replicas_are_summed_and_a_silent_one_keeps_only_its_counters():
    now = [100.0]
    metrics = EngineMetrics(clock=lambda: now[0])
    metrics.update(stats(1.0, generated=50, running=3, used=30, finished=[0, 2, 1]), source=0)
    metrics.update(stats(7.0, generated=70, running=2, used=10, finished=[0, 1]), source=1)
    metrics.update(stats(0.5, generated=1, running=9, used=99, finished=[]), source=1)  # older
    both = scrape(metrics)
    assert both["nanopipe:generation_tokens_total"] == 120
    assert both["nanopipe:prompt_tokens_total"] == 200
    assert both["nanopipe:num_requests_running"] == 5
    assert both["nanopipe:kv_cache_usage_perc"] == 40 / 200
    assert both["nanopipe:requests_finished_total[length]"] == 3  # [stop, length, abort]
    # Replica 1 stops publishing: its gauges leave the sum, its counters stay.
    now[0] += SILENT_AFTER_S + 1
    metrics.update(stats(2.0, generated=60, running=1, used=5, finished=[0, 2, 2]), source=0)
    one = scrape(metrics)
    assert one["nanopipe:generation_tokens_total"] == 130
    assert one["nanopipe:num_requests_running"] == 1
    assert one["nanopipe:kv_cache_usage_perc"] == 5 / 100


def test_one_replica_reads_as_its_own_stats():
    metrics = EngineMetrics()
    only = stats(1.0, generated=5, running=2, used=7, finished=[0, 1])
    metrics.update(only)
    assert metrics.latest == only
