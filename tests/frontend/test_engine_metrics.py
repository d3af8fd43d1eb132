"""EngineMetrics from EngineStats messages, read back through the Prometheus text format:
counters and gauges are the latest message's (a lost message loses nothing of them), each
finished-request record is observed once, and two pipelines' metrics never mix."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import EngineMetrics
from protocol import FinishReason, RequestMetrics
from protocol.engine_messages import EngineStats


def stats(t: float, generated: int, finished: list[RequestMetrics], by_reason: list[int],
          running: int = 0) -> EngineStats:
    return EngineStats(t, 10, 300, 100, generated, 1, sum(by_reason), 0.1, 0.1, running, 2,
                       25, 100, finished_by_reason=by_reason, finished=finished)


def record(ttft: float | None, reason: FinishReason = FinishReason.LENGTH) -> RequestMetrics:
    return RequestMetrics(1.7e9, 0.01, ttft, 0.02 if ttft else None, 1.0, 8, 0, 4, 0, reason)


def scrape(metrics: EngineMetrics) -> dict[str, float]:
    return {s.name + "".join(f"{{{v}}}" for k, v in s.labels.items()): s.value
            for f in text_string_to_metric_families(metrics.exposition().decode())
            for s in f.samples}


def test_counters_follow_the_latest_stats_and_records_are_observed_once():
    m = EngineMetrics()
    m.update(stats(1.0, 8, [record(0.1), record(0.2)], [0, 2, 0, 0], running=3))
    m.update(stats(1.5, 12, [], [0, 2, 0, 0]))  # a publication with nothing finished
    # The next message was lost (its record too); the one after still has every count.
    m.update(stats(2.5, 20, [record(None, FinishReason.ABORT)], [0, 3, 1, 0]))
    m.update(stats(2.0, 16, [], [0, 3, 0, 0]))  # late and out of order: counts not taken
    got = scrape(m)
    assert got["nanopipe:generation_tokens_total"] == 20
    assert got["nanopipe:prompt_tokens_total"] == 300
    assert got["nanopipe:prompt_tokens_cached_total"] == 100
    assert got["nanopipe:prefix_cache_hit_rate"] == 0.25
    assert got["nanopipe:kv_cache_usage_perc"] == 0.25
    assert got["nanopipe:num_requests_running"] == 0 and got["nanopipe:num_requests_waiting"] == 2
    assert got["nanopipe:num_preemptions_total"] == 1
    assert got["nanopipe:requests_finished_total{length}"] == 3
    assert got["nanopipe:requests_finished_total{abort}"] == 1
    assert got["nanopipe:e2e_request_latency_seconds_count"] == 3
    assert got["nanopipe:time_to_first_token_seconds_count"] == 2  # the abort had no token
    assert abs(got["nanopipe:time_to_first_token_seconds_sum"] - 0.3) < 1e-9
    assert got["nanopipe:time_to_first_token_seconds_bucket{0.1}"] == 1


def test_two_pipelines_keep_separate_registries():
    a, b = EngineMetrics(), EngineMetrics()
    a.update(stats(1.0, 8, [record(0.1)], [0, 1, 0, 0]))
    assert scrape(a)["nanopipe:e2e_request_latency_seconds_count"] == 1
    assert scrape(b)["nanopipe:e2e_request_latency_seconds_count"] == 0
    assert scrape(b)["nanopipe:generation_tokens_total"] == 0


def test_host_tier_counters_and_usage():
    m = EngineMetrics()
    m.update(dataclasses.replace(stats(1.0, 8, [], [0, 0, 0, 0]), host_hit_tokens=64,
                                 host_blocks_stored=9, host_blocks_loaded=7, host_blocks_used=5,
                                 host_blocks_total=20, host_swaps_out=2, host_swaps_in=1))
    got = scrape(m)
    assert got["nanopipe:host_tier_hit_tokens_total"] == 64
    assert got["nanopipe:host_tier_blocks_stored_total"] == 9
    assert got["nanopipe:host_tier_blocks_loaded_total"] == 7
    assert got["nanopipe:host_tier_swaps_out_total"] == 2
    assert got["nanopipe:host_tier_swaps_in_total"] == 1
    assert got["nanopipe:host_tier_usage_perc"] == 0.25
