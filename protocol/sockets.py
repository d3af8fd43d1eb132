"""Small typed wrappers over ZeroMQ sockets with the codec built in.

Each wrapper is made for one link and decodes only the message kinds that link may
carry. One `zmq.Context` per process is passed in. Sockets never linger on close and
internal links never drop messages (no high-water mark). Given the run's keys (`security`),
a socket that binds is a CURVE server that admits only the run's members, and one that
connects presents the run's client key (protocol/auth.py); without them it is open, as
the public client sockets and every ipc:// link are.
"""

from __future__ import annotations

from typing import Any

import zmq

from protocol.auth import CurveKeys, secure
from protocol.codec import Decoder, ProtocolError, encode


class MessageSocket:
    """A PUSH, PULL, PUB, SUB or DEALER socket that sends and receives messages."""

    def __init__(self, ctx: zmq.Context, kind: int, address: str, *, bind: bool,
                 accepts: tuple[type, ...] = (), identity: bytes | None = None,
                 security: CurveKeys | None = None,
                 options: dict[int, int] | None = None) -> None:
        """`options`: more socket options, set before it binds or connects (a listener
        copies its options to each connection then)."""
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self._setup(kind, address, bind, identity, security, options)
        except BaseException:
            # Not yet anyone's to close: left open, it would hold the context's term()
            # (every process's exit path) forever.
            self.socket.close()
            raise
        self.decoder = Decoder(*accepts) if accepts else None

    def _setup(self, kind: int, address: str, bind: bool, identity: bytes | None,
               security: CurveKeys | None, options: dict[int, int] | None) -> None:
        secure(self.socket, security, server=bind)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if identity is not None:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        for option, value in (options or {}).items():
            self.socket.setsockopt(option, value)
        if kind == zmq.SUB:
            self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    def send(self, msg: Any, flags: int = 0) -> None:
        self.socket.send(encode(msg), flags, copy=False)

    def send_bytes(self, frame: bytes, flags: int = 0) -> None:
        """Forward an already-encoded frame without decoding it."""
        self.socket.send(frame, flags, copy=False)

    def recv(self, flags: int = 0) -> Any:
        """Receive and decode one message; raises ProtocolError for a bad frame."""
        return self.decode(self.socket.recv(flags, copy=False).buffer)

    def recv_bytes(self, flags: int = 0) -> bytes:
        return self.socket.recv(flags)

    def decode(self, frame: bytes | memoryview) -> Any:
        if self.decoder is None:
            raise ProtocolError("this socket accepts no messages")
        return self.decoder.decode(frame)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(linger=0)


class RouterSocket(MessageSocket):
    """A ROUTER that talks to many peers, each known by its routing identity."""

    def __init__(self, ctx: zmq.Context, address: str, *, accepts: tuple[type, ...],
                 security: CurveKeys | None = None,
                 options: dict[int, int] | None = None) -> None:
        super().__init__(ctx, zmq.ROUTER, address, bind=True, accepts=accepts,
                         security=security, options=options)
        # Raise instead of silently dropping a frame for a peer that has gone away.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def send_to(self, peer: bytes, msg: Any) -> bool:
        """Send to one peer; False when the peer is gone (its frames are then dropped)."""
        try:
            self.socket.send_multipart([peer, encode(msg)], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def recv_from(self, flags: int = 0) -> tuple[bytes, Any]:
        """Receive (peer, message); raises ProtocolError (with .peer set) for a bad frame."""
        frames = self.socket.recv_multipart(flags, copy=False)
        peer = frames[0].bytes
        if len(frames) != 2:
            err = ProtocolError("expected one message frame")
            err.peer = peer  # type: ignore[attr-defined]
            raise err
        try:
            return peer, self.decode(frames[1].buffer)
        except ProtocolError as exc:
            exc.peer = peer  # type: ignore[attr-defined]
            raise
