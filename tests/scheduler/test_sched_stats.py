"""The scheduler's counters (EngineStats) equal what its steps did, recounted here from the
plans the workers received and the tokens the clients got: prefill tokens computed and served
from the prefix cache, tokens generated, preemptions, finished requests, steps."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, drive, make_request

from protocol import StepPlan
from scheduler_proc import Scheduler, SchedulerConfig


def setup(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(num_blocks, block_size, **kw)), FakeWorker(num_blocks,
                                                                                block_size)


def recount(plans: list[StepPlan]) -> dict[str, int]:
    """What the workers were asked to do: prefill tokens computed (positions below what the
    sequence knew when last sent in full), cached tokens, and re-sends (preemptions)."""
    known: dict[int, int] = {}
    computed: dict[int, int] = {}
    counts = {"prompt": 0, "cached": 0, "resends": 0}
    for plan in plans:
        for ns in plan.new_seqs:
            counts["resends"] += ns.seq_id in known
            known[ns.seq_id] = len(ns.token_ids)
            computed[ns.seq_id] = ns.num_computed + ns.num_new
            counts["cached"] += ns.num_computed
            counts["prompt"] += ns.num_new
        for sid, n in zip(plan.cached.seq_ids, plan.cached.num_new, strict=True):
            start = computed[sid]
            counts["prompt"] += max(0, min(start + n, known[sid]) - start)
            computed[sid] = start + n
    return counts


def generated(out) -> int:
    return sum(len(o.token_ids) for o in out.outputs.values())


@pytest.mark.parametrize("overlap", [True, False])
def test_counters_match_a_shared_prefix_workload_with_chunked_prefill(overlap):
    # Chunks of at most 5 tokens: later prefill chunks are counted, not only the first.
    sched, worker = setup(overlap=overlap, max_num_batched_tokens=5)
    shared = list(range(1, 9))  # two full blocks
    sched.add_request(make_request(1, shared + [40, 41, 42, 43], max_tokens=5, ignore_eos=True))
    first = drive(sched, worker)
    sched.add_request(make_request(2, shared + [50, 51, 52], max_tokens=4, ignore_eos=True))
    sched.add_request(make_request(3, shared + [60], max_tokens=3, ignore_eos=True))
    second = drive(sched, worker)
    stats = sched.stats()
    # Request 1 computes its 12 tokens; 2 and 3 each find the 8 shared ones cached.
    assert stats.cached_prompt_tokens == 16
    assert stats.prompt_tokens == 12 + 3 + 1
    assert stats.generated_tokens == generated(first) + generated(second) == 5 + 4 + 3
    assert stats.finished_requests == 3 and stats.preemptions == 0
    assert stats.steps == len(worker.plans)
    assert (stats.running, stats.waiting, stats.kv_blocks_used, stats.kv_blocks_total) == (
        0, 0, 0, 64)
    assert stats.schedule_time_s > 0 and stats.result_time_s > 0
    counts = recount(worker.plans)
    assert (counts["prompt"], counts["cached"]) == (16, 16)


@pytest.mark.parametrize("overlap", [True, False])
def test_counters_match_under_preemption_in_a_tiny_kv_pool(overlap):
    # 8 blocks of 4 cannot hold two sequences of 9 + 20 tokens: one is preempted, resumed
    # (recomputing its generated tokens as prefill, partly from the prefix cache).
    sched, worker = setup(num_blocks=8, overlap=overlap)
    for i in (1, 2):
        sched.add_request(make_request(i, 9, max_tokens=20, ignore_eos=True))
    out = drive(sched, worker)
    stats = sched.stats()
    counts = recount(worker.plans)
    assert counts["resends"] >= 1
    assert stats.preemptions == counts["resends"]
    assert stats.prompt_tokens == counts["prompt"]
    assert stats.cached_prompt_tokens == counts["cached"] > 0
    assert stats.generated_tokens == generated(out) == 40
    assert stats.finished_requests == 2
    assert stats.steps == len(worker.plans)


def test_gauges_while_running_and_aborts_count_as_finished():
    sched, worker = setup(num_blocks=16)
    for i in (1, 2, 3):
        sched.add_request(make_request(i, 8, max_tokens=50, ignore_eos=True))
    queued = sched.stats()
    assert (queued.running, queued.waiting, queued.kv_blocks_used) == (0, 3, 0)
    worker.execute(sched.schedule())
    now = sched.stats()
    assert now.running + now.waiting == 3 and now.running >= 1
    assert now.kv_blocks_used == sum(len(s.block_table) for s in sched.running) > 0
    sched.abort([1, 2, 3])
    after = sched.stats()
    assert (after.running, after.waiting, after.kv_blocks_used) == (0, 0, 0)
    assert after.finished_requests == 3 and after.generated_tokens == 0
    assert after.time_s >= now.time_s
