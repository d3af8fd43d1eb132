"""Choosing a request's decode replica (prefill/decode disaggregation), as the router does it
for each AddRequest: by load, and, among replicas about as light, the one that was given the
most of the prompt, so a conversation's next turn finds its earlier turns' KV there."""

from __future__ import annotations

import dataclasses

from test_dispatch_faults import dispatch

from protocol import AddRequest, SamplingParams
from protocol.engine_messages import EngineStats

ROLES = ("prefill", "decode", "decode")


def send(d, rid: int, prompt: list[int]) -> int:
    """Place a request; its decode replica."""
    assert d.add(AddRequest(rid, prompt, SamplingParams(), [0], str(rid)))
    return d.paired[rid]


def conversation(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 1 for i in range(length)]


def test_a_conversations_next_turn_goes_where_its_first_was_decoded():
    d, _ = dispatch(ROLES)
    a, b = conversation(1, 40), conversation(2, 40)
    first = {"a": send(d, 1, a), "b": send(d, 2, b)}
    assert sorted(first.values()) == [1, 2]  # the load spreads the two
    rid = 3
    for talker in "aabbbaab":  # each next turn: the last one's prompt, an answer, a question
        if talker == "a":
            a = a + conversation(rid, 20)
        else:
            b = b + conversation(rid, 20)
        assert send(d, rid, a if talker == "a" else b) == first[talker], rid
        rid += 1


def test_a_much_busier_holder_is_passed_over():
    d, _ = dispatch(ROLES)
    a = conversation(1, 40)
    holder = send(d, 1, a)
    other = 3 - holder
    idle = EngineStats(*[0] * 13)
    busy = dataclasses.replace(idle, running=40, kv_blocks_total=64, kv_blocks_used=32)
    d.decode.on_stats(holder, busy)
    d.decode.on_stats(other, dataclasses.replace(idle, kv_blocks_total=64))
    assert send(d, 2, a + conversation(9, 20)) == other


def test_without_a_shared_prefix_the_lighter_replica_takes_it_in_turn():
    d, _ = dispatch(ROLES)
    chosen = [send(d, rid, conversation(rid, 40)) for rid in range(6)]
    assert sorted(chosen) == [1, 1, 1, 2, 2, 2]
