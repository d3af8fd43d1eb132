"""The zmq side both clients share: checking an address, opening a link, reading monitors.

Options go on each socket, never on a context, so nothing else made from that context
inherits them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat

import zmq
from zmq.utils.monitor import parse_monitor_message

from frontend.client.core import ClientCore, Link, Open
from frontend.client.outputs import EngineDeadError
from frontend.client.unreachable import HANDSHAKE_FAILED
from protocol.client_link import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS

CLOSE_LINGER_MS = 1000
"""How long closing waits for its abort messages to leave."""
MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
                  | HANDSHAKE_FAILED)
FIRST_HANDSHAKE_MS = 5000
"""How long the first connection's ZeroMQ handshake may take. A pipeline's sockets answer it
within milliseconds (zmq's own I/O threads do, however busy the process), so a peer that
accepts the connection and stays silent this long is no pipeline: an HTTP port, most often.
Reconnections keep zmq's default (30 s): a stalled pipeline is expected back."""


def check_address(address: str) -> None:
    """Refuse at once an address that is not one a pipeline prints (a ValueError), a tcp host
    that does not resolve, and an ipc address whose socket file is missing or is no socket:
    no pipeline can answer there (a pipeline binds its socket before it reports ready)."""
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise not_an_address(address)
    if address.startswith("tcp://"):
        _check_tcp(address)
        return
    path = address[len("ipc://"):]
    if not path:
        raise not_an_address(address, "no socket path")
    if path.startswith("@"):  # Linux abstract namespace: no file to look at
        if path == "@":
            raise not_an_address(address, "no socket name after '@'")
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise EngineDeadError(f"no pipeline at {address}: {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise EngineDeadError(f"no pipeline at {address}: {path} is not a socket")


def not_an_address(address: object, why: str = "") -> ValueError:
    return ValueError(f"{address!r} is not a pipeline address{': ' + why if why else ''}: give "
                      "the one the launcher prints after 'clients connect to:' (ipc://... or "
                      "tcp://HOST:PORT)")


def _check_tcp(address: str) -> None:
    """HOST:PORT with a port in range, and a host that resolves. zmq would take a bad one
    without complaint and retry it forever, or fail with a bare "Invalid argument"."""
    hostport = address[len("tcp://"):]
    host, sep, port = hostport.rpartition(":")
    if not sep or not host:
        raise not_an_address(address, "no HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise not_an_address(address, f"port {port!r} is not in 1..65535")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise EngineDeadError(f"no pipeline at {address}: the host {host!r} does not resolve "
                              f"({reason})") from None


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
    if core.first_connection:
        sock.setsockopt(zmq.HANDSHAKE_IVL, FIRST_HANDSHAKE_MS)
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
