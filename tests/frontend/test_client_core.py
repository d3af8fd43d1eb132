"""The client's connection protocol on its own: frames and monitor events in, outcomes out.

No sockets and no processes: each test feeds ClientCore what the pipeline would send and
checks what reaches each request and what the core asks its driver to send or open.
"""

from __future__ import annotations

import pytest
import zmq

from frontend.client.core import (
    DISCONNECT_GRACE_S,
    ORPHAN_ERROR,
    RECONNECT_RETRY_S,
    ClientCore,
    Link,
    Open,
    Phase,
    Reset,
    Send,
)
from frontend.client.outputs import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    RequestDelta,
    RequestRejected,
)
from frontend.client.unreachable import REFUSALS_BEFORE_FAILING, not_zmq, refused
from protocol import (
    AbortRequest,
    ClientHello,
    ClientWelcome,
    Decoder,
    EngineDead,
    ResultDelta,
    ResultDeltaBatch,
    encode,
)
from protocol.outcomes import ErrorKind, FinishReason, RequestError

ADDRESS = "tcp://127.0.0.1:5555"
RESULTS = "tcp://127.0.0.1:5556"
WELCOME = ClientWelcome(results_address=RESULTS, model="tiny", max_model_len=128)
SENT = Decoder(AbortRequest, ClientHello)
"""Reads what the core sends, as the tokenizer would."""


def delta(request_id: str, text: str = "", finish: FinishReason | None = None,
          error: str | None = None, token_ids: list[int] | None = None,
          kind: ErrorKind = ErrorKind.INVALID_REQUEST, field: str | None = None
          ) -> ResultDelta:
    return ResultDelta(client_request_id=request_id, text=text, token_ids=token_ids or [],
                       finish_reason=FinishReason.ERROR if error else finish, prompt_tokens=3,
                       completion_tokens=len(token_ids or []), logprobs=None,
                       error=None if error is None else RequestError(kind, error, field))


def ready_core() -> ClientCore:
    core = ClientCore(ADDRESS)
    core.start()
    core.on_frame(Link.REQUESTS, encode(WELCOME))
    core.on_frame(Link.RESULTS, encode(WELCOME))
    assert core.phase is Phase.READY
    return core


def submit(core: ClientCore, request_id: str) -> list:
    got: list = []
    core.submit(request_id, got.append)
    return got


def aborted(actions: list) -> list[str]:
    return [SENT.decode(a.frame).client_request_id for a in actions if isinstance(a, Send)]


def test_handshake_opens_the_results_link_named_by_the_tokenizer():
    core = ClientCore(ADDRESS)
    first = core.start()
    assert first.link is Link.REQUESTS and first.address == ADDRESS
    assert SENT.decode(first.hello) == ClientHello(core.client_id)
    assert core.phase is Phase.CONNECTING and core.handshaking

    # A welcome on the results link before the tokenizer's is not the handshake's.
    assert core.on_frame(Link.RESULTS, encode(WELCOME)) == []
    assert core.phase is Phase.CONNECTING

    (opened,) = core.on_frame(Link.REQUESTS, encode(WELCOME))
    assert isinstance(opened, Open) and opened.link is Link.RESULTS
    assert opened.address == RESULTS
    assert SENT.decode(opened.hello) == ClientHello(core.client_id)
    assert core.phase is Phase.JOINING and core.welcome is None

    assert core.on_frame(Link.RESULTS, encode(WELCOME)) == []
    assert core.phase is Phase.READY and not core.handshaking
    assert core.welcome == WELCOME
    # A repeated welcome opens nothing more.
    assert core.on_frame(Link.REQUESTS, encode(WELCOME)) == []


def test_deltas_reach_their_own_request_until_it_finishes():
    core = ready_core()
    a, b = submit(core, "a"), submit(core, "b")
    batch = ResultDeltaBatch([delta("a", "x", token_ids=[1]), delta("b", "y", token_ids=[2])])
    assert core.on_frame(Link.RESULTS, encode(batch)) == []
    core.on_frame(Link.RESULTS, encode(delta("b", "z", finish=FinishReason.LENGTH, token_ids=[3])))
    assert [d.text for d in a] == ["x"] and [d.text for d in b] == ["y", "z"]
    assert all(isinstance(d, RequestDelta) for d in a + b)
    assert b[-1].finish_reason == "length" and b[-1].request_id == "b"
    assert core.in_flight == 1
    # After its final delta a request gets nothing more; an unknown id is dropped quietly.
    core.on_frame(Link.RESULTS, encode(delta("b", "late")))
    core.on_frame(Link.RESULTS, encode(delta("nobody", "lost", finish=FinishReason.STOP)))
    assert len(b) == 2 and len(a) == 1


