"""One rank's side of prefill/decode KV hand-offs (protocol.kv_handoff has the flow).

A prefill rank exports a request's blocks to the decode replica's rank of the same index:
one gather over every layer (block_mover.gather_blocks), sent as raw frames (a msgpack
KVFrameHeader, then the tensor's bytes; never pickle) in chunks of at most MAX_CHUNK_BYTES.
On CUDA the gather runs on a side stream into pinned host memory and the frames go out once it
is done, checked between steps, so the step loop never waits for it; the compute stream waits
for the gather only before it may overwrite those blocks.

A decode rank binds its transfer socket, polls it between steps and while idle, checks each
chunk against its pool (dtype, shape, block ids) and scatters it (block_mover.scatter_blocks;
on CUDA on a side stream after the queued steps, the compute stream waiting for it before the
next forward), and reports KVLanded to its scheduler after a request's last chunk. Frames of a
cancelled request (KVCancel, ordered with the plans) are dropped.

This is the ZeroMQ path, between processes on one host or several. NCCL send/recv or CUDA IPC
between GPUs of one host would avoid the two host copies; they are not built yet.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict, deque

import numpy as np
import torch
import zmq

from gpu_workers.block_mover import BLOCK_DIM, gather_blocks, scatter_blocks
from protocol import Endpoints, ProtocolError
from protocol.codec import encode
from protocol.kv_handoff import KVCancel, KVExport, KVFrameHeader, KVLanded, KVLinks
from protocol.process_runtime import ProcessRuntime
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.worker")

MAX_CHUNK_BYTES = 32 << 20
"""Largest tensor frame: a request's blocks go in chunks of at most this (at least a block)."""
MAX_CANCELLED = 4096


def _dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


