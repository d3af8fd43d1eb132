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

import numpy as np
import torch

from gpu_workers.block_mover import BLOCK_DIM, gather_blocks, scatter_blocks
from gpu_workers.kv_ends import KVReceiverBase, KVSenderBase
from protocol import ProtocolError
from protocol.codec import encode
from protocol.kv_handoff import KVExport, KVFrameHeader, KVLinks
from protocol.process_runtime import ProcessRuntime

log = logging.getLogger("nanopipe.worker")

MAX_CHUNK_BYTES = 32 << 20
"""Largest tensor frame: a request's blocks go in chunks of at most this (at least a block)."""


def _dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


class FramesSender(KVSenderBase):
    """A prefill rank's exports: gather, stage, send."""

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
        for start in range(0, len(ids), per_chunk):
            src, to = ids[start:start + per_chunk], dest[start:start + per_chunk]
            data, done = self._gather(src)
            header = KVFrameHeader(msg.request_id, list(to), str(self.pool.dtype),
                                   list(data.shape), start + per_chunk >= len(ids))
            self.staged.append((done, sock.socket, encode(header), data))
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
        while self.staged:
            done, sock, header, data = self.staged[0]
            if done is not None and not done.query():
                return
            self.staged.popleft()
            raw = data.reshape(-1).view(torch.uint8).numpy()
            sock.send_multipart([header, raw], copy=False)


class FramesReceiver(KVReceiverBase):
    """A decode rank's landing side for frames."""

    accepts = (KVFrameHeader,)
    max_message_bytes = MAX_CHUNK_BYTES + (1 << 20)

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
