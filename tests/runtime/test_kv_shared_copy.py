"""KV hand-offs through shared pools, one prefill rank's link to one decode rank's, as the
workers run them: the sender describes its pool and says where each export's blocks are, the
receiver maps the pool, copies the blocks and reports KVLanded to its scheduler's socket.
On the CPU the pool lives in a memfd the receiver opens through /proc; on a GPU (the `gpu`
tests) through CUDA IPC, on the same device or from another GPU of the host, found by its
UUID and read through peer access."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from gpu_workers.kv_shared_copy import SharedReceiver, SharedSender
from gpu_workers.kv_shared_pool import (
    PoolMismatch,
    describe_pool,
    map_pool,
    memfd_pool,
    source_gpu,
)
from gpu_workers.kv_transfer import KVLink
from protocol.codec import Decoder
from protocol.kv_handoff import (
    CudaPoolHandle,
    KVCancel,
    KVExport,
    KVLanded,
    KVLinks,
    KVPoolShare,
)
from protocol.process_runtime import ProcessRuntime

SHAPE = (2, 3, 6, 4, 2, 8)  # [K/V, layers, blocks, block_size, kv_heads, head_dim]


def runtime() -> ProcessRuntime:
    """A worker's runtime, made off the main thread so it leaves pytest's signals alone."""
    made = []
    t = threading.Thread(target=lambda: made.append(ProcessRuntime("worker")))
    t.start()
    t.join()
    return made[0]


def patterned(pool: torch.Tensor) -> torch.Tensor:
    values = torch.arange(pool.numel(), dtype=torch.float32).reshape(pool.shape)
    pool.copy_(values.to(pool.dtype))
    return pool


class Link:
    """A prefill rank 0 of replica 0 wired to decode replica 1's rank 0, and the decode
    scheduler's input, where the landings arrive."""

    def __init__(self, tmp_path, prefill_pool: torch.Tensor, memfd: int,
                 decode_pool: torch.Tensor) -> None:
        self.rt = runtime()
        transfer = ("", f"ipc://{tmp_path}/kv_r0")
        endpoints = SimpleNamespace(keys=None, scheduler_in=f"ipc://{tmp_path}/sched")
        self.scheduler = self.rt.socket(zmq.PULL, endpoints.scheduler_in, bind=True,
                                        accepts=(KVLanded,))
        self.receiver = SharedReceiver(
            self.rt, KVLinks("decode", 1, transfer=transfer, mode="shared"), decode_pool, 0,
            endpoints)
        self.sender = SharedSender(self.rt, KVLinks("prefill", 0, transfer=transfer,
                                                    mode="shared"), prefill_pool, memfd, None)

    def landings(self, count: int, timeout_s: float = 10.0) -> list[KVLanded]:
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            self.receiver.pump()
            while self.scheduler.poll(10):
                out.append(self.scheduler.recv())
        return out

    def close(self) -> None:
        self.rt.close()


def test_exported_blocks_land_in_the_decode_pool_and_are_reported(tmp_path):
    prefill, fd = memfd_pool(SHAPE, torch.float32)
    patterned(prefill)
    decode = torch.zeros(2, 3, 9, 4, 2, 8)  # a pool of another size: only the layout matters
    link = Link(tmp_path, prefill, fd, decode)
    try:
        link.sender.export(KVExport(7, [4, 1, 2], 1, [0, 8, 3]))
        (landed,) = link.landings(1)
        assert landed == KVLanded(7, 0, 3 * prefill[:, :, 0].numel() * 4, True, "")
        for src, dst in zip([4, 1, 2], [0, 8, 3]):
            assert torch.equal(decode[:, :, dst], prefill[:, :, src])
        assert not decode[:, :, [1, 2, 4, 5, 6, 7]].any()  # nothing else written
        KVLink(None, link.receiver).close()  # a worker's exit drops the prefill pool's mapping
        link.sender.export(KVExport(8, [5], 1, [6]))
        (refused,) = link.landings(1)
        assert not refused.ok and "never described its KV pool" in refused.error
    finally:
        link.close()