def test_top_logprobs_become_pairs():
    core = ready_core()
    got = submit(core, "a")
    msg = ResultDelta(client_request_id="a", text="t", token_ids=[5],
                      finish_reason=FinishReason.STOP, prompt_tokens=1, completion_tokens=1,
                      logprobs=[-0.5], error=None,
                      top_token_ids=[[5, 6]], top_logprobs=[[-0.5, -1.5]])
    core.on_frame(Link.RESULTS, encode(msg))
    assert got[0].top_logprobs == [[(5, -0.5), (6, -1.5)]] and got[0].logprobs == [-0.5]


def test_forgotten_request_gets_nothing():
    core = ready_core()
    got = submit(core, "a")
    core.forget("a")
    core.on_frame(Link.RESULTS, encode(delta("a", "x")))
    assert got == [] and core.in_flight == 0


def test_a_refused_request_fails_alone():
    core = ready_core()
    bad, good = submit(core, "bad"), submit(core, "good")
    core.on_frame(Link.REQUESTS, encode(delta("bad", error="prompt must not be empty",
                                              field="prompt")))
    (err,) = bad
    assert isinstance(err, RequestRejected) and "prompt must not be empty" in str(err)
    assert err.field == "prompt" and err.kind is ErrorKind.INVALID_REQUEST
    core.on_frame(Link.RESULTS, encode(delta("good", "ok", finish=FinishReason.STOP)))
    assert good[0].text == "ok" and core.dead is None


def test_a_busy_refusal_says_so():
    core = ready_core()
    got = submit(core, "a")
    core.on_frame(Link.REQUESTS, encode(delta("a", error="busy: retry", kind=ErrorKind.BUSY)))
    assert isinstance(got[0], RequestRejected) and got[0].kind is ErrorKind.BUSY


def test_a_request_error_from_a_dead_engine_is_engine_dead():
    core = ready_core()
    got = submit(core, "a")
    core.on_frame(Link.RESULTS, encode(delta("a", error="worker 0 was killed",
                                                    kind=ErrorKind.ENGINE_DEAD)))
    assert isinstance(got[0], EngineDeadError) and "worker 0" in str(got[0])


def test_an_error_without_id_fails_and_aborts_every_unanswered_request():
    core = ready_core()
    answered, x, y = submit(core, "answered"), submit(core, "x"), submit(core, "y")
    core.on_frame(Link.RESULTS, encode(delta("answered", "hi")))
    actions = core.on_frame(Link.REQUESTS, encode(delta("", error="malformed message")))
    assert aborted(actions) == ["x", "y"]
    for got in (x, y):
        (err,) = got
        assert isinstance(err, RequestRejected)
        assert str(err) == ORPHAN_ERROR + "malformed message"
    assert [d.text for d in answered] == ["hi"] and core.in_flight == 1
    # Requests failed this way are gone: a late delta for them is dropped.
    core.on_frame(Link.RESULTS, encode(delta("x", "late")))
    assert len(x) == 1


def test_engine_dead_fails_everything_in_flight_and_later():
    core = ready_core()
    a, b = submit(core, "a"), submit(core, "b")
    core.on_frame(Link.RESULTS, encode(EngineDead("worker 1 exited with code -9")))
    for got in (a, b):
        (err,) = got
        assert isinstance(err, EngineDeadError) and "worker 1" in str(err)
    assert core.dead == "worker 1 exited with code -9" and core.in_flight == 0
    with pytest.raises(EngineDeadError, match="worker 1"):
        submit(core, "c")
    assert core.abort("a") is None  # nothing would read it


def test_engine_dead_during_the_handshake_fails_it():
    core = ClientCore(ADDRESS)
    core.start()
    core.on_frame(Link.REQUESTS, encode(EngineDead("scheduler exited")))
    assert core.phase is Phase.FAILED and core.dead == "scheduler exited"


