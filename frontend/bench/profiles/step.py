"""Where a decode step's time goes: the runtime (Scheduler + ModelRunner) in this process on a
W1-like batch, with torch.profiler over a window of steps.

    nanopipe profile step --make-random qwen3-0.6b            # on the GPU machine
    nanopipe profile step --make-random qwen3-0.6b --json profile.json
    nanopipe profile step --model DIR --device cpu --num-seqs 4 \\
        --max-input-len 100 --max-output-len 100 --window 4,8         # CPU smoke run

W1's requests (docs/benchmarks.md) are added at once and stepped without overlap, as `nanopipe bench
throughput --modes runtime` does; steps --window FIRST,LAST (default 400,450: ~170 sequences at
~1k context on W1) run under the profiler. Printed per step: GPU time by category (attention,
GEMM, norm, rotary/kv-store, elementwise/copies, sampler, other), host launch calls and kernels,
the GPU busy fraction of the window's wall time, and the costliest kernels. On the CPU the aten
ops' self times stand in for kernels.

--make-random SHAPE   random bf16 weights of qwen3-0.6b, qwen3-8b or smollm2-135m
--json FILE           the figures as JSON (`nanopipe bench throughput` --profile-json plots them)
--trace FILE          also the Chrome trace of the window (chrome://tracing, Perfetto)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from frontend.bench.common import default_device, process
from frontend.bench.common.model_source import add_w1_shape, resolve_model_dir
from frontend.bench.common.step_profile import SAMPLER_RANGE, format_profile, summarize
from frontend.bench.common.w1_runtime import add_runtime_options, w1_runtime
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from gpu_workers.profiling.step_profiler import Ranged

MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_w1_shape(ap)
    add_runtime_options(ap)
    ap.add_argument("--window", default="400,450", help="FIRST,LAST: steps to profile")
    ap.add_argument("--json", help="write the figures here as JSON")
    ap.add_argument("--trace", help="write a Chrome trace of the window here")


def run(args: argparse.Namespace) -> list[Figure]:
    try:
        first, last = (int(x) for x in args.window.split(","))
    except ValueError:
        raise BenchUsageError(f"--window must be FIRST,LAST (two integers), "
                              f"got {args.window!r}") from None
    if not 0 <= first < last:
        raise BenchUsageError(f"--window needs 0 <= FIRST < LAST, got {first},{last}")
    device = args.device or default_device()
    cuda = device == "cuda"

    model_dir = resolve_model_dir(args, device)
    scheduler, runner = w1_runtime(args, model_dir, device)
    # The sampler inside a profiler range (its kernels counted as its own); the range keeps
    # the sampler's other attributes, which the decode graphs' sampling reads.
    runner.sampler = Ranged(SAMPLER_RANGE, runner.sampler)

    def step() -> None:
        plan = scheduler.schedule()
        if plan is None:
            raise SystemExit(f"W1 finished before step {last}: lower --window")
        process(scheduler, runner.execute(plan))

    for _ in range(first):
        step()
    running = len(scheduler.state.running)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(last - first):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    profile = summarize(prof.events(), (first, last), wall, cuda)
    print(f"{Path(model_dir).name} on {device}: {running} sequences running at step {first}; "
          f"cuda_graphs={runner.graphs is not None}")
    print(format_profile(profile, cuda), flush=True)
    result = dict(profile.as_dict(), device=device, running_at_first=running)
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return [Figure("wall_ms_per_step", round(profile.wall_ms_per_step, 4), "ms",
                   higher_is_better=False),
            Figure("device_busy_pct", round(100 * profile.gpu_busy_fraction, 2), "%")]

