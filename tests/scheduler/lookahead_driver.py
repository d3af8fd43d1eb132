"""Drive a Scheduler and a real ModelRunner in one process the way the scheduler loop and a
worker with lookahead interleave them: the scheduler sends plan N+1 before it processes
result N, and the worker launches N+1 before it finishes N (so every step but the first
starts while the previous one is still unsettled).

After each launch it checks that the worker's block table of every sequence the plan
continues is the scheduler's table as it was when the plan was built: both sides cut the
tables reserved for rejected proposals at the same point of the plan stream.
"""

from __future__ import annotations

from collections import deque

from fake_worker import Collector

from scheduler_proc import Scheduler


def _tables(sched: Scheduler, plan) -> dict[int, list[int]]:
    ids = set(plan.cached.seq_ids) | {ns.seq_id for ns in plan.new_seqs}
    return {s.seq_id: list(s.block_table) for s in sched.running if s.seq_id in ids}


def _check_worker_tables(runner, expected: dict[int, list[int]], step: int) -> None:
    table = runner.table
    for sid, blocks in expected.items():
        row = table.rows.get(sid)
        if row is None:  # refused by the worker
            continue
        got = table.block_tables[row, :int(table.num_blocks[row])].tolist()
        assert got == blocks, f"step {step}: seq {sid} worker table {got} != scheduler {blocks}"


def drive_lookahead(sched: Scheduler, runner, collector: Collector | None = None, *,
                    hook=None, max_steps: int = 20_000) -> Collector:
    """Run until nothing is left. `hook(sched, step)` runs after each processed result."""
    collector = collector or Collector()
    collector.add(sched.pop_deltas())
    outstanding = 0  # plans the scheduler sent and has not processed the result of
    launched = None  # the worker's step in flight (launched, not finished)
    results: deque = deque()  # finished, not processed by the scheduler yet
    processed = 0
    for _ in range(max_steps):
        plan = sched.schedule() if sched.may_plan(outstanding) else None
        if plan is not None:
            collector.outstanding_at_plan.append(outstanding)
            outstanding += 1
            expected = _tables(sched, plan)
            step = runner.launch(plan)
            _check_worker_tables(runner, expected, plan.step_id)
            if launched is not None:
                results.append(runner.finish(launched))
            launched = step
            continue
        if results:
            collector.add(sched.process_result(results.popleft()))
            outstanding -= 1
            if hook is not None:
                hook(sched, processed)
            processed += 1
            collector.add(sched.pop_deltas())
            sched.check_integrity()
        elif launched is not None:
            results.append(runner.finish(launched))
            launched = None
        else:
            assert not sched.has_unfinished(), "scheduler stuck with unfinished requests"
            return collector
    raise AssertionError("did not finish within max_steps")
