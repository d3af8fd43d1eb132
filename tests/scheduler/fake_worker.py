"""A deterministic stand-in for the GPU workers, and loops that drive a Scheduler with it.

FakeWorker mirrors sequences from StepPlans exactly as a real worker must (drop, then new,
then cached; it advances num_computed itself and appends the tokens it samples), so the
tests prove the delta encoding carries enough information. Its "KV cache" stores, per slot,
an identity of the whole prefix ending at that position; every step it checks that the
context it reads was written for exactly that prefix, which catches a wrong prefix-cache
hit, a block reused too early, or a block table that is too short.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

import xxhash

from protocol import (
    AddRequest,
    FinishReason,
    RequestError,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from scheduler_proc import Scheduler

VOCAB = 64


def fake_next_token(token_ids: list[int], vocab: int = VOCAB) -> int:
    """The fake model: next token = hash of the last three tokens, mod vocab."""
    return xxhash.xxh32_intdigest(array("q", token_ids[-3:]).tobytes()) % vocab


def reference_generate(
    prompt: list[int], params: SamplingParams, eos: list[int], max_model_len: int
) -> tuple[list[int], str]:
    """What an ideal engine returns for one request under the fake model."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        tok = fake_next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if (tok in eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, FinishReason.LENGTH


def _prefix_id(parent: int, token: int) -> int:
    return xxhash.xxh3_64_intdigest(array("Q", (parent, token)).tobytes())


@dataclass
class Mirror:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int]
    params: SamplingParams
    prefix_ids: list[int] = field(default_factory=list)

    def prefix_id(self, pos: int) -> int:
        ids = self.prefix_ids
        while len(ids) <= pos:
            p = len(ids)
            ids.append(_prefix_id(ids[-1] if ids else 0, self.token_ids[p]))
        return ids[pos]


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, poison_dropped: bool = False) -> None:
        self.block_size = block_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.host: dict[int, list[int | None]] = {}
        """The host tier: slot -> a block's KV, as the plans' moves copy it."""
        self.poison_dropped = poison_dropped
        """Wipe a dropped sequence's blocks (only sound when no block is shared, i.e. with
        prefix caching off): KV it needs again must then come back through the moves."""
        self.mirrors: dict[int, Mirror] = {}
        self.next_step = 0
        self.plans: list[StepPlan] = []
        self.busy_s = 0.0
        """The device time each result reports (0: the host's chain paces every step)."""

    def _slot(self, m: Mirror, pos: int) -> int:
        return m.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _begin(self, plan: StepPlan) -> None:
        """What every step does first: check the order, keep the plan, apply its drops."""
        assert plan.step_id == self.next_step, "plans must arrive in order"
        self.next_step += 1
        self.plans.append(plan)
        # The plan's host-tier copies, stores then loads, as a real rank runs them before its
        # forward; a dropped sequence's blocks are dead once this plan's stores have read them.
        # A slot is written at most once per plan; it may be read by several loads, and a load
        # may read what the same plan stored (a block evicted and wanted again at once).
        m, bs = plan.moves, self.block_size
        stored = set(m.store_host_slots)
        assert len(stored) == len(m.store_host_slots), f"plan {plan.step_id}: a slot stored twice"
        for b, slot in zip(m.store_device_blocks, m.store_host_slots, strict=True):
            self.host[slot] = self.kv[b * bs : (b + 1) * bs]
        for sid in plan.drop_seq_ids:
            assert sid in self.mirrors, f"drop of unknown sequence {sid}"
            mirror = self.mirrors.pop(sid)
            if self.poison_dropped:
                for b in mirror.block_table:
                    self.kv[b * bs : (b + 1) * bs] = [-1] * bs
        for slot, b in zip(m.load_host_slots, m.load_device_blocks, strict=True):
            self.kv[b * bs : (b + 1) * bs] = self.host[slot]

    def execute(self, plan: StepPlan) -> StepResult:
        self._begin(plan)
        entries: list[tuple[int, Mirror, int]] = []
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.mirrors, f"sequence {ns.seq_id} sent in full twice"
            m = Mirror(list(ns.token_ids), ns.num_prompt_tokens, ns.num_computed,
                       list(ns.block_table), ns.params)
            self.mirrors[ns.seq_id] = m
            entries.append((ns.seq_id, m, ns.num_new))
        c = plan.cached
        assert len(c.seq_ids) == len(c.num_new) == len(c.new_block_ids)
        for sid, n, blocks in zip(c.seq_ids, c.num_new, c.new_block_ids, strict=True):
            m = self.mirrors[sid]
            m.block_table.extend(blocks)
            entries.append((sid, m, n))
        assert len({sid for sid, _, _ in entries}) == len(entries), "a sequence twice in a step"
        # Read every context before anything of this step is written: a sequence must not
        # depend on KV that a neighbour in the same batch writes.
        for sid, m, n in entries:
            start = m.num_computed
            assert n >= 1 and start + n <= len(m.token_ids), f"seq {sid}: unknown tokens"
            assert start + n <= len(m.block_table) * self.block_size, f"seq {sid}: table short"
            for pos in range(start):
                assert self.kv[self._slot(m, pos)] == m.prefix_id(pos), (
                    f"seq {sid}: stale KV at position {pos}"
                )
        for sid, m, n in entries:
            for pos in range(m.num_computed, m.num_computed + n):
                self.kv[self._slot(m, pos)] = m.prefix_id(pos)
            m.num_computed += n
            # A token sampled at the length the request asked for ends it: computing it would
            # run past what the sequence was admitted for (the overlap hazard).
            limit = m.params.max_tokens
            assert limit is None or m.num_computed < m.num_prompt_tokens + limit, (
                f"seq {sid}: computed {m.num_computed} tokens, past its max_tokens")
        ids, toks = [], []
        for sid, m, _ in entries:
            if m.num_computed == len(m.token_ids):
                tok = fake_next_token(m.token_ids)
                m.token_ids.append(tok)
                ids.append(sid)
                toks.append(tok)
        return StepResult(plan.step_id, ids, toks, None, gpu_busy_s=self.busy_s)


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: RequestError | None = None


