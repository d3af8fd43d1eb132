"""Speculation with overlap: plan N+1 goes out before result N says how many proposals N
accepted. The fake worker accepts chosen counts, out of step with the plans; after every
result the pool invariants hold, no block that a plan in flight writes has been taken from its
sequence, and outputs equal the reference (never past a stop, max_tokens or max_model_len)."""

from __future__ import annotations

import random

import pytest
from fake_worker import Collector, Output, make_request, reference_generate
from spec_fake_worker import SpecFakeWorker, drive_spec

from protocol import FinishReason
from scheduler_proc import Scheduler, SchedulerConfig
from scheduler_proc.admission import with_resolved_max_tokens

BS = 4
MAX_LEN = 48


def workload(seed: int, n: int = 16):
    rng = random.Random(seed)
    shared = [rng.randrange(64) for _ in range(12)]
    reqs = []
    for rid in range(n):
        prompt = shared[:rng.choice([0, 4, 9, 12])] + [rng.randrange(64)
                                                       for _ in range(rng.randint(1, 14))]
        max_tokens = rng.choice([None, rng.randint(1, MAX_LEN - len(prompt))])
        reqs.append(make_request(rid, prompt, max_tokens=max_tokens, eos=[1, 2, 3],
                                 ignore_eos=rid % 3 == 0))
    return reqs


def random_accept(seed: int):
    rng = random.Random(seed)
    return lambda step, sid, k: rng.choice([0, k, rng.randint(0, k)])


def run(reqs, *, k: int, num_blocks: int, overlap: bool = True, accept=None, batched=24,
        hook=None):
    cfg = SchedulerConfig(num_blocks, BS, max_num_seqs=8, max_num_batched_tokens=batched,
                          max_model_len=MAX_LEN, overlap=overlap, num_speculative_tokens=k)
    sched = Scheduler(cfg)
    worker = SpecFakeWorker(num_blocks, BS, MAX_LEN, accept or random_accept(num_blocks))
    for r in reqs:
        sched.add_request(r)
    out = drive_spec(sched, worker, Collector(), hook=hook).outputs
    assert sched.block_manager.num_free == num_blocks
    return {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}, sched, worker


def expected(reqs):
    return {r.request_id: reference_generate(
        r.prompt_token_ids, with_resolved_max_tokens(r, MAX_LEN).params, r.eos_token_ids,
        MAX_LEN) for r in reqs}


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("num_blocks", [14, 24, 80])
def test_outputs_exact_and_pool_sound_whatever_is_accepted(k, num_blocks):
    """Prefix hits, chunked prefill (24-token budget) and, with the small pools,
    preemption, while acceptance varies from none to all at random."""
    reqs = workload(k * 100 + num_blocks)
    out, sched, worker = run(reqs, k=k, num_blocks=num_blocks)
    assert out == expected(reqs)
    stats = sched.stats()
    assert stats.spec_accepted_tokens > 0 and stats.cached_prompt_tokens > 0
    if num_blocks == 14:
        assert stats.preemptions > 0
    assert any(p.trim_seq_ids for p in worker.plans)  # rejected proposals' blocks came back
    # Plans really went out before the result before them was known.
    assert sched.config.max_plans_in_flight == 2


