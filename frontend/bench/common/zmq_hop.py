"""One ZeroMQ hop carrying a real protocol message: a spawned process and this one ping-pong
a StepResult (one token) and a decode StepPlan over PUSH/PULL on ipc:// in a private temp dir;
one hop is encode + send + recv + decode, the median round trip / 2 (W4 prints it)."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
import tempfile
import time

from protocol import (
    CachedSequences,
    StepPlan,
    StepResult,
    encode,
)


def hop_messages(plan_seqs: int) -> list[tuple[str, object]]:
    ids = list(range(1_000_000, 1_000_000 + plan_seqs))
    new_blocks = [[7_000 + i] if i % 16 == 0 else [] for i in range(plan_seqs)]
    return [
        ("StepResult (1 token)", StepResult(12345, [1_000_000], [4242], None)),
        (f"StepPlan ({plan_seqs} decode seqs)",
         StepPlan(12345, [], [], CachedSequences(ids, [1] * plan_seqs, new_blocks))),
    ]


def _echo(inbound: str, outbound: str, counts: list[int]) -> None:
    """The far end: receive and decode each message, then encode and send it back."""
    import zmq

    from protocol.sockets import MessageSocket

    ctx = zmq.Context()
    pull = MessageSocket(ctx, zmq.PULL, inbound, bind=True, accepts=(StepPlan, StepResult))
    push = MessageSocket(ctx, zmq.PUSH, outbound, bind=False)
    try:
        for count in counts:
            for _ in range(count):
                push.send(pull.recv())
    finally:
        pull.close()
        push.close()
        ctx.term()


def bench_hop(iters: int, warmup: int, plan_seqs: int) -> list[dict]:
    import zmq

    from protocol.sockets import MessageSocket

    messages = hop_messages(plan_seqs)
    run_dir = tempfile.mkdtemp(prefix="nanopipe-hop-")  # mode 0700: private to this user
    ping, pong = f"ipc://{run_dir}/ping", f"ipc://{run_dir}/pong"
    ctx = zmq.Context()
    pull = MessageSocket(ctx, zmq.PULL, pong, bind=True, accepts=(StepPlan, StepResult))
    child = mp.get_context("spawn").Process(
        target=_echo, args=(ping, pong, [warmup + iters] * len(messages)), daemon=True)
    child.start()
    push = MessageSocket(ctx, zmq.PUSH, ping, bind=False)
    out = []
    try:
        for name, msg in messages:
            times = []
            for k in range(warmup + iters):
                start = time.perf_counter()
                push.send(msg)
                back = pull.recv()
                elapsed = time.perf_counter() - start
                if k >= warmup:
                    times.append(elapsed)
            if back != msg:
                raise RuntimeError(f"{name}: the echoed message differs from the one sent")
            out.append(dict(message=name, bytes=len(encode(msg)),
                            hop_us=round(statistics.median(times) / 2 * 1e6, 2),
                            round_trip_p99_us=round(sorted(times)[int(0.99 * len(times))]
                                                    * 1e6, 2)))
        child.join(10)
    finally:
        if child.is_alive():
            child.terminate()
            child.join()
        push.close()
        pull.close()
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


