"""Measures the first CUDA device's copy bandwidth and bf16 matmul rate and prints them as one
JSON line (DeviceCeilings.record()). frontend.bench.ceilings runs it as a child process:

    python -m frontend.bench.ceilings_probe

Each rate is the best of several repeats after a warm-up, each repeat timed with CUDA
events: the best shows what the device can do, where a mean would also count a clock still
rising or a neighbour's work. Without a CUDA device it prints the nominal figures.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from frontend.bench.ceilings import NOMINAL, DeviceCeilings

COPY_BYTES = 1 << 30
"""The copied buffer: far larger than any cache, so every byte goes to and from DRAM."""
MATMUL_N = 8192
"""The matrix side: large enough for cuBLAS to reach its peak on a Hopper GPU."""
WARMUP, REPEATS = 3, 10


def best_seconds(fn: Callable[[], object], warmup: int = WARMUP,
                 repeats: int = REPEATS) -> float:
    """The shortest of `repeats` timed calls of `fn`, after `warmup` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def copy_seconds(nbytes: int, device) -> float:
    """The best time of one copy of `nbytes` from one buffer to another on `device`."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return best_seconds(lambda: dst.copy_(src))


def matmul_seconds(n: int, device) -> float:
    """The best time of one bf16 product of two random n × n matrices on `device`."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    return best_seconds(lambda: torch.mm(a, b, out=out))


def measure(copy_bytes: int = COPY_BYTES, matmul_n: int = MATMUL_N) -> DeviceCeilings:
    """The first CUDA device's ceilings (NOMINAL without one), its memory given back before
    returning. The copy counts the bytes read and the bytes written, 2 × copy_bytes a copy:
    see DeviceCeilings.copy_bytes_per_s."""
    import torch

    if not torch.cuda.is_available():
        return NOMINAL
    device = torch.device("cuda", 0)
    try:
        copy_s = copy_seconds(copy_bytes, device)  # each frees its buffers as it returns
        matmul_s = matmul_seconds(matmul_n, device)
    finally:
        torch.cuda.empty_cache()
    return DeviceCeilings(copy_bytes_per_s=2 * copy_bytes / copy_s,
                          matmul_flops_per_s=2 * matmul_n**3 / matmul_s,
                          device_name=torch.cuda.get_device_name(device), measured=True)


if __name__ == "__main__":
    print(json.dumps(measure().record()), flush=True)