class KVSender:
    """A prefill rank's exports: gather, stage, send."""

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor,
                 keys) -> None:
        self.pool = pool
        self.to_decode = {r: rt.socket(zmq.PUSH, a, bind=False, security=keys)
                          for r, a in enumerate(links.transfer) if a}
        self.block_bytes = pool[:, :, 0].numel() * pool.element_size()
        self._cuda = pool.is_cuda
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._staged: deque[tuple[object, zmq.Socket, bytes, torch.Tensor]] = deque()

    def export(self, msg: KVExport) -> None:
        sock = self.to_decode.get(msg.decode_replica)
        if sock is None:
            log.warning("worker: export to unknown decode replica %d", msg.decode_replica)
            return
        per_chunk = max(1, MAX_CHUNK_BYTES // self.block_bytes)
        ids, dest = msg.block_ids, msg.dest_block_ids
        for start in range(0, len(ids), per_chunk):
            src, to = ids[start:start + per_chunk], dest[start:start + per_chunk]
            data, done = self._gather(src)
            header = KVFrameHeader(msg.request_id, list(to), str(self.pool.dtype),
                                   list(data.shape), start + per_chunk >= len(ids))
            self._staged.append((done, sock.socket, encode(header), data))
        self.pump()

    def _gather(self, block_ids: list[int]) -> tuple[torch.Tensor, object]:
        if not self._cuda:
            return gather_blocks(self.pool, block_ids), None
        compute = torch.cuda.current_stream(self.pool.device)
        self._stream.wait_stream(compute)  # the steps that wrote these blocks
        with torch.cuda.stream(self._stream):
            gathered = gather_blocks(self.pool, block_ids)
            read = torch.cuda.Event()
            read.record(self._stream)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(read)  # before any later step overwrites the blocks
        return host, done

    def pump(self) -> None:
        """Send every staged chunk whose copy is done, in order (never blocks)."""
        while self._staged:
            done, sock, header, data = self._staged[0]
            if done is not None and not done.query():
                return
            self._staged.popleft()
            raw = data.reshape(-1).view(torch.uint8).numpy()
            sock.send_multipart([header, raw], copy=False)


class KVReceiver:
    """A decode rank's landing side."""

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor, rank: int,
                 endpoints: Endpoints) -> None:
        self.pool, self.rank = pool, rank
        keys = endpoints.keys
        self.sock = rt.adopt(MessageSocket(
            rt.ctx, zmq.PULL, links.transfer[links.replica], bind=True,
            accepts=(KVFrameHeader,), security=keys,
            options={zmq.MAXMSGSIZE: MAX_CHUNK_BYTES + (1 << 20)}))
        self.to_scheduler = rt.socket(zmq.PUSH, endpoints.scheduler_in, bind=False,
                                      security=keys)
        self._cuda = pool.is_cuda
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None
        self._bytes: dict[int, int] = {}
        self._cancelled: OrderedDict[int, None] = OrderedDict()

    def cancel(self, msg: KVCancel) -> None:
        for rid in msg.request_ids:
            self._bytes.pop(rid, None)
            self._cancelled[rid] = None
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.popitem(last=False)

    def pump(self) -> None:
        """Land every chunk already here (never blocks)."""
        while True:
            try:
                frames = self.sock.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = self._check(frames)
            except ProtocolError as exc:
                log.warning("worker: dropped a bad KV transfer frame: %s", exc)
                rid = getattr(exc, "request_id", None)
                if rid is not None:
                    self._report(rid, 0, str(exc))
                continue
            rid = header.request_id
            if rid in self._cancelled:
                continue
            self._scatter(header, frames[1].buffer)
            self._bytes[rid] = self._bytes.get(rid, 0) + len(frames[1].buffer)
            if header.last:
                self._report(rid, self._bytes.pop(rid), "")

    def _report(self, rid: int, num_bytes: int, error: str) -> None:
        self.to_scheduler.send(KVLanded(rid, self.rank, num_bytes, not error, error))

    def _check(self, frames: list) -> KVFrameHeader:
        if len(frames) != 2:
            raise ProtocolError(f"expected a header and a tensor frame, got {len(frames)}")
        header = self.sock.decode(frames[0].buffer)
        pool = self.pool
        expected = list(pool.shape)
        expected[BLOCK_DIM] = len(header.dest_block_ids)
        size = len(frames[1].buffer)
        problem = None
        if _dtype(header.dtype) != pool.dtype:
            problem = (f"dtype {header.dtype}, the pool holds {pool.dtype} (prefill and decode "
                       "replicas must run one --kv-cache-dtype and --dtype)")
        elif header.shape != expected:
            problem = f"shape {header.shape}, expected {expected}"
        elif size != int(np.prod(expected)) * pool.element_size():
            problem = f"{size} bytes for shape {expected}"
        elif any(not 0 <= b < pool.shape[BLOCK_DIM] for b in header.dest_block_ids):
            problem = "a destination block outside the pool"
        if problem is not None:
            exc = ProtocolError(f"KV chunk of request {header.request_id}: {problem}")
            exc.request_id = header.request_id  # type: ignore[attr-defined]
            raise exc
        return header

    def _scatter(self, header: KVFrameHeader, buffer: memoryview) -> None:
        with warnings.catch_warnings():  # read only: the scatter copies out of it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8))
        blocks = raw.view(self.pool.dtype).view(header.shape)
        if not self._cuda:
            scatter_blocks(self.pool, header.dest_block_ids, blocks)
            return
        pinned = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        pinned.copy_(blocks)
        compute = torch.cuda.current_stream(self.pool.device)
        self._stream.wait_stream(compute)  # steps still queued that read the old blocks
        with torch.cuda.stream(self._stream):
            scatter_blocks(self.pool, header.dest_block_ids, pinned)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        compute.wait_event(landed)  # the next forward reads them

    def wait(self, steps: MessageSocket, timeout_ms: int) -> bool:
        """Idle: wait for a plan (True) or transfer frames (landed here, then False)."""
        poller = zmq.Poller()
        poller.register(steps.socket, zmq.POLLIN)
        poller.register(self.sock.socket, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.sock.socket in ready:
            self.pump()
        return steps.socket in ready


class KVLink:
    """What the worker loop calls: exports and cancels from the plan stream, pumping between
    steps, and the idle wait."""

    def __init__(self, sender: KVSender | None, receiver: KVReceiver | None) -> None:
        self.sender, self.receiver = sender, receiver

    @classmethod
    def make(cls, rt: ProcessRuntime, links: KVLinks | None, rank: int, pool: torch.Tensor,
             endpoints: Endpoints) -> KVLink | None:
        if links is None or not links.role:
            return None
        if links.role == "prefill":
            return cls(KVSender(rt, links, pool, endpoints.keys), None)
        return cls(None, KVReceiver(rt, links, pool, rank, endpoints))

    def handle(self, msg: object) -> bool:
        """Take a hand-off message off the plan stream (False: not one)."""
        if isinstance(msg, KVExport) and self.sender is not None:
            self.sender.export(msg)
        elif isinstance(msg, KVCancel) and self.receiver is not None:
            self.receiver.cancel(msg)
        else:
            return isinstance(msg, (KVExport, KVCancel))
        return True

    def pump(self) -> None:
        if self.sender is not None:
            self.sender.pump()
        if self.receiver is not None:
            self.receiver.pump()

    def wait(self, steps: MessageSocket, timeout_ms: int) -> bool:
        if self.sender is not None and self.sender._staged:
            timeout_ms = 1  # a staged copy to send as soon as it is done
        if self.receiver is not None:
            return self.receiver.wait(steps, timeout_ms)
        return steps.poll(timeout_ms)
