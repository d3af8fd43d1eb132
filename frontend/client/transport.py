"""The zmq side both clients share: checking an address, opening a link, reading monitors.

Options go on each socket, never on a context, so nothing else made from that context
inherits them.
"""

from __future__ import annotations

import contextlib
import os
import stat

import zmq
from zmq.utils.monitor import parse_monitor_message

from frontend.client.core import ClientCore, Link, Open
from frontend.client.outputs import EngineDeadError
from protocol.client_link import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS

CLOSE_LINGER_MS = 1000
"""How long closing waits for its abort messages to leave."""
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED


def check_address(address: str) -> None:
    """Refuse at once an address that is not one a pipeline prints (a ValueError), and an
    ipc address whose socket file is missing or is no socket: no pipeline can answer there (a
    pipeline binds its socket before it reports ready)."""
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise ValueError(f"{address!r} is not a pipeline address: give the one the launcher "
                         "prints after 'clients connect to:' (ipc://... or tcp://HOST:PORT)")
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    if path.startswith("@"):  # Linux abstract namespace: no file to look at
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise EngineDeadError(f"no pipeline at {address}: {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise EngineDeadError(f"no pipeline at {address}: {path} is not a socket")


def open_link(ctx: zmq.Context, core: ClientCore, action: Open) -> tuple[zmq.Socket, zmq.Socket]:
    """Connect the DEALER `action` asks for and send its hello; returns it and its monitor.
    Heartbeats make a hung or unreachable peer a dropped connection."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.IDENTITY, core.client_id.encode())
    monitor = sock.get_monitor_socket(MONITOR_EVENTS)
    monitor.setsockopt(zmq.LINGER, 0)
    sock.connect(action.address)
    sock.send(action.hello, zmq.NOBLOCK)
    return sock, monitor


def monitor_event(frames: list[bytes]) -> int:
    return parse_monitor_message(frames)["event"]


class Links:
    """The two DEALER links of one client and their monitors, registered with its poller
    (a zmq.Poller on the I/O thread, a zmq.asyncio.Poller on the event loop)."""

    def __init__(self, poller: zmq.Poller) -> None:
        self.poller = poller
        self.sockets: dict[Link, zmq.Socket] = {}
        self._links: dict[zmq.Socket, Link] = {}
        self._monitors: dict[zmq.Socket, Link] = {}

    def open(self, ctx: zmq.Context, core: ClientCore, action: Open) -> None:
        sock, monitor = open_link(ctx, core, action)
        self.sockets[action.link] = sock
        self._links[sock] = action.link
        self._monitors[monitor] = action.link
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    def monitored(self, sock: zmq.Socket) -> Link | None:
        """The link whose monitor `sock` is; None when it is a link itself."""
        return self._monitors.get(sock)

    def link(self, sock: zmq.Socket) -> Link:
        return self._links[sock]

    def send_request(self, frame: bytes) -> None:
        """Send on the requests link without blocking; dropped when it is gone or full."""
        sock = self.sockets.get(Link.REQUESTS)
        if sock is not None and not sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(frame, zmq.NOBLOCK)

    def close(self, connected: bool) -> None:
        """Close every link; once connected, the requests link lingers so aborts get out."""
        for sock in self.sockets.values():
            sock.disable_monitor()
        for monitor in self._monitors:
            with contextlib.suppress(KeyError):
                self.poller.unregister(monitor)
            monitor.close(linger=0)
        for link, sock in self.sockets.items():
            with contextlib.suppress(KeyError):
                self.poller.unregister(sock)
            lingers = link is Link.REQUESTS and connected
            sock.close(linger=CLOSE_LINGER_MS if lingers else 0)
        self.sockets.clear()
        self._links.clear()
        self._monitors.clear()
