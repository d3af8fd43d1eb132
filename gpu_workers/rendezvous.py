"""The torch.distributed rendezvous of a tensor-parallel group spread over several hosts.

Rank 0 (always on node 0) serves a TCPStore on the master address and port, on a socket it
binds itself: a TCPStore left to bind its own port listens on every interface, and nothing
of ours listens beyond the interface the user named. Every rank points gloo (NCCL on cuda)
at the interface that reaches the master, unless the user chose one already, so their own
sockets stay there too. A rank that never joins ends start-up with a message that says
which side is missing, within the start-up timeout, instead of a hang.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct

import torch.distributed as dist

from protocol.process_runtime import ExplainedStartupError

SIOCGIFADDR = 0x8915
IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class RendezvousError(ExplainedStartupError):
    """The ranks of the group did not all meet in time."""


def split_tcp_url(url: str) -> tuple[str, int]:
    """("10.0.0.1", 29500) for "tcp://10.0.0.1:29500" (or "tcp://[::1]:29500")."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def tcp_rendezvous(url: str, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store every rank of the group meets at: served by rank 0, reached by the others."""
    host, port = split_tcp_url(url)
    point_collectives_at(host)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            listener = socket.create_server((host, port), family=_family(host), backlog=128)
        except OSError as exc:
            raise RendezvousError(f"cannot listen on the master address {host}:{port}: "
                                  f"{exc.strerror}") from None
        try:
            return dist.TCPStore(host, port, world_size, True, timeout,
                                 master_listen_fd=listener.detach())
        except dist.DistError as exc:
            raise RendezvousError(
                f"not every rank joined the rendezvous at {host}:{port} within "
                f"{timeout_s:g}s ({str(exc).splitlines()[0]}): start the launch of every "
                "other node (--node-rank 1 ...) with the same --master-addr and "
                "--master-port") from None
    try:
        return dist.TCPStore(host, port, world_size, False, timeout)
    except dist.DistError:
        raise RendezvousError(
            f"rank {rank} could not reach node 0's rendezvous at {host}:{port} within "
            f"{timeout_s:g}s: start node 0 (--node-rank 0) and check --master-addr and "
            "--master-port") from None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def point_collectives_at(master: str) -> None:
    """Set GLOO/NCCL_SOCKET_IFNAME to the interface this host reaches `master` by, unless
    the user set them (IPv4 only; elsewhere the libraries choose)."""
    if all(os.environ.get(name) for name in IFNAME_ENVS) or ":" in master:
        return
    name = interface_towards(master)
    if name is None:
        return
    for env in IFNAME_ENVS:
        os.environ.setdefault(env, name)


def interface_towards(host: str) -> str | None:
    """The name of the local interface whose address routes to `host` (IPv4)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))  # no packet: only a route lookup
            local = probe.getsockname()[0]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    return None
