"""A FakeWorker that verifies proposals, and a loop that drives a speculating Scheduler with it.

The fake has no real proposals: `accept(step_id, seq_id, k)` says how many of an entry's k
proposals were right, and the entry then produces that many true tokens plus one (so outputs
still equal `reference_generate`). Like a real worker it writes KV at every verified position
(rejected ones get junk, which a later read would catch), advances its own computed count by
n + accepted, and cuts block tables only where a plan says so (StepPlan.trim_seq_ids).

It records which blocks each step wrote for which sequence, so the loop can check, after
every result the scheduler processes, that no block a plan still in flight writes for a
running sequence has been taken from that sequence's table.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fake_worker import Collector, FakeWorker, Mirror, fake_next_token

from protocol import StepPlan, StepResult
from scheduler_proc import Scheduler

Accept = Callable[[int, int, int], int]


class SpecFakeWorker(FakeWorker):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 accept: Accept) -> None:
        super().__init__(num_blocks, block_size)
        self.max_model_len = max_model_len
        self.accept = accept
        self.writes: dict[int, list[tuple[int, int]]] = {}
        """Per step id: (seq id, block) for every block the step wrote."""

    def execute(self, plan: StepPlan) -> StepResult:
        self._begin(plan)
        for sid, keep in zip(plan.trim_seq_ids, plan.trim_num_blocks, strict=True):
            m = self.mirrors[sid]
            assert keep <= len(m.block_table), f"seq {sid}: trim grows the table"
            assert keep * self.block_size >= m.num_computed, f"seq {sid}: trim cuts its KV"
            del m.block_table[keep:]
        entries: list[tuple[int, Mirror, int, int]] = []
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.mirrors, f"sequence {ns.seq_id} sent in full twice"
            m = Mirror(list(ns.token_ids), ns.num_prompt_tokens, ns.num_computed,
                       list(ns.block_table), ns.params)
            self.mirrors[ns.seq_id] = m
            entries.append((ns.seq_id, m, ns.num_new, 0))
        c = plan.cached
        spec = c.num_spec or [0] * len(c.seq_ids)
        for sid, n, blocks, k in zip(c.seq_ids, c.num_new, c.new_block_ids, spec, strict=True):
            m = self.mirrors[sid]
            m.block_table.extend(blocks)
            entries.append((sid, m, n, k))
        for sid, m, n, k in entries:
            start = m.num_computed
            assert n >= 1 and start + n <= len(m.token_ids), f"seq {sid}: unknown tokens"
            assert k == 0 or start + n == len(m.token_ids), f"seq {sid}: a chunk speculates"
            end = start + n + k
            assert end <= len(m.block_table) * self.block_size, f"seq {sid}: table short"
            # Never computed past the length it was admitted for (nor past max_model_len).
            limit = min(self.max_model_len, m.num_prompt_tokens + m.params.max_tokens)
            assert end < limit, f"seq {sid}: step {plan.step_id} computes to {end} >= {limit}"
            for pos in range(start):
                assert self.kv[self._slot(m, pos)] == m.prefix_id(pos), (
                    f"seq {sid}: stale KV at position {pos}")
        ids, toks, counts, proposed = [], [], [], []
        written: list[tuple[int, int]] = []
        for sid, m, n, k in entries:
            start = m.num_computed
            for pos in range(start, start + n):
                self.kv[self._slot(m, pos)] = m.prefix_id(pos)
            m.num_computed += n
            written += [(sid, b) for b in {m.block_table[p // self.block_size]
                                           for p in range(start, start + n + k)}]
            if m.num_computed < len(m.token_ids):
                continue
            a = self.accept(plan.step_id, sid, k) if k else 0
            assert 0 <= a <= k
            new = []
            for _ in range(1 + a):
                new.append(fake_next_token(m.token_ids))
                m.token_ids.append(new[-1])
            length = len(m.token_ids) - 1 - a  # the first proposal's position
            for pos in range(length, length + k):  # accepted: true KV; rejected: junk
                self.kv[self._slot(m, pos)] = m.prefix_id(pos) if pos < length + a else -1
            m.num_computed += a
            ids.append(sid)
            toks += new
            counts.append(1 + a)
            proposed.append(k)
        self.writes[plan.step_id] = written
        if not any(spec):
            assert all(x == 1 for x in counts)
            return StepResult(plan.step_id, ids, toks, None)
        return StepResult(plan.step_id, ids, toks, None, num_tokens=counts,
                          num_proposed=proposed)


def check_inflight_writes(sched: Scheduler, worker: SpecFakeWorker) -> None:
    """Every block that a plan in flight wrote for a running sequence is still in its table."""
    running = {s.seq_id: s for s in sched.running}
    for plan in sched.state.inflight:
        for sid, block in worker.writes[plan.step_id]:
            seq = running.get(sid)
            assert seq is None or block in seq.block_table, (
                f"block {block} freed from seq {sid} while step {plan.step_id} writes it")


def drive_spec(sched: Scheduler, worker: SpecFakeWorker, collector: Collector | None = None,
               *, hook=None, max_steps: int = 20_000) -> Collector:
    """The process loop's order: plans go out while fewer than max_plans_in_flight are
    unanswered; each result is processed, then integrity and in-flight writes are checked.
    `hook(sched, n)` runs after the n-th result."""
    collector = collector or Collector()
    collector.add(sched.pop_deltas())
    results: deque[StepResult] = deque()
    for n in range(max_steps):
        while len(results) < sched.config.max_plans_in_flight:
            plan = sched.schedule()
            if plan is None:
                break
            results.append(worker.execute(plan))
        if not results:
            assert not sched.has_unfinished(), "scheduler stuck with unfinished requests"
            return collector
        collector.add(sched.process_result(results.popleft()))
        if hook is not None:
            hook(sched, n)
        collector.add(sched.pop_deltas())
        sched.check_integrity()
        check_inflight_writes(sched, worker)
    raise AssertionError("did not finish within max_steps")
