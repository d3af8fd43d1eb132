"""Per-request metrics as the scheduler produces them: on the final delta of each request
(and only there), and once more in the next EngineStats."""

from __future__ import annotations

import time

import pytest
from fake_worker import Collector, FakeWorker, drive, make_request

from protocol import AddRequest, FinishReason, TokenDeltas
from scheduler_proc import Scheduler, SchedulerConfig


class MetricsCollector(Collector):
    """Also keeps the metrics each TokenDeltas carries, checking they ride on the finish."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = {}

    def add(self, deltas: TokenDeltas | None) -> None:
        super().add(deltas)
        if deltas is None:
            return
        finished = {rid for rid, r in zip(deltas.request_ids, deltas.finish_reasons) if r}
        assert set(deltas.metrics_ids) == finished
        for rid, m in zip(deltas.metrics_ids, deltas.metrics, strict=True):
            assert rid not in self.metrics
            self.metrics[rid] = m


def setup(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_model_len", 128)
    return (Scheduler(SchedulerConfig(num_blocks, block_size, **kw)),
            FakeWorker(num_blocks, block_size), MetricsCollector())


@pytest.mark.parametrize("overlap", [True, False])
def test_shared_prefix_is_reported_as_cached_and_timings_are_ordered(overlap):
    sched, worker, out = setup(overlap=overlap)
    shared = list(range(1, 9))  # two full blocks
    arrival = time.time() - 0.25  # tokenized a quarter second ago
    req = make_request(1, shared + [40, 41], max_tokens=5, ignore_eos=True)
    sched.add_request(AddRequest(req.request_id, req.prompt_token_ids, req.params,
                                 req.eos_token_ids, arrival_time=arrival))
    drive(sched, worker, out)
    sched.add_request(make_request(2, shared + [50], max_tokens=1, ignore_eos=True))
    drive(sched, worker, out)
    first, second = out.metrics[1], out.metrics[2]
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 8)
    assert (first.prompt_tokens, first.generated_tokens) == (10, 5)
    assert first.finish_reason is FinishReason.LENGTH and first.preemptions == 0
    assert first.arrival_time == arrival
    assert 0.25 <= first.queue_time_s <= first.ttft_s <= first.e2e_s < 10
    assert first.tpot_s > 0 and first.ttft_s + 4 * first.tpot_s <= first.e2e_s + 1e-9
    assert second.tpot_s is None and 0 <= second.queue_time_s <= second.ttft_s <= second.e2e_s
    stats = sched.stats()
    assert [m for m in stats.finished] == [first, second]
    assert stats.finished_by_reason[FinishReason.LENGTH] == 2
    assert sched.stats().finished == []  # each record goes out once


@pytest.mark.parametrize("overlap", [True, False])
def test_preemptions_are_counted_per_request(overlap):
    sched, worker, out = setup(num_blocks=8, overlap=overlap)
    for i in (1, 2):
        sched.add_request(make_request(i, 9, max_tokens=20, ignore_eos=True))
    drive(sched, worker, out)
    stats = sched.stats()
    assert sum(m.preemptions for m in out.metrics.values()) == stats.preemptions >= 1
    assert all(m.generated_tokens == 20 for m in out.metrics.values())


def test_an_aborted_waiting_request_has_no_token_timings():
    sched, worker, out = setup()
    sched.add_request(make_request(1, 8, max_tokens=5))
    sched.abort([1])
    out.add(sched.pop_deltas())
    m = out.metrics[1]
    assert m.finish_reason is FinishReason.ABORT
    assert (m.queue_time_s, m.ttft_s, m.tpot_s, m.generated_tokens) == (None, None, None, 0)
    assert m.e2e_s >= 0
    assert sched.stats().finished_by_reason == [0, 0, 1, 0]
