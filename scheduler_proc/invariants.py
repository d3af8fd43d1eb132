"""The scheduler's invariants, checked when idle and by the property tests."""

from __future__ import annotations

from scheduler_proc.state import RUNNING, WAITING, SchedulerState


def check_integrity(state: SchedulerState) -> None:
    """Raise AssertionError if any scheduler or block-pool invariant is broken."""
    handing = [] if state.handoffs is None else list(state.handoffs.seqs.values())
    state.block_manager.check_integrity(s.block_table for s in state.running + handing)
    pending: dict[int, int] = {}
    proposals: dict[int, int] = {}
    for plan in state.inflight:
        for s in plan.seqs:
            pending[id(s)] = pending.get(id(s), 0) + 1
        for s, k in zip(plan.seqs, plan.num_spec):  # num_spec is empty or aligned
            proposals[id(s)] = proposals.get(id(s), 0) + k
    problems = []
    for s in state.waiting:
        if s.status is not WAITING or s.block_table or s.on_worker:
            problems.append(f"waiting {s!r} holds blocks, is mirrored, or is not WAITING")
    for s in state.running:
        if s.status is not RUNNING or not s.on_worker:
            problems.append(f"running {s!r} is not RUNNING or not mirrored")
        if s.num_computed + s.spec_inflight > len(s.block_table) * state.config.block_size:
            problems.append(f"{s!r} computes past its block table")
    live = {s.seq_id for s in state.waiting} | {s.seq_id for s in state.running}
    if live != set(state.seqs) or len(state.waiting) + len(state.running) != len(state.seqs):
        problems.append("waiting + running != unfinished sequences")
    for s in state.seqs.values():
        if s.num_pending != pending.get(id(s), 0):
            problems.append(f"{s!r} pending != tokens in flight")
        if s.spec_inflight != proposals.get(id(s), 0):
            problems.append(f"{s!r} spec_inflight != proposals in flight")
    runs: dict[str, int] = {}
    for s in state.running:
        runs[s.client.key] = runs.get(s.client.key, 0) + 1
    clients = state.waiting.clients
    if {k: c.running for k, c in clients.items() if c.running} != runs:
        problems.append("a client's running count is not what runs")
    if {s.client.key for s in state.seqs.values()} != set(clients) or any(
            clients[s.client.key] is not s.client for s in state.seqs.values()):
        problems.append("the clients known are not those of the unfinished sequences")
    tier = state.kv_tier
    if tier is not None:
        for sid in tier.swapped:
            if sid not in state.seqs or state.seqs[sid].status is not WAITING:
                problems.append(f"sequence {sid} holds a swap but is not waiting")
    if problems:
        raise AssertionError("; ".join(problems))
