"""The step loop's sends never block, and a frame no peer can take yet is kept, in order."""

from __future__ import annotations

import zmq

from protocol import Shutdown
from protocol.sockets import MessageSocket
from scheduler_proc.nonblocking_sender import Outbox


def test_a_frame_waits_for_its_peer_in_order_and_others_are_not_held_up(tmp_path):
    ctx = zmq.Context()
    lonely = MessageSocket(ctx, zmq.PUSH, f"ipc://{tmp_path}/lonely", bind=True)
    attached_in = MessageSocket(ctx, zmq.PULL, f"ipc://{tmp_path}/attached", bind=True,
                                accepts=(Shutdown,))
    attached = MessageSocket(ctx, zmq.PUSH, f"ipc://{tmp_path}/attached", bind=False)
    outbox = Outbox()
    try:
        for i in range(3):
            outbox.send((lonely, attached), Shutdown(f"m{i}"))  # a bound PUSH with no peer
        assert outbox.has_waiting
        # The connected peer is not held up by the one that has none.
        assert [attached_in.recv().reason for _ in range(3)] == ["m0", "m1", "m2"]
        outbox.flush()
        assert outbox.has_waiting
        late = MessageSocket(ctx, zmq.PULL, f"ipc://{tmp_path}/lonely", bind=False,
                             accepts=(Shutdown,))
        outbox.send((lonely,), Shutdown("m3"))  # behind what waits, whatever the peer state
        assert outbox.drain(5.0)
        assert [late.recv().reason for _ in range(4)] == ["m0", "m1", "m2", "m3"]
        late.close()
    finally:
        for sock in (lonely, attached_in, attached):
            sock.close()
        ctx.term()


def test_a_socket_that_fails_drops_the_frame_instead_of_stalling_the_loop(tmp_path):
    ctx = zmq.Context()
    sock = MessageSocket(ctx, zmq.PULL, f"ipc://{tmp_path}/pull", bind=True)  # cannot send
    outbox = Outbox()
    try:
        outbox.send((sock,), Shutdown("x"))
        assert not outbox.has_waiting
    finally:
        sock.close()
        ctx.term()


def test_what_waits_for_a_dead_peer_is_forgotten_and_the_loop_may_rest(tmp_path):
    ctx = zmq.Context()
    dead = MessageSocket(ctx, zmq.PUSH, f"ipc://{tmp_path}/dead", bind=True)  # no peer
    outbox = Outbox()
    try:
        outbox.send((dead,), Shutdown("to a replica that died"))
        assert outbox.has_waiting  # the loop would retry every millisecond
        outbox.forget(dead)
        assert not outbox.has_waiting and outbox.drain(0.0)
    finally:
        dead.close()
        ctx.term()