@pytest.mark.parametrize("link", [Link.REQUESTS, Link.RESULTS])
def test_refused_connections_fail_the_handshake(link):
    core = ClientCore(ADDRESS)
    core.start()
    if link is Link.RESULTS:
        core.on_frame(Link.REQUESTS, encode(WELCOME))
    for _ in range(REFUSALS_BEFORE_FAILING - 1):
        core.on_monitor(link, zmq.EVENT_CONNECT_RETRIED, now=0.0)
    assert core.handshaking
    core.on_monitor(link, zmq.EVENT_CONNECT_RETRIED, now=0.0)
    assert core.phase is Phase.FAILED
    expected = ADDRESS if link is Link.REQUESTS else RESULTS
    assert core.dead == (f"no pipeline at {expected}: the connection was refused "
                         f"(nothing listens there)")


@pytest.mark.parametrize("event", [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                                   zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL])
def test_a_peer_that_fails_the_first_zmq_handshake_is_no_pipeline(event):
    """An HTTP port given as the pipeline's address: it accepts and never speaks zmq."""
    core = ClientCore(ADDRESS)
    core.start()
    core.on_monitor(Link.REQUESTS, zmq.EVENT_CONNECTED, now=0.0)
    core.on_monitor(Link.REQUESTS, event, now=5.0)
    assert core.phase is Phase.FAILED and core.dead == not_zmq(ADDRESS)
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=5.0)
    assert core.dead == not_zmq(ADDRESS) and core.wait_s(now=5.0) is None


def test_a_failed_handshake_while_reconnecting_is_left_to_the_retries():
    """Once a pipeline has welcomed the client, a silent peer is that pipeline, stalled."""
    core = ready_core()
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=0.0)
    core.on_timer(now=DISCONNECT_GRACE_S)
    assert not core.first_connection and core.handshaking
    core.on_monitor(Link.REQUESTS, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, now=5.0)
    assert core.dead is None and core.handshaking


def test_retries_after_a_connection_are_no_refusal():
    core = ClientCore(ADDRESS)
    core.start()
    core.on_monitor(Link.REQUESTS, zmq.EVENT_CONNECTED, now=0.0)
    for _ in range(REFUSALS_BEFORE_FAILING + 2):
        core.on_monitor(Link.REQUESTS, zmq.EVENT_CONNECT_RETRIED, now=0.0)
    assert core.phase is Phase.CONNECTING and core.dead is None


def test_a_lost_connection_waits_for_the_reason_then_reconnects():
    """A peer stalled past the heartbeat timeout: once its socket accepts again, what was in
    flight fails (its results may be lost); new requests fail at once until a fresh handshake
    under a new id brings the client back."""
    core = ready_core()
    old_id = core.client_id
    got = submit(core, "a")
    assert core.wait_s(now=10.0) is None
    core.on_monitor(Link.RESULTS, zmq.EVENT_DISCONNECTED, now=10.0)
    assert core.wait_s(now=11.0) == pytest.approx(DISCONNECT_GRACE_S - 1.0)
    with pytest.raises(ConnectionLostError, match="lost the connection"):
        submit(core, "b")  # sent on the old link, it could be stranded
    core.on_monitor(Link.RESULTS, zmq.EVENT_CONNECTED, now=11.0)  # zmq's own retry
    assert core.on_timer(now=10.0 + DISCONNECT_GRACE_S - 0.01) == []
    assert got == [] and core.dead is None
    reset, reopen = core.on_timer(now=10.0 + DISCONNECT_GRACE_S)
    assert isinstance(reset, Reset) and isinstance(reopen, Open)
    assert reopen.link is Link.REQUESTS and reopen.address == ADDRESS
    assert core.client_id != old_id and SENT.decode(reopen.hello).client_id == core.client_id
    assert core.abort("a") is None and got == []
    core.on_monitor(Link.REQUESTS, zmq.EVENT_CONNECTED, now=14.0)
    (err,) = got
    assert isinstance(err, ConnectionLostError) and isinstance(err, EngineDeadError)
    assert str(err).startswith(f"lost the connection to the pipeline at {ADDRESS} (no answer")
    assert core.dead is None and core.lost == str(err) and core.handshaking
    core.on_frame(Link.REQUESTS, encode(WELCOME))
    core.on_frame(Link.RESULTS, encode(WELCOME))
    assert core.phase is Phase.READY and core.lost is None and core.wait_s(now=20.0) is None
    assert submit(core, "c") == []


