"""The stats line's arithmetic: rates between two EngineStats of the scheduler."""

from __future__ import annotations

import pytest

from frontend.engine.stats_log import device_label, format_line, rates
from protocol.engine_messages import EngineStats


def stats(t, prompt=0, cached=0, generated=0, preemptions=0, running=0, waiting=0,
          used=0, total=100, busy=0.0, proposed=0, accepted=0) -> EngineStats:
    return EngineStats(time_s=t, steps=0, prompt_tokens=prompt, cached_prompt_tokens=cached,
                       generated_tokens=generated, preemptions=preemptions,
                       finished_requests=0, schedule_time_s=0.0, result_time_s=0.0,
                       running=running, waiting=waiting, kv_blocks_used=used,
                       kv_blocks_total=total, gpu_busy_s=busy,
                       spec_proposed_tokens=proposed, spec_accepted_tokens=accepted)


def test_rates_are_differences_over_the_schedulers_interval():
    prev = stats(100.0, prompt=1000, cached=200, generated=5000, preemptions=1, busy=10.0,
                 proposed=100, accepted=50)
    cur = stats(102.0, prompt=1900, cached=800, generated=7469, preemptions=3, running=12,
                waiting=3, used=412, total=1000, busy=11.88, proposed=300, accepted=172)
    r = rates(prev, cur)
    assert r.interval_s == 2.0
    assert r.generated_tok_s == pytest.approx(1234.5)
    assert r.prompt_tok_s == pytest.approx(450.0)
    assert r.prefix_hits == pytest.approx(600 / 1500)  # of this interval's prefill only
    assert r.kv_used == pytest.approx(0.412)
    assert r.preemptions == 2 and not r.idle
    assert format_line(r, device_label("cuda")) == (
        "1,234.5 gen tok/s, 450.0 prompt tok/s, running 12, waiting 3, "
        "KV 41.2% used, prefix hits 40.0%, preemptions 2, GPU busy 94.0%, "
                              "spec accepted 61.0%")


def test_an_interval_without_prefill_shows_the_hit_rate_since_start():
    prev = stats(1.0, prompt=300, cached=100, generated=10, running=2)
    cur = stats(2.0, prompt=300, cached=100, generated=20, running=2)
    r = rates(prev, cur)
    assert r.prefix_hits == pytest.approx(0.25) and r.prompt_tok_s == 0.0
    assert "prefix hits 25.0%" in format_line(r)


def test_a_fresh_idle_engine():
    r = rates(stats(1.0), stats(1.5))
    assert r.idle and r.prefix_hits is None and r.kv_used == 0.0
    assert format_line(r, device_label("cpu")) == (
        "0.0 gen tok/s, 0.0 prompt tok/s, running 0, waiting 0, "
        "KV 0.0% used, prefix hits -, preemptions 0, CPU busy 0.0%")


def test_stats_out_of_order_are_refused():
    with pytest.raises(ValueError, match="do not follow"):
        rates(stats(2.0), stats(2.0))


def test_serve_logs_every_ten_seconds_unless_told_and_refuses_a_bad_interval(capsys):
    from frontend.engine.cli import parse_serve_args

    assert parse_serve_args([]).engine.log_stats_interval == 10.0
    assert parse_serve_args(["--log-stats-interval", "0"]).engine.log_stats_interval == 0.0
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as exc:
            parse_serve_args(["--log-stats-interval", bad])
        assert exc.value.code == 2
        assert "--log-stats-interval must be in 0..86400" in capsys.readouterr().err


def test_the_line_names_the_host_tier_only_when_there_is_one():
    import dataclasses

    prev = dataclasses.replace(stats(10.0), host_hit_tokens=100, host_blocks_stored=4,
                               host_blocks_loaded=6, host_blocks_total=40)
    cur = dataclasses.replace(stats(11.0, prompt=10), host_hit_tokens=1124,
                              host_blocks_stored=9, host_blocks_loaded=70,
                              host_blocks_used=10, host_blocks_total=40, host_swaps_out=3,
                              host_swaps_in=2)
    line = format_line(rates(prev, cur))
    assert line.endswith(", host tier 1,024 tok hit, 5 blocks out / 64 in, swaps 3 out / 2 in, "
                         "25.0% used")
    assert "host tier" not in format_line(rates(stats(10.0), stats(11.0, prompt=10)))
