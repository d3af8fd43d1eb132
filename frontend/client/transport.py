"""The zmq side both clients share: checking an address, opening a link, reading monitors.

Options go on each socket, never on a context, so nothing else made from that context
inherits them.
"""

from __future__ import annotations

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
    """Refuse at once an ipc address whose socket file is missing or is no socket: no
    pipeline can answer there (a pipeline binds its socket before it reports ready)."""
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


def close_links(sockets: dict[Link, zmq.Socket], monitors: list[zmq.Socket],
                connected: bool) -> None:
    """Close every link; once connected, the requests link lingers so aborts get out."""
    for sock in sockets.values():
        sock.disable_monitor()
    for monitor in monitors:
        monitor.close(linger=0)
    for link, sock in sockets.items():
        lingers = link is Link.REQUESTS and connected
        sock.close(linger=CLOSE_LINGER_MS if lingers else 0)