def test_a_lost_connection_to_a_stopped_pipeline_is_its_death():
    """Nothing listens at the address any more (a stopped pipeline removed its sockets)."""
    core = ready_core()
    got = submit(core, "a")
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=0.0)
    core.on_timer(now=DISCONNECT_GRACE_S)
    for _ in range(REFUSALS_BEFORE_FAILING):
        core.on_monitor(Link.REQUESTS, zmq.EVENT_CONNECT_RETRIED, now=4.0)
    (err,) = got
    assert type(err) is EngineDeadError and core.dead == str(err) and core.lost is None
    assert str(err) == f"lost the connection to {ADDRESS}; {refused(ADDRESS)}"
    assert core.phase is Phase.FAILED and core.wait_s(now=5.0) is None


def test_a_reconnection_not_answered_starts_over_until_engine_dead():
    core = ready_core()
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=0.0)
    core.on_timer(now=DISCONNECT_GRACE_S)
    first_try = core.client_id
    retry_at = DISCONNECT_GRACE_S + RECONNECT_RETRY_S
    assert core.wait_s(now=DISCONNECT_GRACE_S) == pytest.approx(RECONNECT_RETRY_S)
    reset, reopen = core.on_timer(now=retry_at)
    assert isinstance(reset, Reset) and isinstance(reopen, Open)
    assert core.client_id != first_try and core.lost is not None
    core.on_frame(Link.REQUESTS, encode(EngineDead("worker 0 was killed")))
    assert core.dead == "worker 0 was killed" and core.lost is None
    assert core.phase is Phase.FAILED and core.on_timer(now=retry_at * 2) == []


def test_the_engine_dead_reason_wins_within_the_grace():
    core = ready_core()
    got = submit(core, "a")
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=0.0)
    core.on_frame(Link.RESULTS, encode(EngineDead("worker 0 was killed")))
    core.on_timer(now=DISCONNECT_GRACE_S + 1)
    assert [str(e) for e in got] == ["worker 0 was killed"]
    assert core.dead == "worker 0 was killed"


def test_a_new_request_waits_within_the_grace_for_the_reason():
    """A request made while a dropped connection's EngineDead may still come is held back
    (the clients wait `explaining_s`), so it fails with the engine's reason, not with "lost
    the connection", when the engine died; after the grace it fails as lost."""
    core = ready_core()
    assert core.explaining_s(now=5.0) == 0.0
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=10.0)
    assert core.explaining_s(now=10.5) == pytest.approx(DISCONNECT_GRACE_S - 0.5)
    core.on_frame(Link.RESULTS, encode(EngineDead("tokenizer 0 was killed by SIGKILL")))
    assert core.explaining_s(now=10.6) == 0.0
    with pytest.raises(EngineDeadError, match="tokenizer 0 was killed by SIGKILL") as err:
        submit(core, "b")
    assert type(err.value) is EngineDeadError
    stalled = ready_core()
    stalled.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=10.0)
    assert stalled.explaining_s(now=10.0 + DISCONNECT_GRACE_S) == 0.0
    with pytest.raises(ConnectionLostError):
        submit(stalled, "c")


def test_a_lost_connection_during_the_handshake_fails_it():
    core = ClientCore(ADDRESS)
    core.start()
    core.on_monitor(Link.REQUESTS, zmq.EVENT_DISCONNECTED, now=0.0)
    core.on_timer(now=DISCONNECT_GRACE_S)
    assert core.phase is Phase.FAILED and "lost the connection" in core.dead


def test_close_fails_and_aborts_what_is_in_flight():
    core = ready_core()
    a, b = submit(core, "a"), submit(core, "b")
    actions = core.close()
    assert sorted(aborted(actions)) == ["a", "b"]
    for rid, got in (("a", a), ("b", b)):
        (err,) = got
        assert isinstance(err, ClientClosedError)
        assert str(err) == f"request {rid}: the client was closed"
    assert core.close() == [] and core.abort("a") is None
    with pytest.raises(ClientClosedError):
        submit(core, "c")


def test_frames_the_client_cannot_read_are_dropped():
    core = ready_core()
    got = submit(core, "a")
    for frame in (b"", b"\xff\x00garbage", encode(ClientHello("me")), encode(WELCOME)[:-1]):
        assert core.on_frame(Link.RESULTS, frame) == []
    assert got == [] and core.phase is Phase.READY and core.dead is None
