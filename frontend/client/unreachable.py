"""Why a client's first connection found no pipeline, told from its sockets' monitor events.

Nothing listens (the connection is refused, again and again), or something listens that is
no pipeline: it accepts the connection but never completes ZeroMQ's handshake (the HTTP
port given for the ZeroMQ one, most often). Each gets its own message, at once.
"""

from __future__ import annotations

import zmq

REFUSALS_BEFORE_FAILING = 3
"""Refused connection attempts (zmq retries every ~100 ms) before the handshake gives up:
nothing listens there. More than one, so a listener's momentarily full backlog is no error."""

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""Monitor events of a peer that accepted the connection but did not complete ZeroMQ's
handshake: it does not speak zmq, or not in time."""


def refused(address: str) -> str:
    return f"no pipeline at {address}: the connection was refused (nothing listens there)"


def not_zmq(address: str) -> str:
    return (f"no pipeline at {address}: something accepted the connection but did not answer "
            "ZeroMQ's handshake (an HTTP port? give the address printed after 'clients "
            "connect to:'), or the pipeline there is stalled")


class HandshakeWatch:
    """Counts refused connection attempts of one link until it first connects."""

    def __init__(self) -> None:
        self.connected = False
        self.refusals = 0

    def gave_up(self, event: int) -> bool:
        """True when this event shows nothing listens at the address."""
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_CONNECT_RETRIED and not self.connected:
            self.refusals += 1
        return self.refusals >= REFUSALS_BEFORE_FAILING
