"""The prefill/decode hand-off state machine, without processes: a prefill and a decode
Scheduler, each with a FakeWorker, the messages between them passed by hand and the KV
transfer done by copying the fake KV of the exported blocks into the accepted ones.

The fake decode worker checks every context it reads against the prefix it must hold, so a
wrong block id, a transfer that lands in the wrong place or too late, or a block reused while
in flight fails the run."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from fake_worker import FakeWorker, make_request, reference_generate

from protocol import FinishReason, SamplingParams
from protocol.kv_handoff import HandoffAccept, HandoffPeerDown, KVCancel, KVExport, KVLanded
from scheduler_proc import Scheduler
from scheduler_proc.config import SchedulerConfig

BS = 4
MAX_LEN = 96


def config(role: str, replica: int, **kw) -> SchedulerConfig:
    settings = dict(num_kv_blocks=64, block_size=BS, max_model_len=MAX_LEN,
                    max_num_batched_tokens=24, role=role, replica=replica)
    settings.update(kw)
    return SchedulerConfig(**settings)


class Pair:
    """Prefill replica 0 and decode replica 1, driven step by step."""

    def __init__(self, overlap: bool = True, prefill: dict | None = None,
                 decode: dict | None = None) -> None:
        self.p = Scheduler(config("prefill", 0, overlap=overlap, **(prefill or {})))
        self.d = Scheduler(config("decode", 1, overlap=overlap, **(decode or {})))
        self.wp = FakeWorker(self.p.config.num_kv_blocks, BS)
        self.wd = FakeWorker(self.d.config.num_kv_blocks, BS)
        self.results = {id(self.p): deque(), id(self.d): deque()}
        self.transfers: deque[tuple[int, list, list[int]]] = deque()
        self.deliver = True
        self.outputs: dict[int, dict] = {}
        self.cancelled: list[int] = []
        self.seen_offers_waiting = False
        self.placed: list[int] = []
        self.down: Scheduler | None = None
        """A replica that died: not driven, and what is sent to it is lost."""

    def add(self, req) -> None:
        self.placed.append(req.request_id)
        self.p.add_request(dataclasses.replace(req, decode_replica=1))

    def kill(self, sched: Scheduler):
        """`sched`'s replica dies: the router tells the other one which requests they
        shared (every one placed so far)."""
        self.down = sched
        self.results[id(sched)].clear()
        other, dead = (self.d, 0) if sched is self.p else (self.p, 1)
        other.on_handoff(HandoffPeerDown(dead, "killed", sorted(self.placed)))
        deltas = other.pop_deltas()
        self._collect(deltas)
        return deltas

    def _collect(self, deltas) -> None:
        if deltas is None:
            return
        for rid, toks, reason, err in zip(deltas.request_ids, deltas.token_ids,
                                          deltas.finish_reasons, deltas.errors, strict=True):
            out = self.outputs.setdefault(rid, {"tokens": [], "reason": None, "error": None})
            if out["reason"] is not None:  # a second end (both replicas saw an abort)
                assert not toks, f"request {rid}: tokens after its end"
                continue
            out["tokens"] += toks
            out["reason"], out["error"] = reason, err

    def _step(self, sched: Scheduler, worker: FakeWorker) -> bool:
        if sched is self.down:
            return False
        q = self.results[id(sched)]
        depth = sched.config.max_plans_in_flight
        plan = sched.schedule() if sched.may_plan(len(q)) else None
        if plan is not None:
            q.append(worker.execute(plan))
        if q and (len(q) >= depth or plan is None):
            self._collect(sched.process_result(q.popleft()))
        self._collect(sched.pop_deltas())
        return plan is not None or bool(q)

    def _route(self) -> bool:
        moved = False
        for src, dst in ((self.p, self.d), (self.d, self.p)):
            if src is self.down:
                continue
            h = src.handoffs
            h.tick()
            out, h.peer_out = h.peer_out, []
            for _, msg in out:
                if dst is not self.down:
                    dst.on_handoff(msg)
                moved = True
            for msg in h.worker_out:
                if isinstance(msg, KVExport):  # the gather: reads the prefill pool now
                    data = [self.wp.kv[b * BS:(b + 1) * BS] for b in msg.block_ids]
                    self.transfers.append((msg.request_id, data, msg.dest_block_ids))
                elif isinstance(msg, KVCancel):
                    self.cancelled += msg.request_ids
                    self.transfers = deque(t for t in self.transfers
                                           if t[0] not in msg.request_ids)
            moved |= bool(h.worker_out)
            h.worker_out.clear()
            self._collect(src.pop_deltas())
            if dst is not self.down:
                self._collect(dst.pop_deltas())
        self.seen_offers_waiting |= bool(self.d.handoffs.offers)
        return moved

    def _land(self) -> bool:
        if not self.deliver or not self.transfers or self.d is self.down:
            return False
        rid, data, dest = self.transfers.popleft()
        for block, values in zip(dest, data, strict=True):
            self.wd.kv[block * BS:(block + 1) * BS] = values
        self.d.on_handoff(KVLanded(rid, 0, len(dest) * 100))
        return True

    def run(self, until=None, max_rounds: int = 20_000) -> None:
        for _ in range(max_rounds):
            for action in (lambda: self._step(self.p, self.wp), self._route,
                           lambda: self._step(self.d, self.wd), self._route, self._land):
                busy = action()
                if until is not None and until():
                    return
            live = [s for s in (self.p, self.d) if s is not self.down]
            for sched in live:
                sched.check_integrity()
            if until is None and not busy and not any(s.has_unfinished() for s in live) \
                    and (not self.transfers or self.d is self.down):
                if not any(self.results.values()):
                    return
        raise AssertionError("the pair did not finish")

    def assert_all_free(self) -> None:
        for sched in (s for s in (self.p, self.d) if s is not self.down):
            bm = sched.block_manager
            assert bm.num_free == bm.num_blocks, sched.config.role
            assert not sched.seqs and not sched.handoffs.waiting


def requests() -> list:
    shared = [(3 * i) % 60 + 1 for i in range(16)]
    reqs = [make_request(i, 5 + 7 * i, max_tokens=6 + i % 3, eos=[63]) for i in range(6)]
    reqs += [make_request(10 + i, shared + [i + 1, 2], max_tokens=5) for i in range(3)]
    reqs.append(make_request(20, 9, max_tokens=1))  # ended by its first token: never handed off
    return reqs


def expected(req) -> tuple[list[int], FinishReason]:
    return reference_generate(list(req.prompt_token_ids), req.params, req.eos_token_ids, MAX_LEN)


@pytest.mark.parametrize("overlap", [True, False])
def test_tokens_are_those_of_one_engine(overlap):
    pair = Pair(overlap)
    reqs = requests()
    for req in reqs:
        pair.add(req)
    pair.run()
    for req in reqs:
        out = pair.outputs[req.request_id]
        assert (out["tokens"], out["reason"]) == expected(req), req.request_id
    c_out, c_in = pair.p.handoffs.counters, pair.d.handoffs.counters
    assert c_out.handoffs_out == c_in.handoffs_in == len(reqs) - 1
    assert c_out.blocks_out == c_in.blocks_in and c_out.bytes_out == c_in.bytes_in > 0
    assert pair.p.stats().cached_prompt_tokens > 0  # the shared prefix hit on the prefill side
    pair.assert_all_free()


def test_offers_wait_for_room_on_the_decode_replica():
    pair = Pair(decode={"num_kv_blocks": 24})  # MAX_LEN fits, a few sequences at once
    reqs = [make_request(i, 40, max_tokens=40, ignore_eos=True) for i in range(6)]
    for req in reqs:
        pair.add(req)
    pair.run()
    assert pair.seen_offers_waiting
    for req in reqs:
        assert pair.outputs[req.request_id]["tokens"] == expected(req)[0]
    pair.assert_all_free()


def test_prefill_exports_within_the_bound_on_blocks_in_flight():
    pair = Pair(prefill={"max_transfer_blocks": 12})
    pair.deliver = False
    reqs = [make_request(i, 30, max_tokens=4) for i in range(4)]  # 8 blocks each
    for req in reqs:
        pair.add(req)
    pair.run(until=lambda: len(pair.transfers) == 1 and not pair.p.waiting
             and not pair.p.running and not pair.d.handoffs.offers and all(
                 e.dest is not None for e in pair.p.handoffs.out.values()))
    assert pair.p.handoffs.blocks_exporting == 8 and len(pair.p.handoffs.export_queue) == 3
    pair.deliver = True
    pair.run()
    for req in reqs:
        assert pair.outputs[req.request_id]["tokens"] == expected(req)[0]
    pair.assert_all_free()


def _phase(pair: Pair, rid: int, phase: str) -> bool:
    p, d = pair.p.handoffs, pair.d.handoffs
    seq = d.seqs.get(rid) or pair.d.seqs.get(rid)
    if phase == "prefilling":
        return rid in pair.p.seqs and pair.p.seqs[rid].num_computed > 0
    return {
        "offered": rid in p.out and p.out[rid].dest is None,
        "in transfer": any(t[0] == rid for t in pair.transfers),
        "landed": seq is not None and seq in d.landed,
        "decoding": seq is not None and seq in pair.d.running,
    }[phase]


@pytest.mark.parametrize("phase", ["offered", "in transfer", "landed", "decoding"])
@pytest.mark.parametrize("decode_first", [False, True])
def test_an_abort_anywhere_ends_the_request_once_and_frees_every_block(phase, decode_first):
    pair = Pair()
    reqs = [make_request(i, 13, max_tokens=12, ignore_eos=True) for i in range(3)]
    for req in reqs:
        pair.add(req)
    pair.run(until=lambda: _phase(pair, 1, phase))
    order = (pair.d, pair.p) if decode_first else (pair.p, pair.d)
    for sched in order:  # the router sends the abort to both replicas
        sched.abort([1])
    pair.run()
    out = pair.outputs[1]
    assert out["reason"] == FinishReason.ABORT and out["error"] is None
    assert out["tokens"] == expected(reqs[1])[0][:len(out["tokens"])]
    for req in (reqs[0], reqs[2]):
        assert pair.outputs[req.request_id]["tokens"] == expected(req)[0]
    pair.assert_all_free()
    # What landed is counted on both sides, though the request ended on one before the
    # other heard of it.
    c_out, c_in = pair.p.handoffs.counters, pair.d.handoffs.counters
    assert (c_out.handoffs_out, c_out.blocks_out, c_out.bytes_out) == \
        (c_in.handoffs_in, c_in.blocks_in, c_in.bytes_in)


def test_abort_reaching_the_decode_replica_before_the_offer_refuses_it():
    pair = Pair()
    req = make_request(0, 9, max_tokens=5)
    pair.add(req)
    pair.d.abort([0])  # unknown there yet: remembered
    pair.run(until=lambda: 0 in pair.p.handoffs.out)
    pair.p.abort([0])
    pair.run()
    assert pair.outputs[0]["reason"] == FinishReason.ABORT
    pair.assert_all_free()


def test_a_transfer_that_never_lands_fails_its_request_naming_both_replicas():
    pair = Pair(decode={"transfer_timeout_s": 0.0})
    pair.deliver = False
    ok, lost = make_request(0, 9, max_tokens=4), make_request(1, 11, max_tokens=4)
    pair.add(lost)
    pair.run()
    out = pair.outputs[1]
    assert out["reason"] == FinishReason.ERROR
    assert "prefill replica 0" in out["error"].message
    assert "decode replica 1" in out["error"].message
    assert pair.cancelled == [1]  # the decode ranks drop its frames if they come late
    assert pair.d.handoffs.counters.failures == 1
    pair.assert_all_free()
    pair.deliver = True
    pair.d.handoffs.timeout_s = 30.0
    pair.add(ok)
    pair.run()
    assert pair.outputs[0]["tokens"] == expected(ok)[0]


def accepts_to_prefill(pair: Pair) -> list[HandoffAccept]:
    """Every accept the decode replica sends from now on, as the prefill replica gets it."""
    seen, on_handoff = [], pair.p.on_handoff

    def watched(msg) -> None:
        if isinstance(msg, HandoffAccept):
            seen.append(msg)
        on_handoff(msg)

    pair.p.on_handoff = watched
    return seen


def test_the_decode_replica_reuses_the_blocks_it_holds_and_moves_the_rest():
    pair = Pair()
    accepts = accepts_to_prefill(pair)
    first = make_request(0, 10, max_tokens=6, ignore_eos=True)
    pair.add(first)
    pair.run()
    answer = pair.outputs[0]["tokens"]
    # The next turn of the conversation: the decode replica computed the first turn's KV.
    turn = make_request(1, list(first.prompt_token_ids) + answer + [5, 9, 2], max_tokens=4,
                        ignore_eos=True)
    pair.add(turn)
    pair.run()
    assert (pair.outputs[1]["tokens"], pair.outputs[1]["reason"]) == expected(turn)
    held = (len(first.prompt_token_ids) + len(answer) - 1) // BS  # its full, computed blocks
    total = -(-len(turn.prompt_token_ids) // BS)
    assert [(a.reused_blocks, len(a.block_ids)) for a in accepts] == [(0, 3), (held, total - held)]
    c_out, c_in = pair.p.handoffs.counters, pair.d.handoffs.counters
    assert c_in.blocks_reused == held and c_in.blocks_in == 3 + total - held == c_out.blocks_out
    pair.assert_all_free()


def test_a_prompt_held_whole_lands_without_a_transfer():
    pair = Pair()
    accepts = accepts_to_prefill(pair)
    prompt = [(5 * i) % 60 + 1 for i in range(2 * BS)]  # two full blocks
    for rid in (0, 1):
        req = make_request(rid, prompt, max_tokens=5, ignore_eos=True)
        pair.add(req)
        pair.run()
        assert (pair.outputs[rid]["tokens"], pair.outputs[rid]["reason"]) == expected(req)
    assert [(a.reused_blocks, a.block_ids != []) for a in accepts] == [(0, True), (2, False)]
    assert not pair.transfers and pair.p.handoffs.counters.blocks_out == 2
    assert pair.d.handoffs.counters.handoffs_in == 2
    pair.assert_all_free()


def test_a_malformed_accept_fails_the_request_naming_the_blocks():
    pair = Pair()
    pair.add(make_request(0, 9, max_tokens=5))
    pair.run(until=lambda: bool(pair.p.handoffs.peer_out))
    pair.p.on_handoff(HandoffAccept(0, 1, [7], reused_blocks=1))  # 2 where 3 were offered
    out = pair.p.pop_deltas()
    assert out.finish_reasons == [FinishReason.ERROR]
    assert out.errors[0].message == ("decode replica 1 answered with 1 blocks and 1 reused, 3 "
                                     "expected")


def test_the_accept_waits_for_the_plans_in_flight_at_allocation():
    d = Scheduler(config("decode", 1))
    worker = FakeWorker(64, BS)
    d.add_request(make_request(5, 6, max_tokens=20, ignore_eos=True))
    in_flight = worker.execute(d.schedule())
    pair = Pair()
    pair.add(make_request(0, 9, max_tokens=5))
    pair.run(until=lambda: bool(pair.p.handoffs.peer_out))
    offer = pair.p.handoffs.peer_out[0][1]
    d.on_handoff(offer)
    d.handoffs.tick()
    assert not d.handoffs.peer_out  # a plan sent before the allocation may still write
    d.process_result(in_flight)
    d.handoffs.tick()
    [(to, accept)] = d.handoffs.peer_out
    assert to == 0 and isinstance(accept, HandoffAccept) and len(accept.block_ids) == 3


def test_a_request_without_a_decode_replica_is_served_whole_on_the_prefill_replica():
    pair = Pair()
    req = make_request(0, 9, max_tokens=6, eos=[63])
    pair.p.add_request(req)  # decode_replica -1: structured outputs, for one
    pair.run()
    assert (pair.outputs[0]["tokens"], pair.outputs[0]["reason"]) == expected(req)
    assert pair.p.handoffs.counters.handoffs_out == 0


def test_params_travel_resolved():
    pair = Pair()
    req = make_request(0, 9, max_tokens=None)
    pair.add(req)
    pair.run(until=lambda: bool(pair.p.handoffs.peer_out))
    offer = pair.p.handoffs.peer_out[0][1]
    assert isinstance(offer.params, SamplingParams) and offer.params.max_tokens == MAX_LEN - 9
    assert offer.num_computed == 9 and len(offer.token_ids) == 10 and offer.num_blocks == 3


def _dead_error(out: dict, replica: int) -> bool:
    return out["reason"] == FinishReason.ERROR and \
        out["error"].message == f"engine dead: replica {replica}: killed"


SHARED_PHASES = ["prefilling", "offered", "in transfer", "landed", "decoding"]


@pytest.mark.parametrize("phase", SHARED_PHASES)
def test_a_dead_prefill_replica_fails_only_what_had_not_landed(phase):
    """Request 1 is in `phase` when the prefill replica dies; requests whose KV landed on the
    decode replica finish with every token, the others fail naming the dead replica, and the
    decode replica holds no block for them."""
    pair = Pair()
    reqs = [make_request(i, 13, max_tokens=12, ignore_eos=True) for i in range(3)]
    for req in reqs:
        pair.add(req)
    pair.run(until=lambda: _phase(pair, 1, phase))
    decoding = {rid for rid in pair.placed if rid in pair.d.seqs or (
        rid in pair.d.handoffs.seqs and rid not in pair.d.handoffs.incoming)}
    assert (1 in decoding) == (phase in ("landed", "decoding"))
    told = pair.kill(pair.p)
    # Those that go on are marked for the detokenizer: no row of theirs waits for the
    # prefill replica's any longer.
    assert set(told.handoff_ids) == decoding
    pair.run()
    for req in reqs:
        out = pair.outputs[req.request_id]
        if req.request_id in decoding:
            assert (out["tokens"], out["reason"]) == expected(req)
        else:
            assert _dead_error(out, 0), out
            assert out["tokens"] == expected(req)[0][:len(out["tokens"])]
    if phase == "in transfer":
        assert 1 in pair.cancelled  # frames still on their way are dropped
    pair.assert_all_free()
    # An offer that was queued behind the death fails too, and takes no block.
    late = make_request(7, 9, max_tokens=4)
    pair.d.on_handoff(dataclasses.replace(_offer_of(late), prefill_replica=0))
    assert _dead_error(_outputs_of(pair.d)[7], 0)
    pair.assert_all_free()


@pytest.mark.parametrize("phase", SHARED_PHASES)
def test_a_dead_decode_replica_fails_only_what_it_held(phase):
    """Request 1 is in `phase` when the decode replica dies: one not offered yet, or offered
    with none of its KV sent, is served whole by the prefill replica; one in transfer or
    owned by the decode replica fails naming it; the prefill replica holds no block for
    them."""
    pair = Pair()
    reqs = [make_request(i, 13, max_tokens=12, ignore_eos=True) for i in range(3)]
    for req in reqs:
        pair.add(req)
    pair.run(until=lambda: _phase(pair, 1, phase))
    out = pair.p.handoffs.out  # the release of one landed may still be on its way
    kept = {rid for rid in pair.placed if rid in pair.p.seqs or (
        rid in out and not out[rid].exported)}
    exported = {rid for rid in out if out[rid].exported}
    assert (1 in kept) == (phase in ("prefilling", "offered"))
    pair.kill(pair.d)
    pair.run()
    for req in reqs:
        got = pair.outputs[req.request_id]
        if req.request_id in kept:
            assert (got["tokens"], got["reason"]) == expected(req)
        else:
            assert _dead_error(got, 1), got
    assert pair.p.handoffs.counters.failures == len(exported)  # its hand-offs, given up
    pair.assert_all_free()


def _offer_of(req):
    pair = Pair()
    pair.add(req)
    pair.run(until=lambda: bool(pair.p.handoffs.peer_out))
    return pair.p.handoffs.peer_out[0][1]


def _outputs_of(sched: Scheduler) -> dict[int, dict]:
    deltas = sched.pop_deltas()
    return {rid: {"reason": r, "error": e} for rid, r, e in
            zip(deltas.request_ids, deltas.finish_reasons, deltas.errors, strict=True)}
