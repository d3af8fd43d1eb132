"""Scheduler planning: plan contents, delta encoding, chunked prefill, stops, errors, aborts."""

from __future__ import annotations

import pytest
from fake_worker import Collector, FakeWorker, drive, make_request, reference_generate

from protocol import (
    AddRequest,
    CachedSequences,
    Decoder,
    ErrorKind,
    FinishReason,
    RequestError,
    StepPlan,
    StepResult,
    encode,
)
from scheduler_proc import Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(num_blocks, block_size, **kw))


def step(sched: Scheduler, worker: FakeWorker):
    """One strictly alternating step; returns (plan, deltas)."""
    plan = sched.schedule()
    deltas = sched.process_result(worker.execute(plan)) if plan is not None else None
    sched.check_integrity()
    return plan, deltas


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(10, 0, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(10, 4, max_num_seqs=True, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(2, 4, max_model_len=16).check_pool_fits_model_len()
    SchedulerConfig(4, 4, max_model_len=16).check_pool_fits_model_len()


def test_a_prompt_goes_to_the_workers_packed_as_it_arrived():
    sched = make_scheduler()
    req = Decoder(AddRequest).decode(encode(make_request(1, 6, max_tokens=5)))
    sched.add_request(req)
    [ns] = sched.schedule().new_seqs
    assert ns.token_ids is req.prompt_token_ids  # neither unpacked nor packed again
    got = Decoder(StepPlan).decode(encode(StepPlan(0, [], [ns], CachedSequences([], [], []))))
    assert got.new_seqs[0].token_ids.tolist() == sched.seqs[1].token_ids


def test_first_plan_sends_sequence_in_full_then_deltas():
    sched, worker = make_scheduler(), FakeWorker(64, 4)
    req = make_request(1, 6, max_tokens=5)
    sched.add_request(req)
    plan, deltas = step(sched, worker)
    assert plan.step_id == 0 and plan.drop_seq_ids == []
    [ns] = plan.new_seqs
    assert (ns.seq_id, ns.token_ids, ns.num_prompt_tokens) == (1, req.prompt_token_ids, 6)
    assert (ns.num_computed, ns.num_new, list(ns.block_table)) == (0, 6, [0, 1])
    assert plan.cached.seq_ids == []
    assert deltas.request_ids == [1] and len(deltas.token_ids[0]) == 1
    sizes = []
    for i in range(3):
        plan, deltas = step(sched, worker)
        assert plan.new_seqs == []
        assert plan.cached.seq_ids == [1] and plan.cached.num_new == [1]
        # Tokens 7 and 8 fill block 1; token 9 (step index 2) starts block 2.
        assert plan.cached.new_block_ids == ([[2]] if i == 2 else [[]])
        sizes.append(len(encode(plan)))
    assert sizes[0] == sizes[1]  # a decode entry costs constant bytes
    _, deltas = step(sched, worker)
    assert deltas.finish_reasons == [FinishReason.LENGTH]
    assert not sched.has_unfinished() and sched.block_manager.num_free == 64


def test_long_prompt_prefilled_in_chunks_then_mixed_with_decode():
    sched = make_scheduler(max_num_batched_tokens=10)
    worker = FakeWorker(64, 4)
    sched.add_request(make_request(1, 3, max_tokens=20))
    plan, _ = step(sched, worker)
    assert [ns.num_new for ns in plan.new_seqs] == [3]
    sched.add_request(make_request(2, 25, max_tokens=2))
    plan, _ = step(sched, worker)
    # Seq 1 decodes one token; seq 2 gets the remaining budget as its first chunk.
    assert plan.cached.seq_ids == [1] and plan.cached.num_new == [1]
    [ns] = plan.new_seqs
    assert (ns.num_computed, ns.num_new, len(ns.block_table)) == (0, 9, 3)
    plan, deltas = step(sched, worker)
    assert plan.cached.seq_ids == [1, 2] and plan.cached.num_new == [1, 9]
    assert deltas.request_ids == [1]  # seq 2 has not reached its last prompt token yet
    plan, deltas = step(sched, worker)
    assert plan.cached.num_new == [1, 7]
    assert deltas.request_ids == [1, 2]
    out = drive(sched, worker)
    assert out.outputs[2].finish_reason == FinishReason.LENGTH


def test_max_num_seqs_limits_running():
    sched, worker = make_scheduler(max_num_seqs=2), FakeWorker(64, 4)
    for i in range(3):
        sched.add_request(make_request(i, 4, max_tokens=3))
    plan, _ = step(sched, worker)
    assert [ns.seq_id for ns in plan.new_seqs] == [0, 1]
    assert len(sched.waiting) == 1
    drive(sched, worker)


def test_no_max_tokens_runs_to_max_model_len():
    sched, worker = make_scheduler(max_model_len=12), FakeWorker(64, 4)
    sched.add_request(make_request(1, 4, max_tokens=None, ignore_eos=True))
    out = drive(sched, worker).outputs[1]
    assert len(out.token_ids) == 8 and out.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_conditions(overlap):
    prompt = [5, 6, 7]
    ref, _ = reference_generate(prompt, make_request(0, prompt, max_tokens=30).params, [], 128)
    eos = ref[3]
    first = ref.index(eos)
    cases = {
        1: dict(eos=[eos]),
        2: dict(eos=[eos], ignore_eos=True),
        3: dict(stop_token_ids=[eos]),
        4: dict(stop_token_ids=[eos], ignore_eos=True),
    }
    sched, worker = make_scheduler(overlap=overlap), FakeWorker(64, 4)
    for rid, kw in cases.items():
        sched.add_request(make_request(rid, prompt, max_tokens=30, **kw))
    out = drive(sched, worker).outputs
    assert out[1].token_ids == ref[: first + 1] and out[1].finish_reason == FinishReason.STOP
    assert out[2].token_ids == ref[:30] and out[2].finish_reason == FinishReason.LENGTH
    assert out[3].finish_reason == FinishReason.STOP and out[4].finish_reason == FinishReason.STOP


def test_max_model_len_stop_is_length():
    sched, worker = make_scheduler(max_model_len=12), FakeWorker(64, 4)
    sched.add_request(make_request(1, 4, max_tokens=8, ignore_eos=True))
    out = drive(sched, worker).outputs[1]
    assert len(out.token_ids) == 8 and out.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message", "field"),
    [
        (0, 4, "empty", "prompt"),
        (100, 29, "exceed max_model_len", "params.max_tokens"),
        (128, None, "max_model_len is 128", "prompt"),
        (40, 30, "whole pool", "params.max_tokens"),  # fits max_model_len, not the pool
    ],
)
def test_requests_that_can_never_fit_fail_at_admission(prompt, max_tokens, message, field):
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16, 4)
    sched.add_request(make_request(9, prompt, max_tokens=max_tokens))
    sched.add_request(make_request(1, 4, max_tokens=3))
    out = drive(sched, worker).outputs
    assert out[9].finish_reason == FinishReason.ERROR and message in out[9].error.message
    assert out[9].error.kind is ErrorKind.INVALID_REQUEST and out[9].error.field == field
    assert out[9].token_ids == []
    assert out[1].finish_reason == FinishReason.LENGTH and len(out[1].token_ids) == 3


