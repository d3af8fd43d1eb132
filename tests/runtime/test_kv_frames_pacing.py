"""KV hand-offs as frames land a bounded amount per pause between steps: a long prompt's
chunks wait in the socket for the decode rank's next pumps instead of stalling one step,
and the request is reported once its last chunk landed, with every block in place."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import torch
import zmq
from test_kv_shared_copy import SHAPE, patterned, runtime

from gpu_workers import kv_ends, kv_frames
from gpu_workers.kv_frames import FramesReceiver, FramesSender
from protocol.kv_handoff import KVExport, KVLanded, KVLinks


def _frames_link(rt, tmp_path, prefill: torch.Tensor, decode: torch.Tensor):
    """A prefill rank's sender and a decode rank's receiver over one ipc socket, and the
    scheduler's socket the landings are reported on."""
    transfer = ("", f"ipc://{tmp_path}/kv_r0")
    endpoints = SimpleNamespace(keys=None, scheduler_in=f"ipc://{tmp_path}/sched")
    scheduler = rt.socket(zmq.PULL, endpoints.scheduler_in, bind=True, accepts=(KVLanded,))
    receiver = FramesReceiver(rt, KVLinks("decode", 1, transfer=transfer), decode, 0,
                              endpoints)
    sender = FramesSender(rt, KVLinks("prefill", 0, transfer=transfer), prefill, None)
    return scheduler, receiver, sender


def test_a_request_lands_one_chunk_per_pump(tmp_path, monkeypatch):
    prefill = patterned(torch.zeros(SHAPE))
    block_bytes = prefill[:, :, 0].numel() * prefill.element_size()
    monkeypatch.setattr(kv_frames, "MAX_CHUNK_BYTES", block_bytes)  # a chunk per block
    monkeypatch.setattr(kv_ends, "LAND_BYTES_PER_PUMP", block_bytes)
    decode = torch.zeros(2, 3, 9, 4, 2, 8)
    rt = runtime()
    try:
        scheduler, receiver, sender = _frames_link(rt, tmp_path, prefill, decode)
        src, dest = [4, 1, 2, 5], [0, 8, 3, 6]
        sender.export(KVExport(7, src, 1, dest))
        for pumps, (s, d) in enumerate(zip(src, dest), 1):
            sender.pump()
            assert receiver.sock.socket.poll(5000)  # a chunk is here
            time.sleep(0.05)
            receiver.pump()
            assert torch.equal(decode[:, :, d], prefill[:, :, s])
            landed = decode.flatten(3).abs().sum((0, 1, 3)).nonzero().flatten().tolist()
            assert sorted(landed) == sorted(dest[:pumps])  # this pump's chunk, no more
            assert scheduler.poll(50 if pumps == len(src) else 0) == (pumps == len(src))
        assert scheduler.recv() == KVLanded(7, 0, len(src) * block_bytes, True, "")
    finally:
        rt.close()


def test_a_short_export_overtakes_a_long_one(tmp_path, monkeypatch):
    """A long prompt's ten chunks exported, then a short one's single chunk: with only a few
    chunks queued in the sockets, the short one lands while most of the long one still
    waits at the prefill rank, and both land whole."""
    shape = (2, 3, 16, 4, 2, 8)
    prefill = patterned(torch.zeros(shape))
    block_bytes = prefill[:, :, 0].numel() * prefill.element_size()
    monkeypatch.setattr(kv_frames, "MAX_CHUNK_BYTES", block_bytes)
    monkeypatch.setattr(kv_ends, "LAND_BYTES_PER_PUMP", block_bytes)
    decode = torch.zeros(shape)
    rt = runtime()
    try:
        scheduler, receiver, sender = _frames_link(rt, tmp_path, prefill, decode)
        long_src, long_dest = list(range(10)), list(range(15, 5, -1))
        sender.export(KVExport(1, long_src, 1, long_dest))
        time.sleep(0.2)
        sender.pump()
        sender.export(KVExport(2, [12], 1, [0]))
        assert sender.busy  # the long one's later chunks wait here, not in the sockets
        order, deadline = [], time.monotonic() + 10
        while len(order) < 2:
            assert time.monotonic() < deadline
            sender.pump()
            receiver.pump()
            while scheduler.poll(1):
                order.append((scheduler.recv().request_id, long_chunks_landed(decode)))
        assert [rid for rid, _ in order] == [2, 1]
        assert order[0][1] < len(long_src)  # the short one did not wait for all of them
        assert torch.equal(decode[:, :, 0], prefill[:, :, 12])
        for s, d in zip(long_src, long_dest):
            assert torch.equal(decode[:, :, d], prefill[:, :, s])
    finally:
        rt.close()


def long_chunks_landed(decode: torch.Tensor) -> int:
    return int((decode[:, :, 6:16].flatten(3).abs().sum((0, 1, 3)) > 0).sum())


def test_the_next_chunk_is_the_gathered_export_with_the_fewest_bytes_left():
    done, pending = SimpleNamespace(query=lambda: True), SimpleNamespace(query=lambda: False)
    a, b = object(), object()
    staged = [kv_frames._Outgoing(1, a, deque([(None, b"", None)]), 500),
              kv_frames._Outgoing(2, a, deque([(pending, b"", None)]), 10),
              kv_frames._Outgoing(3, b, deque([(done, b"", None)]), 100),
              kv_frames._Outgoing(4, a, deque([(done, b"", None)]), 100)]
    assert kv_frames.next_to_send(staged, set()).request_id == 3  # 2 is not gathered yet
    assert kv_frames.next_to_send(staged, {b}).request_id == 4
    assert kv_frames.next_to_send(staged, {a, b}) is None