def test_refusals_are_reported_and_cancelled_requests_are_dropped(tmp_path):
    prefill, fd = memfd_pool(SHAPE, torch.float32)
    decode = torch.zeros(SHAPE)
    link = Link(tmp_path, patterned(prefill), fd, decode)
    try:
        link.receiver.cancel(KVCancel([5]))
        link.sender.export(KVExport(5, [0], 1, [0]))  # freed on the decode side: dropped
        link.sender.export(KVExport(6, [0, 99], 1, [1, 2]))
        link.sender.export(KVExport(8, [3], 1, [3]))
        refused, landed = link.landings(2)
        assert (refused.request_id, refused.ok) == (6, False)
        assert "source block outside its pool" in refused.error
        assert (landed.request_id, landed.ok) == (8, True)
        assert not decode[:, :, :3].any() and torch.equal(decode[:, :, 3], prefill[:, :, 3])
        assert link.landings(1, timeout_s=0.3) == []
    finally:
        link.close()


def test_a_pool_that_cannot_be_mapped_fails_its_requests_by_name(tmp_path):
    prefill, fd = memfd_pool(SHAPE, torch.float32)
    decode = torch.zeros(SHAPE, dtype=torch.bfloat16)  # another --dtype on the decode side
    link = Link(tmp_path, prefill, fd, decode)
    try:
        link.sender.export(KVExport(3, [0], 1, [0]))
        (refused,) = link.landings(1)
        assert not refused.ok
        assert refused.error == ("could not map prefill replica 0's KV pool: prefill replica "
                                 "0's KV pool holds torch.float32, this one torch.bfloat16 "
                                 "(prefill and decode replicas must run one --dtype and "
                                 "--kv-cache-dtype)")
    finally:
        link.close()


CHILD = """
import sys, torch
from gpu_workers.kv_shared_pool import describe_pool, memfd_pool
from protocol.codec import encode
pool, fd = memfd_pool({shape}, torch.bfloat16)
pool.copy_(torch.arange(pool.numel()).reshape(pool.shape).to(torch.bfloat16))
sys.stdout.write(encode(describe_pool(pool, fd, 2)).hex() + "\\n")
sys.stdout.flush()
sys.stdin.readline()
"""


def test_another_process_maps_the_pool_and_mismatches_are_named():
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(shape=SHAPE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        share = Decoder(KVPoolShare).decode(bytes.fromhex(child.stdout.readline()))
        assert (share.prefill_replica, share.pid, share.cuda) == (2, child.pid, None)
        own = torch.zeros(2, 3, 1, 4, 2, 8, dtype=torch.bfloat16)
        mapped = map_pool(share, own)
        expected = torch.arange(mapped.numel()).reshape(SHAPE).to(torch.bfloat16)
        assert torch.equal(mapped, expected)
        with pytest.raises(PoolMismatch, match=r"shape \[2, 3, 6, 4, 2, 8\], which does not "
                           r"match this one's \[2, 3, 1, 4, 1, 8\]"):
            map_pool(share, torch.zeros(2, 3, 1, 4, 1, 8, dtype=torch.bfloat16))
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=10)
    with pytest.raises(OSError):  # the process is gone, and its memfd with it
        map_pool(share, own)


def test_a_cpu_pool_outside_a_memfd_cannot_be_described():
    with pytest.raises(ValueError, match="memfd"):
        describe_pool(torch.zeros(SHAPE), -1, 0)