def test_request_exactly_filling_pool_runs():
    # 16 blocks of 4 = 64 KV slots; 40 + 25 tokens writes KV for 64 positions.
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16, 4)
    sched.add_request(make_request(1, 40, max_tokens=25, ignore_eos=True))
    out = drive(sched, worker).outputs[1]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 25


def test_duplicate_request_id_is_an_error():
    sched = make_scheduler()
    sched.add_request(make_request(1))
    sched.add_request(make_request(1))
    deltas = sched.pop_deltas()
    assert deltas.finish_reasons == [FinishReason.ERROR]
    assert "already in use" in deltas.errors[0].message
    assert len(sched.waiting) == 1


def test_abort_waiting_and_running_free_every_block():
    sched, worker = make_scheduler(num_blocks=16), FakeWorker(16, 4)
    for i in range(3):
        sched.add_request(make_request(i, 10, max_tokens=20))
    sched.add_request(make_request(3, 10, max_tokens=20))
    step(sched, worker)
    step(sched, worker)
    assert len(sched.running) == 4 - len(sched.waiting)
    sched.abort([0, 3, 77], FinishReason.ABORT)
    sched.abort([1], FinishReason.STOP)
    deltas = sched.pop_deltas()
    assert deltas.request_ids == [0, 3, 1]
    assert deltas.finish_reasons == [FinishReason.ABORT, FinishReason.ABORT, FinishReason.STOP]
    sched.check_integrity()
    plan, _ = step(sched, worker)
    assert sorted(plan.drop_seq_ids) == sorted(
        i for i in (0, 1, 3) if i in {ns.seq_id for p in worker.plans[:2] for ns in p.new_seqs}
    )
    sched.abort([2], FinishReason.ABORT)
    sched.check_integrity()
    assert sched.block_manager.num_free == 16 and not sched.has_unfinished()


