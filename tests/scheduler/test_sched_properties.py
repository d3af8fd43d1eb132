"""Property test: random adds, steps, aborts and finishes keep every invariant, and every
request that is not aborted ends exactly as the fake model says, overlap off, on, or planning
two steps ahead of the results."""

from __future__ import annotations

from collections import deque

from fake_worker import Collector, FakeWorker, drive, make_request, reference_generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import FinishReason, StepResult
from scheduler_proc import Scheduler, SchedulerConfig

BLOCK = 4
MAX_LEN = 40
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]

add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(SHARED)),  # length of the shared head (prefix-cache hits)
    st.lists(st.integers(0, 63), min_size=0, max_size=14),
    st.integers(1, 20),  # max_tokens
    st.booleans(),  # with EOS ids
    st.sampled_from(["", "a", "b"]),  # client key: fair sharing admits and preempts by it
)
ops = st.lists(
    st.one_of(
        add_op,
        st.tuples(st.just("step"), st.integers(1, 4)),
        # One client adds a burst: contention between clients (fair share's Room and Pool
        # pressure rules preempt across clients).
        st.tuples(st.just("flood"), st.sampled_from(["a", "b"]), st.integers(2, 8)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("stop"), st.integers(0, 30)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    ahead=st.sampled_from([0, 1, 2]),  # steps planned ahead of the results (0: no overlap)
    caching=st.booleans(),
    num_blocks=st.integers(10, 24),
    batched=st.sampled_from([4, 9, 64]),
    max_seqs=st.integers(1, 6),
)
def test_random_operations_keep_invariants(ops, ahead, caching, num_blocks, batched, max_seqs):
    cfg = SchedulerConfig(num_blocks, BLOCK, max_num_seqs=max_seqs,
                          max_num_batched_tokens=batched, max_model_len=MAX_LEN,
                          enable_prefix_caching=caching, overlap=ahead > 0,
                          plans_ahead=max(ahead, 1))
    sched, worker = Scheduler(cfg), FakeWorker(num_blocks, BLOCK)
    c = Collector()
    outstanding: deque[StepResult] = deque()
    reqs = {}
    aborted = set()

    def one_step():
        plan = sched.schedule()
        if plan is not None:
            outstanding.append(worker.execute(plan))
        if outstanding and (len(outstanding) >= cfg.max_plans_in_flight or plan is None):
            c.add(sched.process_result(outstanding.popleft()))

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, head, tail, max_tokens, with_eos, client = op
            rid = len(reqs)
            req = make_request(rid, SHARED[:head] + tail, max_tokens=max_tokens,
                               eos=[1, 2] if with_eos else [], client=client)
            reqs[rid] = req
            sched.add_request(req)
        elif kind == "flood":
            for _ in range(op[2]):
                rid = len(reqs)
                req = reqs[rid] = make_request(rid, 6 + rid % 7, max_tokens=6 + rid % 11,
                                               client=op[1])
                sched.add_request(req)
        elif kind == "step":
            for _ in range(op[1]):
                one_step()
                sched.check_integrity()
        else:
            if op[1] in reqs and op[1] in sched.seqs:
                aborted.add(op[1])
            sched.abort([op[1]], FinishReason.ABORT if kind == "abort" else FinishReason.STOP)
        c.add(sched.pop_deltas())
        sched.check_integrity()

    while outstanding:
        c.add(sched.process_result(outstanding.popleft()))
    drive(sched, worker, c)
    sched.check_integrity()
    assert sched.block_manager.num_free == num_blocks
    assert not sched.has_unfinished() and not sched.has_inflight()
    for rid, req in reqs.items():
        out = c.outputs[rid]
        prompt, params = req.prompt_token_ids, req.params
        if not prompt or len(prompt) + params.max_tokens > MAX_LEN:
            assert out.finish_reason is FinishReason.ERROR and out.error
            continue
        ref_tokens, ref_reason = reference_generate(prompt, params, req.eos_token_ids, MAX_LEN)
        if rid in aborted:
            assert out.finish_reason in (FinishReason.ABORT, FinishReason.STOP)
            assert out.token_ids == ref_tokens[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (ref_tokens, ref_reason)
