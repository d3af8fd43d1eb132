"""KV hand-offs through shared pools (--kv-transfer shared): the decode rank copies a
request's blocks straight out of the prefill rank's pool, mapped into its own process
(gpu_workers.kv_shared_pool: CUDA IPC on a GPU both replicas share, a memfd on the CPU).

The prefill rank describes its pool once, first on the link (KVPoolShare). Per export it waits,
without blocking its step loop, until the steps that wrote the blocks are done (an event on
its compute stream, checked between steps), then says where they are (KVBlocksReady). The
decode rank gathers them from the mapped pool and scatters them into its own: on CUDA one
gather and one scatter on a side stream after its queued steps, the compute stream waiting
for them before the next forward. It reports KVLanded only once the copy is done: the prefill
replica frees (and may overwrite) the blocks after that.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from gpu_workers.block_mover import BLOCK_DIM, gather_blocks, scatter_blocks
from gpu_workers.kv_ends import KVReceiverBase, KVSenderBase
from gpu_workers.kv_shared_pool import PoolMismatch, describe_pool, map_pool
from protocol import ProtocolError
from protocol.kv_handoff import KVBlocksReady, KVExport, KVLinks, KVPoolShare
from protocol.process_runtime import ProcessRuntime

log = logging.getLogger("nanopipe.worker")


class SharedSender(KVSenderBase):
    """A prefill rank's side: its pool described once, then where each export's blocks are."""

    def __init__(self, rt: ProcessRuntime, links: KVLinks, pool: torch.Tensor, memfd: int,
                 keys) -> None:
        super().__init__(rt, links, pool, keys)
        share = describe_pool(pool, memfd, links.replica)
        for sock in self.to_decode.values():
            sock.send(share)

    def export(self, msg: KVExport) -> None:
        sock = self.link_to(msg)
        if sock is None:
            return
        written = None
        if self.pool.is_cuda:  # the steps queued so far include every one that wrote them
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.pool.device))
        ready = KVBlocksReady(msg.request_id, self.replica, list(msg.block_ids),
                              list(msg.dest_block_ids))
        self.staged.append((written, sock, ready))
        self.pump()

    def pump(self) -> None:
        """Say where every export's blocks are once they are written, in order."""
        while self.staged:
            written, sock, ready = self.staged[0]
            if written is not None and not written.query():
                return
            self.staged.popleft()
            sock.send(ready)


class SharedReceiver(KVReceiverBase):
    """A decode rank's side: maps each prefill rank's pool, copies blocks out of it."""

    accepts = (KVPoolShare, KVBlocksReady)
    max_message_bytes = 4 << 20

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._peers: dict[int, torch.Tensor | str] = {}
        """Prefill replica -> its mapped pool, or why it could not be mapped."""
        self._copying: deque[tuple[torch.cuda.Event, int, int]] = deque()

    @property
    def busy(self) -> bool:
        return bool(self._copying)

    def take(self, frames: list) -> int:
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            msg = self.sock.decode(frames[0].buffer)
        except ProtocolError as exc:
            log.warning("worker: dropped a bad KV transfer message: %s", exc)
            return 0
        if isinstance(msg, KVPoolShare):
            self._map(msg)
        elif not self.cancelled(msg.request_id):
            problem = self._check(msg)
            if not problem:
                return self._copy(msg)
            log.warning("worker: KV blocks of request %d refused: %s", msg.request_id, problem)
            self.report(msg.request_id, 0, problem)
        return 0

    def _map(self, share: KVPoolShare) -> None:
        try:
            self._peers[share.prefill_replica] = map_pool(share, self.pool)
        except (PoolMismatch, OSError, RuntimeError) as exc:
            why = f"could not map prefill replica {share.prefill_replica}'s KV pool: {exc}"
            log.warning("worker: %s", why)
            self._peers[share.prefill_replica] = why

    def _check(self, msg: KVBlocksReady) -> str:
        source = self._peers.get(msg.prefill_replica)
        if source is None:
            return f"prefill replica {msg.prefill_replica} never described its KV pool"
        if isinstance(source, str):
            return source
        if len(msg.block_ids) != len(msg.dest_block_ids):
            return (f"{len(msg.block_ids)} source blocks for "
                    f"{len(msg.dest_block_ids)} destination blocks")
        for ids, pool, where in ((msg.block_ids, source, "source"),
                                 (msg.dest_block_ids, self.pool, "destination")):
            if any(not 0 <= b < pool.shape[BLOCK_DIM] for b in ids):
                return f"a {where} block outside its pool"
        return ""

    def _copy(self, msg: KVBlocksReady) -> int:
        """Copy the blocks; the bytes copied on this thread (0 on CUDA: the device's)."""
        source = self._peers[msg.prefill_replica]
        num_bytes = len(msg.block_ids) * source[:, :, 0].numel() * source.element_size()
        if not self._cuda:
            scatter_blocks(self.pool, msg.dest_block_ids, gather_blocks(source, msg.block_ids))
            self.report(msg.request_id, num_bytes, "")
            return num_bytes
        compute = torch.cuda.current_stream(self.pool.device)
        self._stream.wait_stream(compute)  # steps still queued that read the old blocks
        with torch.cuda.stream(self._stream):
            scatter_blocks(self.pool, msg.dest_block_ids, gather_blocks(source, msg.block_ids))
            landed = torch.cuda.Event()
            landed.record(self._stream)
        compute.wait_event(landed)  # the next forward reads them
        self._copying.append((landed, msg.request_id, num_bytes))
        return 0

    def settle(self) -> None:
        """Report every copy that is done, in order: only then may the prefill side free the
        source blocks."""
        while self._copying and self._copying[0][0].query():
            _, rid, num_bytes = self._copying.popleft()
            if not self.cancelled(rid):
                self.report(rid, num_bytes, "")

    def close(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.pool.device)  # no copy still reads a peer's pool
        self._copying.clear()
        self._peers.clear()
