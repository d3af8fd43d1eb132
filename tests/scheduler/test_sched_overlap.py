"""Overlap scheduling: plan N+1 goes out before result N is processed."""

from __future__ import annotations

import random

import pytest
from fake_worker import Collector, FakeWorker, drive, make_request, reference_generate

from protocol import FinishReason
from scheduler_proc import Scheduler, SchedulerConfig


def workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    shared = [rng.randrange(64) for _ in range(12)]
    reqs = []
    for rid in range(n):
        head = shared[: rng.choice([0, 4, 9, 12])]
        prompt = head + [rng.randrange(64) for _ in range(rng.randint(1, 14))]
        reqs.append(make_request(rid, prompt, max_tokens=rng.randint(1, min(16, 32 - len(prompt))),
                                 eos=[1, 2, 3]))
    return reqs


def ahead(plans_ahead):
    """SchedulerConfig fields for a parametrized depth: 1, 2, or "small" (two ahead only
    while at most three sequences run, all decoding, none waiting: the GPU default's policy
    with a limit the workloads here cross)."""
    if plans_ahead == "small":
        return dict(plans_ahead=2, deep_plan_max_seqs=3)
    return dict(plans_ahead=plans_ahead)


def run(reqs, overlap, num_blocks, caching=True, batched=24, plans_ahead=1):
    cfg = SchedulerConfig(num_blocks, 4, max_num_seqs=8, max_num_batched_tokens=batched,
                          max_model_len=32, enable_prefix_caching=caching, overlap=overlap,
                          **ahead(plans_ahead))
    sched, worker = Scheduler(cfg), FakeWorker(num_blocks, 4)
    for r in reqs:
        sched.add_request(r)
    out = drive(sched, worker).outputs
    assert sched.block_manager.num_free == num_blocks
    return {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}, worker


@pytest.mark.parametrize("num_blocks", [8, 12, 40])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("plans_ahead", [1, 2, "small"])
def test_overlap_on_and_off_give_identical_outputs(num_blocks, caching, plans_ahead):
    reqs = workload(num_blocks)
    on, worker = run(reqs, True, num_blocks, caching, plans_ahead=plans_ahead)
    off, _ = run(reqs, False, num_blocks, caching)
    assert on == off
    if num_blocks == 8:  # this pool forces preemptions and resumptions
        sent = [ns.seq_id for p in worker.plans for ns in p.new_seqs]
        assert len(sent) > len(set(sent))
    for r in reqs:
        assert on[r.request_id] == reference_generate(
            r.prompt_token_ids, r.params, r.eos_token_ids, 32
        )


def test_finish_revealed_while_next_step_in_flight():
    """EOS found in result N while plan N+1 (holding a decode for it) is in flight: one
    finish, blocks freed once, the extra token dropped, the mirror dropped next plan."""
    prompt = [5, 6, 7]
    probe = make_request(1, prompt, max_tokens=30)
    ref, _ = reference_generate(prompt, probe.params, [], 64)
    eos = ref[2]
    k = ref.index(eos)
    sched = Scheduler(SchedulerConfig(16, 4, max_model_len=64, overlap=True))
    worker = FakeWorker(16, 4)
    sched.add_request(make_request(1, prompt, max_tokens=30, eos=[eos]))
    sched.add_request(make_request(2, [9, 9], max_tokens=30, ignore_eos=True))
    c = Collector()
    results = [worker.execute(sched.schedule())]
    finished_at = None
    for n in range(k + 1):
        plan = sched.schedule()  # plan n+1 goes out first
        results.append(worker.execute(plan))
        assert 1 in plan.cached.seq_ids  # planned as if it survives step n
        c.add(sched.process_result(results[n]))
        sched.check_integrity()
        if c.outputs[1].finish_reason is not None:
            finished_at = n
            break
    assert finished_at == k and c.outputs[1].token_ids == ref[: k + 1]
    assert 1 not in sched.seqs and all(s.seq_id != 1 for s in sched.running)
    # Result n+1 carries an extra token for seq 1: ignored, no delta, no second finish.
    plan = sched.schedule()
    assert plan.drop_seq_ids == [1]
    results.append(worker.execute(plan))
    deltas = sched.process_result(results[finished_at + 1])
    assert 1 not in deltas.request_ids
    c.add(deltas)
    sched.check_integrity()
    c.add(sched.process_result(results[-1]))
    drive(sched, worker, c)
    assert c.outputs[1].token_ids == ref[: k + 1]


