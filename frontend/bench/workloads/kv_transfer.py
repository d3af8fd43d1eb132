"""KV hand-off transfers alone: a prefill rank's blocks moved to a decode rank in another
process by each transfer mode, with the workers' own classes (gpu_workers.kv_frames,
gpu_workers.kv_shared_copy) and no scheduler or model around them.

    nanopipe bench kv-transfer                                  # the embedded model's shape
    nanopipe bench kv-transfer --shape qwen3-0.6b --tokens 8192 --device cuda
    nanopipe bench kv-transfer --shape qwen3-0.6b --tokens 8192 --device cuda --across-gpus

The prefill side runs in a child process (a shared pool is mapped from another process: CUDA
IPC cannot open a handle in the process that made it, and the CPU's memfd is opened through
/proc). This process is the decode rank and its scheduler: per request it tells the child to
export --tokens tokens of KV (one KVExport, as the prefill scheduler sends), then pumps its
receiver until the landing report arrives. Timed: that whole round, so the bandwidth is the
KV bytes of a request over it, and the cost per request is its median. On one GPU both
processes share the device, as one H200 does with --prefill-replicas 1 --decode-replicas 1.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import zmq

from frontend.bench.common.random_model import SHAPES
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from protocol.kv_handoff import KV_TRANSFER_MODES, KVExport, KVLanded, KVLinks
from protocol.process_runtime import ProcessRuntime

MODEL = "none"
BLOCK_SIZE = 16


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m",
                    help="the model shape whose KV moves (layers, KV heads, head size)")
    ap.add_argument("--tokens", type=int, default=2048, help="KV tokens per request")
    ap.add_argument("--requests", type=int, default=8, help="timed requests per mode")
    ap.add_argument("--modes", default=",".join(KV_TRANSFER_MODES),
                    type=lambda s: s.split(","), help="comma-separated, of "
                    f"{list(KV_TRANSFER_MODES)}")
    ap.add_argument("--dtype", default=None,
                    help="the KV's dtype (default: bfloat16 on cuda, float32 on the cpu)")
    ap.add_argument("--across-gpus", action="store_true",
                    help="cuda: the prefill side on the second visible GPU, this process on "
                    "the first (shared: read through peer access, as replicas with GPUs of "
                    "their own do)")


def pool_shape(shape: str, num_blocks: int) -> tuple[int, ...]:
    c = SHAPES[shape]
    return (2, c["num_hidden_layers"], num_blocks, BLOCK_SIZE, c["num_key_value_heads"],
            c["head_dim"])


def runtime() -> ProcessRuntime:
    """A runtime made off the main thread: it leaves this process's signals alone."""
    made: list[ProcessRuntime] = []
    t = threading.Thread(target=lambda: made.append(ProcessRuntime("bench")))
    t.start()
    t.join()
    return made[0]


def links(role: str, replica: int, address: str, mode: str) -> KVLinks:
    return KVLinks(role, replica, transfer=("", address), mode=mode)


def serve_prefill(mode: str, shape: str, num_blocks: int, device: str, dtype: str,
                  address: str) -> None:
    """The child: a prefill rank's pool of random KV and its sender; each line on stdin is
    one export of the blocks it names, answered by a line once it is sent."""
    from gpu_workers.kv_frames import FramesSender
    from gpu_workers.kv_shared_copy import SharedSender
    from gpu_workers.kv_shared_pool import memfd_pool

    kv_dtype = getattr(torch, dtype)
    dims = pool_shape(shape, num_blocks)
    memfd = -1
    if device == "cpu" and mode == "shared":
        pool, memfd = memfd_pool(dims, kv_dtype)
    else:
        pool = torch.empty(dims, dtype=kv_dtype, device=device)
    pool.copy_(torch.randn(dims, device=device).to(kv_dtype))
    rt = runtime()
    link = links("prefill", 0, address, mode)
    sender = (SharedSender(rt, link, pool, memfd, None) if mode == "shared"
              else FramesSender(rt, link, pool, None))
    print("ready", flush=True)
    for line in sys.stdin:
        rid, *blocks = map(int, line.split())
        half = len(blocks) // 2
        sender.export(KVExport(rid, blocks[:half], 1, blocks[half:]))
        while sender.busy:
            sender.pump()
            time.sleep(0.0001)
        print("sent", flush=True)
    rt.close()


