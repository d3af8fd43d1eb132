"""Prefix-cache hits through the scheduler, and recompute preemption with resumption."""

from __future__ import annotations

import pytest
from fake_worker import Collector, FakeWorker, drive, make_request, reference_generate

from scheduler_proc import Scheduler, SchedulerConfig


def setup(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_model_len", 128)
    cfg = SchedulerConfig(num_blocks, block_size, **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size)


def assert_reference(reqs, outputs, max_model_len=128):
    for r in reqs:
        ref = reference_generate(r.prompt_token_ids, r.params, r.eos_token_ids, max_model_len)
        out = outputs[r.request_id]
        assert (out.token_ids, out.finish_reason) == ref, f"request {r.request_id}"


def new_seqs(worker, seq_id):
    return [ns for p in worker.plans for ns in p.new_seqs if ns.seq_id == seq_id]


def test_prefix_hit_after_first_request_finished():
    sched, worker = setup()
    shared = list(range(1, 11))
    a = make_request(1, shared + [40, 41], max_tokens=3)
    sched.add_request(a)
    drive(sched, worker)
    assert sched.block_manager.num_free == 64
    b = make_request(2, shared + [50], max_tokens=3)
    sched.add_request(b)
    out = drive(sched, worker)
    [ns] = new_seqs(worker, 2)
    assert ns.num_computed == 8 and ns.num_new == 3
    a_table = new_seqs(worker, 1)[0].block_table
    assert ns.block_table[:2] == a_table[:2]
    assert_reference([b], out.outputs)


def test_prefix_hit_while_first_still_running_shares_blocks():
    sched, worker = setup()
    shared = list(range(1, 9))
    sched.add_request(make_request(1, shared + [40], max_tokens=10, ignore_eos=True))
    drive_steps = 2
    for _ in range(drive_steps):
        worker.execute(sched.schedule())
    sched.add_request(make_request(2, shared + [50], max_tokens=2))
    plan = sched.schedule()
    [ns] = plan.new_seqs
    assert ns.num_computed == 8
    bm = sched.block_manager
    assert [bm.ref_counts[b] for b in ns.block_table[:2]] == [2, 2]


def test_same_step_identical_prompts_do_not_hit_each_other():
    """A hit must only read KV written by an earlier plan, not a batch neighbour's."""
    sched, worker = setup()
    for rid in (1, 2):
        sched.add_request(make_request(rid, list(range(1, 14)), max_tokens=2))
    plan = sched.schedule()
    assert [ns.num_computed for ns in plan.new_seqs] == [0, 0]
    worker.execute(plan)


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_fully_covered_by_cache_still_computes_last_token(overlap):
    sched, worker = setup(overlap=overlap)
    prompt = list(range(3, 11))  # exactly two blocks
    a = make_request(1, prompt, max_tokens=4)
    sched.add_request(a)
    first = drive(sched, worker).outputs[1]
    b = make_request(2, prompt, max_tokens=4)
    sched.add_request(b)
    out = drive(sched, worker).outputs[2]
    [ns] = new_seqs(worker, 2)
    # Block 0 hits; block 1 holds the last prompt token, whose logits are needed.
    assert (ns.num_computed, ns.num_new) == (4, 4)
    assert out.token_ids == first.token_ids


def test_prefill_chunks_are_cached_progressively():
    sched, worker = setup(max_num_batched_tokens=8)
    sched.add_request(make_request(1, 30, max_tokens=2))
    for _ in range(3):
        worker.execute(sched.schedule())
    sched.schedule()
    # After three chunks of 8 plus the next plan, 24 tokens (6 blocks) are hashed.
    assert len(sched.block_manager.hash_to_block) == 6


def test_preemption_resends_in_full_and_matches_reference():
    # 6 blocks of 4; two sequences of 4 + 16 tokens cannot both fit: the later one is
    # preempted, re-sent in full, and both end exactly as an unpreempted run.
    sched, worker = setup(num_blocks=6, overlap=False, enable_prefix_caching=False)
    reqs = [make_request(i, 4, max_tokens=16, ignore_eos=True) for i in (1, 2)]
    for r in reqs:
        sched.add_request(r)
    out = drive(sched, worker)
    assert_reference(reqs, out.outputs)
    dropped = [p.drop_seq_ids for p in worker.plans if p.drop_seq_ids]
    assert dropped[0] == [2]
    sends = new_seqs(worker, 2)
    assert len(sends) >= 2
    resumed = sends[1]
    ref, _ = reference_generate(reqs[1].prompt_token_ids, reqs[1].params, [], 128)
    generated = len(resumed.token_ids) - 4
    assert generated >= 1
    assert list(resumed.token_ids) == list(reqs[1].prompt_token_ids) + ref[:generated]
    assert resumed.num_prompt_tokens == 4 and resumed.num_computed == 0


def test_preempted_sequence_goes_to_front_of_waiting():
    sched, worker = setup(num_blocks=6, overlap=False, max_num_seqs=2)
    for i in (1, 2, 3):
        sched.add_request(make_request(i, 4, max_tokens=16, ignore_eos=True))
    while not worker.plans or not worker.plans[-1].drop_seq_ids:
        plan = sched.schedule()
        sched.process_result(worker.execute(plan))
        sched.check_integrity()
    assert worker.plans[-1].drop_seq_ids == [2]
    assert [s.seq_id for s in sched.waiting] == [2, 3]


@pytest.mark.parametrize("overlap", [True, False])
def test_resumed_sequence_gets_prefix_hit_within_its_block_table(overlap):
    sched, worker = setup(num_blocks=8, overlap=overlap)
    reqs = [make_request(i, 9, max_tokens=20, ignore_eos=True) for i in (1, 2)]
    for r in reqs:
        sched.add_request(r)
    out = drive(sched, worker)
    assert_reference(reqs, out.outputs)
    resumed = [ns for p in worker.plans for ns in p.new_seqs][2:]
    assert resumed, "expected a preemption"
    assert any(ns.num_computed > 0 for ns in resumed), "expected a hit on re-admission"
    for ns in resumed:
        assert ns.num_computed % 4 == 0 and ns.num_computed < len(ns.token_ids)
        assert len(ns.block_table) * 4 >= ns.num_computed + ns.num_new


def test_resumed_sequence_crossing_block_boundary_after_reprefill():
    """The token sampled at the end of a re-prefill is appended and decoding continues
    across the next block boundary."""
    sched, worker = setup(num_blocks=7, overlap=False, enable_prefix_caching=False)
    reqs = [make_request(i, 7, max_tokens=20, ignore_eos=True) for i in (1, 2)]
    for r in reqs:
        sched.add_request(r)
    assert_reference(reqs, drive(sched, worker).outputs)


def test_sequence_preempted_with_result_in_flight_receives_its_token():
    sched, worker = setup(num_blocks=6, overlap=True, enable_prefix_caching=False)
    reqs = [make_request(i, 4, max_tokens=16, ignore_eos=True) for i in (1, 2)]
    for r in reqs:
        sched.add_request(r)
    seen = []

    def hook(s, step):
        for seq in s.waiting:
            if seq.num_pending:
                seen.append((seq.seq_id, len(seq.token_ids)))

    out = drive(sched, worker, Collector(), hook=hook)
    assert seen, "expected a preemption while a result was outstanding"
    assert_reference(reqs, out.outputs)
