"""The router's side of a replica's death under prefill/decode disaggregation, without
processes: which requests it fails itself, which it leaves to the dead replica's partner
(HandoffPeerDown), where later aborts go, and what a new request gets."""

from __future__ import annotations

from types import SimpleNamespace

from frontend.router.config import RouterConfig
from frontend.router.dispatch import ReplicaDispatch
from protocol import AbortRequests, AddRequest, FinishReason, SamplingParams
from protocol.kv_handoff import HandoffPeerDown
from protocol.structured_outputs import StructuredOutputs


class FakeZmqSocket:
    def setsockopt(self, *args) -> None:
        pass


class FakeRuntime:
    """Sockets that remember what was sent on them, by address."""

    def __init__(self) -> None:
        self.sent: dict[str, list] = {}

    def socket(self, kind, address, bind=False, accepts=(), security=None):
        sent = self.sent.setdefault(address, [])
        return SimpleNamespace(send=sent.append, socket=FakeZmqSocket(), poll=lambda *a: False)


def dispatch(roles: tuple[str, ...]) -> tuple[ReplicaDispatch, FakeRuntime]:
    n = len(roles)
    config = RouterConfig(tuple(f"sched{r}" for r in range(n)),
                          tuple(f"stats{r}" for r in range(n)), 16, (64,) * n, roles=roles)
    rt = FakeRuntime()
    return ReplicaDispatch(rt, config, None), rt


def add(d: ReplicaDispatch, rid: int, structured: bool = False) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputs("regex", "a+")) \
        if structured else SamplingParams()
    assert d.add(AddRequest(rid, [1, 2, 3], params, [0], str(rid)))


def peer_downs(rt: FakeRuntime, replica: int) -> list[HandoffPeerDown]:
    return [m for m in rt.sent[f"sched{replica}"] if isinstance(m, HandoffPeerDown)]


def test_a_dead_prefill_replica_leaves_its_paired_requests_to_their_decode_replica():
    d, rt = dispatch(("prefill", "decode"))
    add(d, 1)
    add(d, 2, structured=True)  # handed off like any other: its grammar is rebuilt there
    assert d.replica_down(0, "replica 0 scheduler 0 was killed by SIGKILL") is None
    assert peer_downs(rt, 1) == [HandoffPeerDown(
        0, "replica 0 scheduler 0 was killed by SIGKILL", [1, 2])]
    d.abort(AbortRequests([1], FinishReason.ABORT))  # still reaches the decode replica
    assert rt.sent["sched1"][-1] == AbortRequests([1], FinishReason.ABORT)
    assert d.refusal() == ("engine dead: no prefill replica is alive; the decode replicas "
                           "only finish the requests they hold")


def test_a_dead_decode_replica_leaves_its_requests_to_their_prefill_replica():
    d, rt = dispatch(("prefill", "decode", "decode"))
    for rid in range(4):
        add(d, rid)
    on_1 = sorted(rid for rid, r in d.paired.items() if r == 1)
    assert on_1 and len(on_1) < 4
    assert d.replica_down(1, "gone") is None
    assert peer_downs(rt, 0) == [HandoffPeerDown(1, "gone", on_1)]
    assert not any(r == 1 for r in d.paired.values())
    # Then the prefill replica dies too: what it held for replica 1 now has nobody.
    failed = d.replica_down(0, "gone too")
    assert sorted(failed.request_ids) == on_1
    assert {e.message for e in failed.errors} == {"engine dead: replica 0: gone too"}
    assert sorted(peer_downs(rt, 2)[0].request_ids) == sorted(set(range(4)) - set(on_1))


def test_with_no_decode_replica_left_a_request_is_served_whole():
    d, rt = dispatch(("prefill", "decode"))
    d.replica_down(1, "gone")
    add(d, 5)
    assert rt.sent["sched0"][-1].decode_replica == -1 and 5 not in d.paired
    assert d.refusal() is None


def test_a_placement_takes_the_stats_that_have_arrived_first():
    """Stats delivered while a burst is being placed count from the next request on, not
    from the tokenizer's next loop."""
    d, rt = dispatch(("prefill", "decode"))
    waiting = {0: ["stats of replica 0"], 1: []}
    for replica, sock in enumerate(d.stats_in):
        sock.poll = lambda timeout, r=replica: bool(waiting[r])
        sock.recv = lambda r=replica: waiting[r].pop(0)
    seen = []
    d.router.on_stats = lambda replica, stats: seen.append((replica, stats))
    d.decode.on_stats = lambda replica, stats: None
    add(d, 1)
    assert seen == [(0, "stats of replica 0")]
