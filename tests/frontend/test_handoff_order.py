"""A disaggregated request's rows reach the detokenizer from two schedulers on two links:
its first token from the prefill replica, the rest from the decode replica, in either order.
The client must see one stream in the order the tokens were generated."""

from __future__ import annotations

import threading

import pytest
import zmq

from frontend import Client
from frontend.actors.handoff_order import HandoffOrder
from protocol import ErrorKind, FinishReason, RequestError, SamplingParams, TokenDeltas
from protocol.codec import encode

LENGTH = FinishReason.LENGTH


def row(rid: int, tokens: list[int], finish=None, error=None) -> tuple:
    return (rid, tokens, finish, error, None, None, None)


def test_rows_in_the_usual_order_pass_at_once():
    order = HandoffOrder()
    assert order.rows(row(1, [5]), is_handoff=True) == [row(1, [5])]
    order.continued([1])
    assert order.rows(row(1, [6]), False) == [row(1, [6])]
    assert order.rows(row(1, [7], LENGTH), False) == [row(1, [7], LENGTH)]
    assert len(order) == 0


def test_rows_that_overtake_the_handoff_wait_for_it():
    order = HandoffOrder()
    order.continued([1])
    assert order.rows(row(1, [6]), False) == []
    assert order.rows(row(1, [7], LENGTH), False) == []
    assert order.rows(row(2, [9]), False) == [row(2, [9])]  # other requests are not held
    assert order.rows(row(1, [5]), True) == [row(1, [5]), row(1, [6]), row(1, [7], LENGTH)]
    assert len(order) == 0


def test_a_failure_passes_a_held_stream_and_ends_it():
    order = HandoffOrder()
    order.continued([1])
    assert order.rows(row(1, [6]), False) == []
    failed = row(1, [], FinishReason.ERROR, RequestError(ErrorKind.ENGINE_DEAD, "replica 0"))
    assert order.rows(failed, False) == [failed]
    assert len(order) == 0


def test_a_handoff_never_continued_is_forgotten_when_the_request_ends():
    order = HandoffOrder()
    order.rows(row(1, [5]), True)
    failed = row(1, [], FinishReason.ERROR, RequestError(ErrorKind.REQUEST_FAILED, "lost"))
    order.rows(failed, False)
    assert len(order) == 0


def test_an_empty_handoff_row_releases_rows_whose_prefill_replica_died():
    """The decode replica's word that the prefill replica died: held rows go on, in order,
    and the empty row itself shows nothing."""
    order = HandoffOrder()
    order.continued([1])
    assert order.rows(row(1, [6]), False) == []
    assert order.rows(row(1, []), True) == [row(1, [6])]
    assert order.rows(row(1, [7], LENGTH), False) == [row(1, [7], LENGTH)]
    assert len(order) == 0
    # After the usual order (nothing held) it shows nothing either, and leaves nothing.
    assert order.rows(row(2, [5]), True) == [row(2, [5])]
    order.continued([2])
    assert order.rows(row(2, []), True) == []
    assert order.rows(row(2, [8], LENGTH), False) == [row(2, [8], LENGTH)]
    assert len(order) == 0


@pytest.mark.parametrize("decode_first", [True, False])
def test_the_client_gets_one_stream_whichever_replica_arrives_first(fresh_pipe,
                                                                   decode_first):
    pipe = fresh_pipe
    pipe.scheduler.paused = True  # the test plays both replicas
    outputs = []
    with Client(pipe.address, timeout=30) as client:
        asker = threading.Thread(target=lambda: outputs.append(client.generate(
            prompt_token_ids=[11, 12, 13], params=SamplingParams(max_tokens=4))))
        asker.start()
        while not pipe.scheduler.added:
            asker.join(0.01)
        rid = pipe.scheduler.added[-1].request_id
        prefill = TokenDeltas(1, [rid], [[21]], [None], [None], None, handoff_ids=[rid])
        decode = [TokenDeltas(1, [], [], [], [], None, continued_ids=[rid]),
                  TokenDeltas(2, [rid], [[22, 23]], [None], [None], None),
                  TokenDeltas(3, [rid], [[24]], [LENGTH], [None], None)]
        # One link per replica, as the schedulers have: each keeps its own order, and
        # nothing orders the two (a socket per message would not even keep the first).
        links = {}
        for name in ("prefill", "decode"):
            links[name] = zmq.Context.instance().socket(zmq.PUSH)
            links[name].connect(pipe.endpoints.detok_in)
        sends = [("decode", m) for m in decode] + [("prefill", prefill)]
        for name, msg in sends if decode_first else sends[-1:] + sends[:-1]:
            links[name].send(encode(msg))
        asker.join(30)
        for link in links.values():
            link.close(linger=2000)
    assert outputs and outputs[0].token_ids == [21, 22, 23, 24]
    assert outputs[0].finish_reason == "length" and outputs[0].completion_tokens == 4