@pytest.mark.gpu
def test_cuda_ipc_copies_between_two_processes_on_one_gpu(tmp_path):
    """The prefill side in another process, as with two replicas sharing a GPU."""
    code = CHILD.replace("memfd_pool({shape}, torch.bfloat16)",
                         "torch.zeros({shape}, dtype=torch.bfloat16, device='cuda'), -1")
    child = subprocess.Popen([sys.executable, "-c", code.format(shape=SHAPE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        share = Decoder(KVPoolShare).decode(bytes.fromhex(child.stdout.readline()))
        assert share.cuda is not None and share.fd == -1
        own = torch.zeros(2, 3, 4, 4, 2, 8, dtype=torch.bfloat16, device="cuda")
        _copy_two_blocks(share, own)
    finally:
        _release(child)


def _copy_two_blocks(share: KVPoolShare, own: torch.Tensor) -> torch.device:
    """Map the child's CUDA pool (its values 0, 1, 2, ... in bf16), copy its blocks 5 and 2
    into `own`'s 3 and 0, check them, and drop the mapping; the mapped pool's device."""
    from gpu_workers.block_mover import gather_blocks, scatter_blocks

    mapped = map_pool(share, own)
    scatter_blocks(own, [3, 0], gather_blocks(mapped, [5, 2]))
    expected = torch.arange(mapped.numel()).reshape(SHAPE).to(torch.bfloat16)
    assert torch.equal(own[:, :, 3].cpu(), expected[:, :, 5])
    assert torch.equal(own[:, :, 0].cpu(), expected[:, :, 2])
    device = mapped.device
    del mapped
    torch.cuda.synchronize()
    return device


def _release(child: subprocess.Popen) -> None:
    """Let the pool's owner exit (after this process dropped its mapping)."""
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait(timeout=30)


def cuda_share(device: int, uuid: str) -> KVPoolShare:
    handle = CudaPoolHandle(device, b"h" * 64, 1 << 20, 0, b"/torch_1_1", 0, b"e" * 64, False,
                            uuid)
    return KVPoolShare(0, "torch.bfloat16", list(SHAPE), 1, -1, handle)


def test_the_pool_gpu_is_found_by_its_uuid_and_needs_peer_access():
    """The prefill process numbers its GPUs otherwise (its own group first): index 0 there is
    GPU "b", which the decode rank on its index 0 (GPU "a") sees as index 1."""
    uuids = ["a", "b", "c"]
    allowed = {(0, 1)}
    can_access = lambda reader, owner: (reader, owner) in allowed  # noqa: E731
    assert source_gpu(cuda_share(0, "b"), 0, uuids, can_access) == 1
    assert source_gpu(cuda_share(1, "a"), 0, uuids, can_access) == 0  # one GPU for both
    assert source_gpu(cuda_share(0, ""), 0, uuids, can_access) == 0  # no UUID: same numbering
    with pytest.raises(PoolMismatch, match=r"on cuda:2, which this rank's cuda:0 has no peer "
                       r"access to; use --kv-transfer frames"):
        source_gpu(cuda_share(0, "c"), 0, uuids, can_access)
    with pytest.raises(PoolMismatch, match=r"on GPU z, which this rank \(GPU a\) does not "
                       r"see; use --kv-transfer frames"):
        source_gpu(cuda_share(0, "z"), 0, uuids, can_access)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_cuda_ipc_copies_from_another_gpu_through_peer_access(tmp_path):
    """The prefill side in another process on GPU 1, which it numbers 0 (its own first, as
    its replica's workers see theirs); this process, the decode rank, copies on GPU 0."""
    import os

    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPU 0 has no peer access to GPU 1")
    code = CHILD.replace("memfd_pool({shape}, torch.bfloat16)",
                         "torch.zeros({shape}, dtype=torch.bfloat16, device='cuda'), -1")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1,0")
    child = subprocess.Popen([sys.executable, "-c", code.format(shape=SHAPE)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        share = Decoder(KVPoolShare).decode(bytes.fromhex(child.stdout.readline()))
        assert share.cuda.device == 0
        assert share.cuda.device_uuid == str(torch.cuda.get_device_properties(1).uuid)
        own = torch.zeros(2, 3, 4, 4, 2, 8, dtype=torch.bfloat16, device="cuda:0")
        # Opened on this rank's GPU, read over the link.
        assert _copy_two_blocks(share, own) == own.device
    finally:
        _release(child)
