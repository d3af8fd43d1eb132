"""A socket whose bind or connect fails leaves nothing open: the context still terminates.

zmq's Context.term() waits for every socket of the context to be closed. A socket that
raised while connecting belonged to nobody yet, so nothing closed it and every exit path of
the process (ProcessRuntime.close) hung there: a mistyped address left the stdout
detokenizer and nanopipe-top running after their error.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from protocol.sockets import MessageSocket, RouterSocket


def terminates(ctx: zmq.Context, within_s: float = 5.0) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    return done.wait(within_s)


@pytest.mark.parametrize(("kind", "address", "bind"), [
    (zmq.SUB, "http://127.0.0.1:8000", False),   # a transport zmq does not have
    (zmq.DEALER, "tcp://127.0.0.1", False),      # no port
    (zmq.PULL, "tcp://no-such-interface-x:5555", True),
])
def test_a_failed_connect_or_bind_closes_its_socket(kind, address, bind):
    ctx = zmq.Context()
    try:
        MessageSocket(ctx, kind, address, bind=bind)
    except zmq.ZMQError:
        # While the error is handled its traceback holds the half-made socket, as it does
        # in a process's `finally: runtime.close()`.
        assert terminates(ctx)
    else:
        pytest.fail("the socket was made")


def test_a_router_on_a_port_in_use_closes_its_socket():
    holder, ctx = zmq.Context(), zmq.Context()
    first = RouterSocket(holder, "tcp://127.0.0.1:*", accepts=())
    address = first.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        RouterSocket(ctx, address, accepts=())
    except zmq.ZMQError:
        assert terminates(ctx)
    else:
        pytest.fail("the port was free")
    finally:
        first.socket.close()
        holder.term()
