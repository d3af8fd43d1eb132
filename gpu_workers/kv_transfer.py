"""One rank's side of prefill/decode KV hand-offs (protocol.kv_handoff has the flow).

A prefill rank exports a request's blocks to the decode replica's rank of the same index; the
decode rank lands them, reports KVLanded to its scheduler, and drops what arrives for a
request whose blocks were freed (KVCancel, ordered with the plans). What moves the bytes is
the link's mode (KVLinks.mode, --kv-transfer):

- `frames` (gpu_workers.kv_frames): the blocks gathered into host memory and sent as raw
  ZeroMQ frames; any two replicas of one host.
- `shared` (gpu_workers.kv_shared_copy): the decode rank copies them straight out of the
  prefill rank's pool mapped into its process: one device copy, no socket for the bytes.

Either way the step loops never wait for a transfer: exports and landings are checked between
steps and while idle.
"""

from __future__ import annotations

import torch

from gpu_workers.kv_cache import KVCache
from gpu_workers.kv_ends import KVReceiverBase
from gpu_workers.kv_frames import FramesReceiver, FramesSender
from gpu_workers.kv_shared_copy import SharedReceiver, SharedSender
from protocol import Endpoints
from protocol.kv_handoff import KVCancel, KVExport, KVLinks
from protocol.process_runtime import ProcessRuntime
from protocol.sockets import MessageSocket

KVSender = FramesSender | SharedSender


class KVLink:
    """What the worker loop calls: exports and cancels from the plan stream, pumping between
    steps, and the idle wait."""

    def __init__(self, sender: KVSender | None, receiver: KVReceiverBase | None) -> None:
        self.sender, self.receiver = sender, receiver

    @classmethod
    def make(cls, rt: ProcessRuntime, links: KVLinks | None, rank: int, kv_cache: KVCache,
             endpoints: Endpoints) -> KVLink | None:
        if links is None or not links.role:
            return None
        pool: torch.Tensor = kv_cache.storage
        shared = links.mode == "shared"
        if links.role == "prefill":
            if shared:
                return cls(SharedSender(rt, links, pool, kv_cache.memfd, endpoints.keys), None)
            return cls(FramesSender(rt, links, pool, endpoints.keys), None)
        receiver = SharedReceiver if shared else FramesReceiver
        return cls(None, receiver(rt, links, pool, rank, endpoints))

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

    def close(self) -> None:
        """At the worker's exit: a decode rank drops its mappings of the prefill ranks' pools
        (the launcher stops decode replicas before prefill ones, so none outlives its owner)."""
        if self.receiver is not None:
            self.receiver.close()

    def wait(self, steps: MessageSocket, timeout_ms: int) -> bool:
        if any(side is not None and side.busy for side in (self.sender, self.receiver)):
            timeout_ms = 1  # a copy to report or a staged export to send once it is done
        if self.receiver is not None:
            return self.receiver.wait(steps, timeout_ms)
        return steps.poll(timeout_ms)
