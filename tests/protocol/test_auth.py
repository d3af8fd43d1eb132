"""CURVE on internal links: only members of the run get a frame through."""

from __future__ import annotations

import json
import os
import threading

import pytest
import zmq

from protocol import Shutdown, StepResult
from protocol.auth import CurveKeys, load_credentials, write_credentials, zap_reply
from protocol.sockets import MessageSocket, RouterSocket

RESULT = StepResult(7, [1], [42], None)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()  # also proves the ZAP handler never keeps a context alive


def _bound_pull(ctx, keys):
    sock = MessageSocket(ctx, zmq.PULL, "tcp://127.0.0.1:*", bind=True,
                         accepts=(StepResult,), security=keys)
    return sock, sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _delivered(ctx, server_keys, client_keys, wait_ms=400) -> bool:
    pull, address = _bound_pull(ctx, server_keys)
    push = MessageSocket(ctx, zmq.PUSH, address, bind=False, security=client_keys)
    try:
        try:
            push.send(RESULT, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no authenticated peer: nothing can even be queued
        if not pull.poll(wait_ms):
            return False
        assert pull.recv() == RESULT
        return True
    finally:
        push.close()
        pull.close()


def test_a_member_of_the_run_gets_through(ctx):
    keys = CurveKeys.generate()
    assert _delivered(ctx, keys, keys)
    assert _delivered(ctx, keys, keys.client_only())  # a tool holding the credentials file


def test_a_peer_without_keys_is_refused(ctx):
    assert not _delivered(ctx, CurveKeys.generate(), None)


def test_a_self_made_keypair_is_refused_even_with_the_server_public_key(ctx):
    keys = CurveKeys.generate()
    stranger = CurveKeys.generate()
    forged = CurveKeys(server_public=keys.server_public, client_public=stranger.client_public,
                       client_secret=stranger.client_secret)
    assert not _delivered(ctx, keys, forged)


def test_keys_of_another_run_are_refused(ctx):
    assert not _delivered(ctx, CurveKeys.generate(), CurveKeys.generate())


def test_public_sockets_still_accept_strangers_beside_secured_ones(ctx):
    keys = CurveKeys.generate()
    secured, _ = _bound_pull(ctx, keys)  # starts this context's ZAP handler
    router = RouterSocket(ctx, "tcp://127.0.0.1:*", accepts=(Shutdown,))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router.socket.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        dealer.send(b"\x92\x02\xa2hi")  # any frame: only its arrival matters here
        assert router.poll(2000)
    finally:
        dealer.close(0)
        router.close()
        secured.close()


def test_binding_without_the_server_secret_is_refused(ctx):
    with pytest.raises(ValueError, match="server secret"):
        _bound_pull(ctx, CurveKeys.generate().client_only())


def test_zap_reply_refuses_malformed_and_foreign_requests():
    key = b"k" * 32
    ok = [b"1.0", b"7", b"nanopipe-internal", b"127.0.0.1", b"", b"CURVE", key]
    assert zap_reply(ok, key)[2] == b"200"
    assert zap_reply(ok[:-1] + [b"x" * 32], key)[2] == b"400"
    assert zap_reply(ok[:-1], key)[2] == b"400"  # no credentials
    assert zap_reply([b"2.0", *ok[1:]], key)[2] == b"400"
    assert zap_reply([b"1.0"], key)[:2] == [b"1.0", b""]
    assert zap_reply([b"1.0", b"7", b"nanopipe-internal", b"", b"", b"PLAIN", b"u", b"p"],
                     key)[2] == b"400"


def test_zap_handler_outlives_no_context(ctx):
    """The handler thread ends with its context, so term() never hangs on it."""
    keys = CurveKeys.generate()
    other = zmq.Context()
    sock = MessageSocket(other, zmq.PULL, "tcp://127.0.0.1:*", bind=True, security=keys)
    sock.close()
    done = threading.Event()
    threading.Thread(target=lambda: (other.term(), done.set()), daemon=True).start()
    assert done.wait(5)


def test_credentials_file_round_trip_and_clear_errors(tmp_path):
    keys = CurveKeys.generate()
    path = write_credentials(str(tmp_path), "tcp://127.0.0.1:5555", keys)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    creds = load_credentials(path)
    assert creds.deltas_pub == "tcp://127.0.0.1:5555" and creds.keys == keys.client_only()
    with pytest.raises(ValueError, match="not a nanopipe credentials file"):
        load_credentials(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.write_text(json.dumps({"deltas_pub": "x", "server_public": "short",
                               "client_public": "a" * 40, "client_secret": "b" * 40}))
    with pytest.raises(ValueError, match="server_public"):
        load_credentials(str(bad))