@pytest.mark.parametrize("plans_ahead", [1, 2, "small"])
def test_length_finish_is_not_overscheduled(plans_ahead):
    """A token in flight that reaches max_tokens is not fed back in another step (the fake
    worker also refuses any step computed past a request's max_tokens)."""
    sched = Scheduler(SchedulerConfig(16, 4, max_model_len=64, overlap=True,
                                      **ahead(plans_ahead)))
    worker = FakeWorker(16, 4)
    sched.add_request(make_request(1, 5, max_tokens=4, ignore_eos=True))
    out = drive(sched, worker).outputs[1]
    assert len(out.token_ids) == 4
    steps_with_seq = [p for p in worker.plans if 1 in p.cached.seq_ids or p.new_seqs]
    assert len(steps_with_seq) == 4  # prefill + 3 decodes, one per generated token


@pytest.mark.parametrize("plans_ahead", [1, 2, "small"])
def test_abort_between_schedule_and_result(plans_ahead):
    """Abort arrives while two (or three) plans are unanswered: nothing is freed twice or
    leaked."""
    sched = Scheduler(SchedulerConfig(16, 4, max_model_len=64, overlap=True,
                                      **ahead(plans_ahead)))
    worker = FakeWorker(16, 4)
    sched.add_request(make_request(1, 6, max_tokens=10, ignore_eos=True))
    sched.add_request(make_request(2, 6, max_tokens=10, ignore_eos=True))

    def hook(s, step):
        if step == 3:
            s.abort([1], FinishReason.ABORT)
            assert s.block_manager.num_free == 16 - len(s.seqs[2].block_table)

    out = drive(sched, worker, hook=hook).outputs
    assert out[1].finish_reason == FinishReason.ABORT and len(out[1].token_ids) < 10
    assert out[2].finish_reason == FinishReason.LENGTH and len(out[2].token_ids) == 10


def small_batch_run(busy_s: float):
    """Three requests under a limit of two sequences, the fake device taking `busy_s` a step
    (the host's chain here takes microseconds)."""
    cfg = SchedulerConfig(64, 4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=80,
                          plans_ahead=2, deep_plan_max_seqs=2)
    sched, worker = Scheduler(cfg), FakeWorker(64, 4)
    worker.busy_s = busy_s
    reqs = [make_request(rid, 6, max_tokens=4 + 30 * rid, ignore_eos=True) for rid in range(3)]
    for r in reqs:
        sched.add_request(r)
    collected = drive(sched, worker)
    for r in reqs:
        assert collected.outputs[r.request_id].token_ids == reference_generate(
            r.prompt_token_ids, r.params, r.eos_token_ids, 80)[0]
    planned_deep = collected.outstanding_at_plan.count(2)
    assert sched.stats().steps_two_ahead == planned_deep  # what operators see
    return worker, collected


def test_second_plan_ahead_only_for_small_decoding_batches():
    """With a limit of two sequences and the host's chain pacing, the third plan in flight is
    made only for steps of at most two decoding entries with nothing waiting; it is made once
    the batch is small, and the outputs equal plain generation."""
    worker, collected = small_batch_run(busy_s=0.0)
    deep = [plan for plan, out in zip(worker.plans, collected.outstanding_at_plan, strict=True)
            if out == 2]
    assert deep, "no step was planned two ahead once the batch was small"
    assert max(collected.outstanding_at_plan) == 2
    for plan in deep:
        assert not plan.new_seqs and len(plan.cached.seq_ids) <= 2
        assert set(plan.cached.num_new) == {1}
    early = [out for plan, out in zip(worker.plans, collected.outstanding_at_plan, strict=True)
             if len(plan.cached.seq_ids) + len(plan.new_seqs) == 3]
    assert early and max(early) < 2  # three running: never two ahead


def test_no_second_plan_ahead_where_the_device_paces():
    """The same run with a device step far longer than the chain: never two ahead."""
    _, collected = small_batch_run(busy_s=1.0)
    assert max(collected.outstanding_at_plan) == 1


def test_may_plan_counts_the_depth_and_the_waiting():
    cfg = SchedulerConfig(64, 4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          plans_ahead=2, deep_plan_max_seqs=4)
    sched = Scheduler(cfg)
    sched.add_request(make_request(1, 6, max_tokens=8))
    assert sched.may_plan(0) and sched.may_plan(1)
    assert not sched.may_plan(2)  # a request waits: its prefill goes in the next slot
    assert not sched.may_plan(3)
    one_ahead = Scheduler(SchedulerConfig(64, 4, max_model_len=64, plans_ahead=1))
    assert one_ahead.may_plan(1) and not one_ahead.may_plan(2)