def run_mode(args: argparse.Namespace, mode: str, tmp: str) -> dict:
    from gpu_workers.kv_frames import FramesReceiver
    from gpu_workers.kv_shared_copy import SharedReceiver

    per_request = math.ceil(args.tokens / BLOCK_SIZE)
    address, sched = f"ipc://{tmp}/{mode}_kv", f"ipc://{tmp}/{mode}_sched"
    code = ("from frontend.bench.workloads.kv_transfer import serve_prefill; "
            f"serve_prefill({mode!r}, {args.shape!r}, {2 * per_request}, {args.device!r}, "
            f"{args.dtype!r}, {address!r})")
    env = None
    if args.across_gpus:  # the child's own GPU first, as its replica's workers would see it
        from frontend.engine.torch_build import visible_gpus

        gpus = visible_gpus()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join([gpus[1], gpus[0], *gpus[2:]]))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    rt, receiver = runtime(), None
    try:
        pool = torch.zeros(pool_shape(args.shape, 2 * per_request),
                           dtype=getattr(torch, args.dtype), device=args.device)
        scheduler = rt.socket(zmq.PULL, sched, bind=True, accepts=(KVLanded,))
        endpoints = SimpleNamespace(keys=None, scheduler_in=sched)
        receiver = (SharedReceiver if mode == "shared" else FramesReceiver)(
            rt, links("decode", 1, address, mode), pool, 0, endpoints)
        if child.stdout.readline().strip() != "ready":
            raise BenchUsageError(f"the prefill side of {mode} did not start")
        times, num_bytes = [], 0
        for rid in range(args.requests + 1):  # the first one warms both sides up
            src = list(range(per_request)) if rid % 2 else list(range(per_request,
                                                                       2 * per_request))
            dest = src[::-1]
            start = time.perf_counter()
            child.stdin.write(" ".join(map(str, [rid, *src, *dest])) + "\n")
            child.stdin.flush()
            landed = None
            while landed is None:
                receiver.pump()
                if scheduler.poll(0):
                    landed = scheduler.recv()
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if not landed.ok:
                raise BenchUsageError(f"{mode}: the transfer was refused: {landed.error}")
            child.stdout.readline()
            if rid:
                times.append(elapsed)
                num_bytes = landed.num_bytes
    finally:
        if receiver is not None:  # its mapping of the child's pool goes before the child
            receiver.close()
        child.stdin.close()
        child.wait(timeout=30)
        rt.close()
    median = statistics.median(times)
    return dict(mode=mode, bytes=num_bytes, ms=round(median * 1e3, 3),
                gib_s=round(num_bytes / median / 2**30, 3))


def run(args: argparse.Namespace) -> list[Figure]:
    unknown = [m for m in args.modes if m not in KV_TRANSFER_MODES]
    if unknown or args.tokens < 1 or args.requests < 1:
        raise BenchUsageError(f"--modes of {list(KV_TRANSFER_MODES)}, --tokens and "
                              "--requests >= 1")
    if args.across_gpus and (args.device != "cuda" or torch.cuda.device_count() < 2):
        raise BenchUsageError("--across-gpus needs --device cuda and two visible GPUs")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise BenchUsageError(f"--dtype {args.dtype}: not a torch dtype (e.g. bfloat16)")
    where = f"{args.device}, across two GPUs" if args.across_gpus else args.device
    print(f"KV transfer of {args.tokens} tokens of the {args.shape} shape ({args.dtype}) per "
          f"request, {args.requests} requests per mode, {where}; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    figures, results = [], {}
    with tempfile.TemporaryDirectory(prefix="nanopipe-kv-transfer-") as tmp:
        for mode in args.modes:
            r = results[mode] = run_mode(args, mode, tmp)
            print(f"{mode}: {r['bytes'] / 2**20:,.1f} MiB per request in {r['ms']} ms "
                  f"(median), {r['gib_s']} GiB/s", flush=True)
            figures += [Figure(f"gib_s[{mode}]", r["gib_s"], "GiB/s"),
                        Figure(f"ms_per_request[{mode}]", r["ms"], "ms",
                               higher_is_better=False)]
    if len(results) == 2:
        ratio = results["frames"]["ms"] / results["shared"]["ms"]
        print(f"shared moves a request {ratio:.2f}x as fast as frames (same run)", flush=True)
        figures.append(Figure("shared_speedup", round(ratio, 3), "x"))
    return figures
