"""The two ends of a KV hand-off link, whatever moves the bytes (kv_transfer).

A prefill rank's end (KVSenderBase) holds a socket to the same rank of every decode replica
and the exports staged until they may go. A decode rank's end (KVReceiverBase) binds the
rank's transfer socket, polls it between steps and while idle, drops what arrives for
requests whose blocks were freed (KVCancel, ordered with the plans), and reports each
request's landing, or why it was refused, to its scheduler (KVLanded). What is sent and how
it lands is the subclasses': raw frames (kv_frames) or a copy out of a mapped pool
(kv_shared_copy).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import torch
import zmq

from protocol import Endpoints
from protocol.auth import CurveKeys
from protocol.kv_handoff import KVCancel, KVExport, KVLanded, KVLinks
from protocol.process_runtime import ProcessRuntime
from protocol.sockets import MessageSocket

MAX_CANCELLED = 4096
LAND_BYTES_PER_PUMP = 32 << 20
"""Host bytes a decode rank lands between two steps (one frames chunk): each costs a copy
into pinned memory on the step loop's thread, a few ms per chunk on an H200's host."""
log = logging.getLogger("nanopipe.worker")


class KVSenderBase:
    """A prefill rank's sockets to the decode replicas' ranks of its index, and what is staged
    to go out on them in order once it may (subclasses fill `staged` and send it)."""

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor,
                 keys: CurveKeys | None) -> None:
        self.pool, self.replica = pool, links.replica
        self.to_decode = {r: rt.socket(zmq.PUSH, a, bind=False, security=keys)
                          for r, a in enumerate(links.transfer) if a}
        self.staged: deque = deque()

    @property
    def busy(self) -> bool:
        return bool(self.staged)

    def link_to(self, msg: KVExport) -> MessageSocket | None:
        """The socket to the export's decode replica (None, logged: not one this rank knows)."""
        sock = self.to_decode.get(msg.decode_replica)
        if sock is None:
            log.warning("worker: export to unknown decode replica %d", msg.decode_replica)
        return sock


class KVReceiverBase:
    """The socket, the cancelled set and the reports; subclasses land what arrives."""

    accepts: tuple[type, ...] = ()
    max_message_bytes: int = -1

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor, rank: int,
                 endpoints: Endpoints) -> None:
        self.pool, self.rank = pool, rank
        options = {zmq.MAXMSGSIZE: self.max_message_bytes} if self.max_message_bytes > 0 else {}
        self.sock = rt.adopt(MessageSocket(
            rt.ctx, zmq.PULL, links.transfer[links.replica], bind=True,
            accepts=self.accepts, security=endpoints.keys, options=options))
        self.to_scheduler = rt.socket(zmq.PUSH, endpoints.scheduler_in, bind=False,
                                      security=endpoints.keys)
        self._cuda = pool.is_cuda
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._cancelled: OrderedDict[int, None] = OrderedDict()

    def cancel(self, msg: KVCancel) -> None:
        for rid in msg.request_ids:
            self.forget(rid)
            self._cancelled[rid] = None
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.popitem(last=False)

    def cancelled(self, rid: int) -> bool:
        return rid in self._cancelled

    def forget(self, rid: int) -> None:
        """Drop what is kept for a request that will not land (subclasses)."""

    def pump(self) -> None:
        """Land what is already here (never blocks), up to LAND_BYTES_PER_PUMP of host bytes:
        the rest waits in the socket for the next pause between steps, so a long prompt's KV
        lands over several decode steps instead of stalling one of them."""
        landed = 0
        while landed < LAND_BYTES_PER_PUMP:
            try:
                frames = self.sock.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            landed += self.take(frames)
        self.settle()

    def take(self, frames: list) -> int:
        """Land one message; the host bytes it copied (0: none, or a copy on the device)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Report what finished landing since the last pump (subclasses with async copies)."""

    def report(self, rid: int, num_bytes: int, error: str) -> None:
        self.to_scheduler.send(KVLanded(rid, self.rank, num_bytes, not error, error))

    def wait(self, steps: MessageSocket, timeout_ms: int) -> bool:
        """Idle: wait for a plan (True) or transfer messages (landed here, then False)."""
        poller = zmq.Poller()
        poller.register(steps.socket, zmq.POLLIN)
        poller.register(self.sock.socket, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.sock.socket in ready:
            self.pump()
        else:
            self.settle()
        return steps.socket in ready

    @property
    def busy(self) -> bool:
        """Copies still running whose landing is not reported yet."""
        return False

    def close(self) -> None:
        """Drop what maps another process's memory (subclasses): before that process exits,
        so it frees its memory knowing no one holds it."""
