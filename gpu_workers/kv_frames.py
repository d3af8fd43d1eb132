"""KV hand-offs as raw ZeroMQ frames (--kv-transfer frames): any two replicas of one host.

A prefill rank gathers a request's blocks over every layer (block_mover.gather_blocks) and
sends them to the decode replica's rank of the same index as raw frames (a msgpack
KVFrameHeader, then the tensor's bytes; never pickle) in chunks of at most MAX_CHUNK_BYTES.
On CUDA the gather runs on a side stream into pinned host memory and the frames go out once it
is done, checked between steps, so the step loop never waits for it; the compute stream waits
for the gather only before it may overwrite those blocks.

The decode rank checks each chunk against its pool (dtype, shape, block ids) and scatters it
(block_mover.scatter_blocks; on CUDA on a side stream after the queued steps, the compute
stream waiting for it before the next forward), and reports KVLanded after a request's last
chunk.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from gpu_workers.block_mover import BLOCK_DIM, gather_blocks, scatter_blocks
from gpu_workers.kv_ends import KVReceiverBase, KVSenderBase
from protocol import ProtocolError
from protocol.codec import encode
from protocol.kv_handoff import KVExport, KVFrameHeader, KVLinks
from protocol.process_runtime import ProcessRuntime

log = logging.getLogger("nanopipe.worker")

MAX_CHUNK_BYTES = 32 << 20
"""Largest tensor frame: a request's blocks go in chunks of at most this (at least a block)."""
SEND_HWM = 2
"""Chunks a prefill rank's socket and a decode rank's each hold at most (FramesSender)."""


def _dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


@dataclass
class _Outgoing:
    """One export's chunks not sent yet, in order: (gathered event, header, host tensor)."""

    request_id: int
    sock: zmq.Socket
    chunks: deque = field(default_factory=deque)
    bytes_left: int = 0


class FramesSender(KVSenderBase):
    """A prefill rank's exports: gather, stage, send the shortest first.

    Only SEND_HWM chunks wait in a socket (and as many at the decode rank's end): the rest
    stay here, where the next chunk is chosen by what is left of its export, fewest bytes
    first. A short prompt's KV thus goes out within a few chunks' time of its export instead
    of behind every chunk of the long prompts exported before it: on one H200 at 16
    requests/s with a fifth of them 4k-8k tokens, the frames link carries about what it can,
    and a short request's second token waited seconds for its hand-off."""

    send_hwm = SEND_HWM

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor,
                 keys) -> None:
        super().__init__(rt, links, pool, keys)
        self.block_bytes = pool[:, :, 0].numel() * pool.element_size()
        self._cuda = pool.is_cuda
        self._stream = torch.cuda.Stream(pool.device) if self._cuda else None

    def export(self, msg: KVExport) -> None:
        sock = self.link_to(msg)
        if sock is None:
            return
        per_chunk = max(1, MAX_CHUNK_BYTES // self.block_bytes)
        ids, dest = msg.block_ids, msg.dest_block_ids
        out = _Outgoing(msg.request_id, sock.socket)
        for start in range(0, len(ids), per_chunk):
            src, to = ids[start:start + per_chunk], dest[start:start + per_chunk]
            data, done = self._gather(src)
            header = KVFrameHeader(msg.request_id, list(to), str(self.pool.dtype),
                                   list(data.shape), start + per_chunk >= len(ids))
            out.chunks.append((done, encode(header), data))
            out.bytes_left += data.numel() * data.element_size()
        if out.chunks:
            self.staged.append(out)
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
        """Send gathered chunks, the export with the fewest bytes left first, while the
        sockets take them (never blocks)."""
        full: set = set()
        while True:
            out = next_to_send(self.staged, full)
            if out is None:
                return
            done, header, data = out.chunks[0]
            raw = data.reshape(-1).view(torch.uint8).numpy()
            try:
                out.sock.send_multipart([header, raw], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                full.add(out.sock)
                continue
            out.chunks.popleft()
            out.bytes_left -= raw.nbytes
            if not out.chunks:
                self.staged.remove(out)


def next_to_send(staged, full: set) -> _Outgoing | None:
    """The export whose next chunk goes now: gathered, its socket not full, the fewest bytes
    left (the earliest export among equals)."""
    ready = [out for out in staged if out.sock not in full
             and (out.chunks[0][0] is None or out.chunks[0][0].query())]
    return min(ready, key=lambda out: out.bytes_left, default=None)


class FramesReceiver(KVReceiverBase):
    """A decode rank's landing side for frames."""

    accepts = (KVFrameHeader,)
    max_message_bytes = MAX_CHUNK_BYTES + (1 << 20)
    receive_hwm = SEND_HWM

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._bytes: dict[int, int] = {}

    def forget(self, rid: int) -> None:
        self._bytes.pop(rid, None)

    def take(self, frames: list) -> int:
        try:
            header = self._check(frames)
        except ProtocolError as exc:
            log.warning("worker: dropped a bad KV transfer frame: %s", exc)
            rid = getattr(exc, "request_id", None)
            if rid is not None:
                self.report(rid, 0, str(exc))
            return 0
        rid = header.request_id
        if self.cancelled(rid):
            return 0
        size = len(frames[1].buffer)
        self._scatter(header, frames[1].buffer)
        self._bytes[rid] = self._bytes.get(rid, 0) + size
        if header.last:
            self.report(rid, self._bytes.pop(rid), "")
        return size

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