class Collector:
    """Accumulates TokenDeltas per request, refusing anything after a request finished."""

    def __init__(self) -> None:
        self.outputs: dict[int, Output] = {}
        self.outstanding_at_plan: list[int] = []
        """For each plan made, the plans whose results were still unprocessed then."""

    def add(self, deltas: TokenDeltas | None) -> None:
        if deltas is None:
            return
        for rid, toks, reason, err in zip(deltas.request_ids, deltas.token_ids,
                                          deltas.finish_reasons, deltas.errors, strict=True):
            out = self.outputs.setdefault(rid, Output())
            assert out.finish_reason is None, f"request {rid} got a delta after finishing"
            out.token_ids.extend(toks)
            out.finish_reason = reason
            out.error = err


def drive(
    sched: Scheduler,
    worker: FakeWorker,
    collector: Collector | None = None,
    *,
    overlap: bool | None = None,
    max_steps: int = 100_000,
    check: bool = True,
    hook=None,
) -> Collector:
    """Run until nothing is left, the way the process loop does (overlap: plans N+1 and, with
    plans_ahead=2, N+2 are sent before result N is processed). `hook(sched, step)` runs while
    a result is outstanding."""
    overlap = sched.config.overlap if overlap is None else overlap
    depth = sched.config.max_plans_in_flight if overlap else 1
    collector = collector or Collector()
    collector.add(sched.pop_deltas())
    outstanding: deque[StepResult] = deque()
    for step in range(max_steps):
        plan = sched.schedule() if not overlap or sched.may_plan(len(outstanding)) else None
        if plan is not None:
            collector.outstanding_at_plan.append(len(outstanding))
            outstanding.append(worker.execute(plan))
        if hook is not None:
            hook(sched, step)
            collector.add(sched.pop_deltas())
        idle = plan is None and not outstanding
        if outstanding and (len(outstanding) >= depth or plan is None):
            collector.add(sched.process_result(outstanding.popleft()))
        collector.add(sched.pop_deltas())
        if check:
            sched.check_integrity()
        if idle:
            assert not sched.has_unfinished(), "scheduler stuck with unfinished requests"
            return collector
    raise AssertionError("did not finish within max_steps")


def make_request(
    request_id: int,
    prompt: list[int] | int = 8,
    *,
    max_tokens: int | None = 8,
    eos: list[int] | None = None,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    client: str = "",
) -> AddRequest:
    """A request (of client key `client`); an int prompt means that many tokens derived from
    the request id."""
    if isinstance(prompt, int):
        prompt = [(request_id * 7 + i) % VOCAB for i in range(prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_token_ids or [])
    return AddRequest(request_id, list(prompt), params, eos if eos is not None else [],
                      client_key=client)