def test_plan_sent_before_result_still_continues_with_one_token():
    """Plan N+1 is built while N (4 proposals, all accepted) is unanswered: it still asks for
    n = 1, reserves blocks for the case all four are accepted, and caps its own proposals
    as if they were."""
    sched = Scheduler(SchedulerConfig(32, BS, max_model_len=MAX_LEN, overlap=True,
                                      num_speculative_tokens=4))
    worker = SpecFakeWorker(32, BS, MAX_LEN, lambda step, sid, k: k)
    req = make_request(1, 5, max_tokens=20, ignore_eos=True)
    ref, _ = reference_generate(req.prompt_token_ids, req.params, [], MAX_LEN)
    sched.add_request(req)
    results = [worker.execute(sched.schedule())]  # prefill
    results.append(worker.execute(sched.schedule()))  # decode, 4 proposals
    seq = sched.seqs[1]
    assert seq.spec_inflight == 4
    sched.process_result(results.pop(0))
    plan = sched.schedule()  # built before the result of the 4-proposal step
    assert plan.cached.num_new == [1] and plan.cached.num_spec == [4]
    # Reach: computed 7 (6 known + this n) + 4 in flight + 4 now = 15 tokens.
    assert len(seq.block_table) * BS >= seq.num_computed + seq.spec_inflight == 15
    results.append(worker.execute(plan))
    deltas = sched.process_result(results.pop(0))
    assert deltas.token_ids == [ref[1:6]]  # the bonus token and the 4 accepted proposals
    c = Collector()
    c.outputs[1] = Output(list(ref[:6]))
    c.add(sched.process_result(results.pop(0)))
    sched.check_integrity()
    drive_spec(sched, worker, c, max_steps=100)
    assert c.outputs[1].token_ids == ref


def test_tokens_past_a_stop_or_max_tokens_are_never_streamed():
    """Every proposal accepted, stops and max_tokens land inside accepted runs; plans in
    flight for a finished sequence produce tokens that are dropped."""
    reqs = workload(7, n=12)
    out, _, worker = run(reqs, k=6, num_blocks=80, accept=lambda step, sid, k: k)
    assert out == expected(reqs)
    assert {reason for _, reason in out.values()} >= {FinishReason.STOP, FinishReason.LENGTH}


def test_a_sequence_that_may_end_waits_for_the_result():
    """With proposals in flight that may reach max_tokens, the sequence is left out of the
    next plan rather than computed past its length (the fake worker asserts that)."""
    sched = Scheduler(SchedulerConfig(32, BS, max_model_len=MAX_LEN, overlap=True,
                                      num_speculative_tokens=4))
    worker = SpecFakeWorker(32, BS, MAX_LEN, lambda step, sid, k: k)
    sched.add_request(make_request(1, 5, max_tokens=6, ignore_eos=True))
    sched.add_request(make_request(2, 5, max_tokens=30, ignore_eos=True))  # keeps plans going
    out = drive_spec(sched, worker).outputs[1]
    assert len(out.token_ids) == 6 and out.finish_reason is FinishReason.LENGTH
    # The prefill samples 1 token and the next step verifies 4 proposals: all accepted, that
    # is max_tokens, so the plan sent before that result leaves the sequence out.
    plans = [p for p in worker.plans if 1 in p.cached.seq_ids]
    assert [p.cached.num_spec[p.cached.seq_ids.index(1)] for p in plans] == [4]


@pytest.mark.parametrize("num_blocks", [16, 60])
def test_abort_and_preemption_mid_flight(num_blocks):
    """Aborts of sequences with proposals in flight, on top of preemptions: refcounts stay
    right (checked after every result), everything is freed at the end, and the requests
    that were not aborted are exact."""
    reqs = workload(31 + num_blocks)
    aborted: list[int] = []

    def hook(sched, n):
        if n % 7 == 3:
            victim = next((s for s in sched.running if s.spec_inflight), None)
            if victim is not None:
                sched.abort([victim.seq_id])
                aborted.append(victim.seq_id)

    out, sched, _ = run(reqs, k=3, num_blocks=num_blocks, hook=hook)
    assert aborted
    ref = expected(reqs)
    for rid, (tokens, reason) in out.items():
        if rid in aborted:
            assert reason is FinishReason.ABORT and tokens == ref[rid][0][:len(tokens)]
        else:
            assert (tokens, reason) == ref[rid]


def test_overlap_off_is_unchanged():
    reqs = workload(5)
    on, _, _ = run(reqs, k=3, num_blocks=24)
    off, sched, _ = run(reqs, k=3, num_blocks=24, overlap=False)
    assert on == off == expected(reqs)
    assert sched.config.max_plans_in_flight == 1
