"""W1 offline throughput: the scheduler and the model runner driven in one process.

    python scripts/bench_offline.py --make-random qwen3-0.6b        # on the GPU machine
    python scripts/bench_offline.py --model DIR --num-seqs 4 --max-input-len 64 \\
        --max-output-len 32 --device cpu                              # CPU smoke run

Workload (BENCHMARKS.md): random.seed(0); for each of 256 sequences a prompt of
randint(100, 1024) tokens each randint(0, 10000); then for each max_tokens = randint(100, 1024);
temperature 0.6, ignore_eos; one warm-up request first. It prints output tok/s and the ratio to
the hardware bound of this very workload: the KV cache of every sequence read once per decode
step plus the weights once per step at the copy bandwidth, plus the prefill FLOPs at the matmul
rate (H200: 4.3 TB/s, 790 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from benchlib import (
    W1_WARMUP_PROMPT,
    Throughput,
    default_device,
    hardware_bound_s,
    run,
    w1_params,
    w1_workload,
)
from benchlib.cli import add_model_source, add_w1_shape, resolve_model_dir

from gpu_workers import ModelRunner, WorkerConfig
from scheduler_proc import Scheduler, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_source(ap, device_default=default_device(), out=True)
    ap.add_argument("--dtype", default=None)
    add_w1_shape(ap)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()

    model_dir = resolve_model_dir(args, args.device, args.out)
    block_size = args.block_size or (
        256 if args.device == "cuda" and args.attention_backend == "flash_attn" else 16)
    max_model_len = args.max_input_len + args.max_output_len
    config = WorkerConfig(
        model=model_dir, device=args.device, dtype=args.dtype, max_model_len=max_model_len,
        block_size=block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(config)
    print(f"start-up {time.perf_counter() - t0:.1f} s: backend={runner.backend} "
          f"kv_blocks={runner.num_kv_blocks} block_size={block_size} "
          f"cuda_graphs={runner.graphs is not None}")
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, overlap=False,
    ))
    run(scheduler, runner, [(W1_WARMUP_PROMPT, w1_params(16))], 1 << 40)
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len,
                       runner.model_config.vocab_size)
    reqs = [(p, w1_params(m)) for p, m in work]
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    produced = run(scheduler, runner, reqs, 0)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    num_params = sum(p.numel() for p in runner.model.parameters()) * runner.world_size
    bound_s, parts = hardware_bound_s(runner.model_config, num_params, work)
    t = Throughput(produced, elapsed, bound_s)
    print(json.dumps(dict(
        num_seqs=len(work), prompt_tokens=sum(len(p) for p, _ in work), output_tokens=produced,
        seconds=round(elapsed, 3), output_tok_s=round(t.tok_s, 1),
        hardware_bound_s=round(bound_s, 3), hardware_bound_tok_s=round(t.bound_tok_s, 1),
        ratio_to_bound=round(t.ratio, 4), **{k: round(v, 3) for k, v in parts.items()},
    ), indent=1))
    print(f"Throughput: {t.tok_s:.1f} output tok/s ({produced} tokens in {elapsed:.2f} s); "
          f"hardware bound {t.bound_tok_s:.0f} tok/s (H200 figures); ratio {t.ratio:.3f}")


if __name__ == "__main__":
    main()
