"""KV hand-offs as frames land a bounded amount per pause between steps: a long prompt's
chunks wait in the socket for the decode rank's next pumps instead of stalling one step,
and the request is reported once its last chunk landed, with every block in place."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import zmq
from test_kv_shared_copy import SHAPE, patterned, runtime

from gpu_workers import kv_ends, kv_frames
from gpu_workers.kv_frames import FramesReceiver, FramesSender
from protocol.kv_handoff import KVExport, KVLanded, KVLinks


def test_a_request_lands_one_chunk_per_pump(tmp_path, monkeypatch):
    prefill = patterned(torch.zeros(SHAPE))
    block_bytes = prefill[:, :, 0].numel() * prefill.element_size()
    monkeypatch.setattr(kv_frames, "MAX_CHUNK_BYTES", block_bytes)  # a chunk per block
    monkeypatch.setattr(kv_ends, "LAND_BYTES_PER_PUMP", block_bytes)
    decode = torch.zeros(2, 3, 9, 4, 2, 8)
    rt = runtime()
    try:
        transfer = ("", f"ipc://{tmp_path}/kv_r0")
        endpoints = SimpleNamespace(keys=None, scheduler_in=f"ipc://{tmp_path}/sched")
        scheduler = rt.socket(zmq.PULL, endpoints.scheduler_in, bind=True,
                              accepts=(KVLanded,))
        receiver = FramesReceiver(rt, KVLinks("decode", 1, transfer=transfer), decode, 0,
                                  endpoints)
        sender = FramesSender(rt, KVLinks("prefill", 0, transfer=transfer), prefill, None)
        src, dest = [4, 1, 2, 5], [0, 8, 3, 6]
        sender.export(KVExport(7, src, 1, dest))
        deadline = time.monotonic() + 10
        while receiver.sock.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # every chunk queued at the receiver
        for pumps, (s, d) in enumerate(zip(src, dest), 1):
            receiver.pump()
            assert torch.equal(decode[:, :, d], prefill[:, :, s])
            landed = decode.flatten(3).abs().sum((0, 1, 3)).nonzero().flatten().tolist()
            assert sorted(landed) == sorted(dest[:pumps])  # this pump's chunk, no more
            assert scheduler.poll(50 if pumps == len(src) else 0) == (pumps == len(src))
        assert scheduler.recv() == KVLanded(7, 0, len(src) * block_bytes, True, "")
    finally:
        rt.close()