def test_abort_racing_inflight_step():
    """Aborted while its step is in flight: blocks free at once, its token is ignored."""
    sched, worker = make_scheduler(num_blocks=16, max_num_batched_tokens=8), FakeWorker(16, 4)
    sched.add_request(make_request(1, 12, max_tokens=20))
    plan0 = sched.schedule()  # first chunk of the prompt
    res0 = worker.execute(plan0)
    plan1 = sched.schedule()  # last chunk: samples
    res1 = worker.execute(plan1)
    sched.abort([1], FinishReason.ABORT)
    assert sched.block_manager.num_free == 16
    sched.check_integrity()
    c = Collector()
    c.add(sched.pop_deltas())
    c.add(sched.process_result(res0))
    c.add(sched.process_result(res1))
    assert c.outputs[1].token_ids == [] and c.outputs[1].finish_reason == FinishReason.ABORT
    plan2 = sched.schedule()
    assert plan2 is None  # the drop waits for the next plan
    sched.add_request(make_request(2, 9, max_tokens=2))
    plan2 = sched.schedule()
    assert plan2.drop_seq_ids == [1]
    worker.execute(plan2)
    assert 1 not in worker.mirrors


def test_results_must_match_plans():
    sched = make_scheduler()
    sched.add_request(make_request(1, 4))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="expected step 0"):
        sched.process_result(StepResult(5, [1], [3], None))
    with pytest.raises(ValueError, match="sampled entries"):
        sched.process_result(StepResult(plan.step_id, [], [], None))


def test_logprobs_pass_through():
    sched = make_scheduler()
    sched.add_request(make_request(1, 4))
    plan = sched.schedule()
    deltas = sched.process_result(StepResult(plan.step_id, [1], [3], [-0.5]))
    assert deltas.logprobs == [[-0.5]]


def test_a_result_rows_skip_the_finished_and_keep_logprobs_and_alternatives_aligned():
    sched = make_scheduler()
    for rid in (1, 2, 3):
        sched.add_request(make_request(rid, 4, stop_token_ids=[42]))
    plan = sched.schedule()
    sched.abort([2])  # while its first token is being sampled: that token is dropped
    deltas = sched.process_result(StepResult(
        plan.step_id, [1, 2, 3], [7, 8, 42], [-0.1, -0.2, -0.3],
        [[7, 5], [8, 6], [42, 4]], [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]]))
    assert deltas.request_ids == [2, 1, 3]  # the abort's own row, then the step's
    assert deltas.token_ids == [[], [7], [42]]
    assert deltas.finish_reasons == [FinishReason.ABORT, None, FinishReason.STOP]
    assert deltas.errors == [None, None, None]
    assert deltas.logprobs == [[], [-0.1], [-0.3]]
    assert deltas.top_token_ids == [[], [[7, 5]], [[42, 4]]]
    assert deltas.top_logprobs == [[], [[-0.1, -2.0]], [[-0.3, -4.0]]]
    assert deltas.metrics_ids == [2, 3] and sorted(sched.seqs) == [1]


def test_fail_all_reports_engine_dead():
    sched, worker = make_scheduler(), FakeWorker(64, 4)
    for i in range(3):
        sched.add_request(make_request(i, 6))
    step(sched, worker)
    sched.schedule()
    dead = RequestError(ErrorKind.ENGINE_DEAD, "engine dead: worker 0 exited")
    deltas = sched.fail_all(dead)
    assert sorted(deltas.request_ids) == [0, 1, 2]
    assert set(deltas.finish_reasons) == {FinishReason.ERROR} and deltas.errors == [dead] * 3
    assert not sched.has_unfinished() and not sched.has_inflight()
    assert sched.block_manager.num_free == 64
