"""Where a decode step's time goes: the runtime (Scheduler + ModelRunner) in this process on a
W1-like batch, with torch.profiler over a window of steps.

    python scripts/profile_step.py --make-random qwen3-0.6b            # on the GPU machine
    python scripts/profile_step.py --make-random qwen3-0.6b --json profile.json
    python scripts/profile_step.py --model DIR --device cpu --num-seqs 4 \\
        --max-input-len 100 --max-output-len 100 --window 4,8         # CPU smoke run

W1's requests (BENCHMARKS.md) are added at once and stepped without overlap, as
scripts/bench_offline.py does; steps --window FIRST,LAST (default 400,450: ~170 sequences at
~1k context on W1) run under the profiler. Printed per step: GPU time by category (attention,
GEMM, norm, rotary/kv-store, elementwise/copies, sampler, other), host launch calls and
kernels, the GPU busy fraction of the window's wall time, and the costliest kernels. On the
CPU the aten ops' self times stand in for kernels.

--make-random SHAPE   random bf16 weights of qwen3-0.6b, qwen3-8b or smollm2-135m
--json FILE           the figures as JSON (scripts/bench_pipeline.py --profile-json plots them)
--trace FILE          also the Chrome trace of the window (chrome://tracing, Perfetto)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchlib import W1_WARMUP_PROMPT, default_device, process, run
from benchlib.cli import add_model_source, add_w1_shape, resolve_model_dir
from benchlib.step_profile import SAMPLER_RANGE, format_profile, summarize
from benchlib.workloads import w1_params, w1_workload

from gpu_workers import ModelRunner, WorkerConfig
from protocol import AddRequest
from scheduler_proc import Scheduler, SchedulerConfig


def traced_sampler(sampler):
    """The runner's sampler inside a profiler range, so its kernels are counted as its own."""
    def call(logits, batch):
        with torch.profiler.record_function(SAMPLER_RANGE):
            return sampler(logits, batch)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_source(ap)
    ap.add_argument("--dtype", default=None)
    add_w1_shape(ap)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--window", default="400,450", help="FIRST,LAST: steps to profile")
    ap.add_argument("--json", help="write the figures here as JSON")
    ap.add_argument("--trace", help="write a Chrome trace of the window here")
    args = ap.parse_args()
    try:
        first, last = (int(x) for x in args.window.split(","))
    except ValueError:
        ap.error(f"--window must be FIRST,LAST (two integers), got {args.window!r}")
    if not 0 <= first < last:
        ap.error(f"--window needs 0 <= FIRST < LAST, got {first},{last}")
    device = args.device or default_device()
    cuda = device == "cuda"

    model_dir = resolve_model_dir(args, device)
    max_model_len = args.max_input_len + args.max_output_len
    config = WorkerConfig(
        model=model_dir, device=device, dtype=args.dtype, max_model_len=max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
        kv_cache_bytes=args.kv_cache_bytes, enforce_eager=args.enforce_eager)
    runner = ModelRunner(config)
    runner.sampler = traced_sampler(runner.sampler)
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=args.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, overlap=False))
    run(scheduler, runner, [(W1_WARMUP_PROMPT, w1_params(16))], 1 << 40)
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len,
                       runner.model_config.vocab_size)
    eos = list(runner.model_config.eos_token_ids)
    for k, (prompt, max_tokens) in enumerate(work):
        scheduler.add_request(AddRequest(k, prompt, w1_params(max_tokens), eos))

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


if __name__ == "__main__":
    main()
