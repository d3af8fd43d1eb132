"""W3 shared prefix: many requests behind one long common prefix (a system prompt), run with
the prefix cache on and off in the same run, through the scheduler and the runtime.

    nanopipe bench prefix                                    # embedded SmolLM2, CPU
    nanopipe bench prefix --make-random qwen3-0.6b --num-requests 256 \\
        --prefix-len 2048 --max-tokens 128                            # on the GPU machine

One request goes first (it computes the prefix and leaves it in the cache, as an earlier
conversation would), then all the others at once. Each request is the shared prefix plus its
own seeded suffix and asks for --max-tokens greedy tokens (ignore_eos). Measured per mode:
prompt tokens the runtime computed (counted from the plans it executed), wall time, output
tok/s; then the prefill tokens the cache saved and the speed-up, same run, same requests.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from frontend.bench.common import drain, greedy, random_ids, random_prompts
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from gpu_workers import ModelRunner, WorkerConfig
from protocol import AddRequest
from scheduler_proc import Scheduler, SchedulerConfig


class CountingRunner:
    """Counts the tokens each executed plan computed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.computed = 0

    def execute(self, plan):
        self.computed += sum(s.num_new for s in plan.new_seqs) + sum(plan.cached.num_new)
        return self.runner.execute(plan)


def run_mode(runner: ModelRunner, caching: bool, requests: list[AddRequest],
             args: argparse.Namespace) -> dict:
    cfg = runner.config
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len, enable_prefix_caching=caching, overlap=False))
    counting = CountingRunner(runner)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    scheduler.add_request(requests[0])
    produced = drain(scheduler, counting)
    for req in requests[1:]:
        scheduler.add_request(req)
    produced += drain(scheduler, counting)
    sync()
    elapsed = time.perf_counter() - start
    # Every output token but each request's first is a one-token decode computation.
    prefill = counting.computed - (produced - len(requests))
    return dict(prefix_cache=caching, requests=len(requests),
                prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                prefill_tokens_computed=prefill, output_tokens=produced,
                seconds=round(elapsed, 3), output_tok_s=round(produced / elapsed, 1))


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len-range", type=int, nargs=2, default=[16, 64],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[Figure]:
    lo, hi = args.suffix_len_range
    if args.num_requests < 2 or args.prefix_len < 1 or not 1 <= lo <= hi:
        raise BenchUsageError("need --num-requests >= 2, --prefix-len >= 1 and 1 <= MIN <= MAX")

    model_dir = resolve_model_dir(args, args.device)
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    max_model_len = args.prefix_len + hi + args.max_tokens
    block_size = args.block_size or (256 if args.device == "cuda" else 16)
    runner = ModelRunner(WorkerConfig(
        model=model_dir, device=args.device, max_model_len=max_model_len, block_size=block_size,
        max_num_seqs=args.num_requests, max_num_batched_tokens=max(8192, max_model_len),
        kv_cache_bytes=None if args.device == "cuda" else 1 << 30))
    vocab = runner.model_config.vocab_size
    rng = random.Random(args.seed)
    prefix = random_ids(rng, args.prefix_len, vocab)
    params = greedy(args.max_tokens)
    eos = list(runner.model_config.eos_token_ids)
    requests = [AddRequest(k, prefix + suffix, params, eos) for k, suffix
                in enumerate(random_prompts(rng, args.num_requests, lo, hi, vocab))]
    print(f"W3 shared prefix: {Path(model_dir).name} on {args.device}, {len(requests)} requests, "
          f"prefix {args.prefix_len} + suffix {lo}-{hi} tokens, {args.max_tokens} output tokens "
          f"each, block size {block_size}; {time.strftime('%Y-%m-%d')}", flush=True)
    warm = [AddRequest((1 << 40) + k, [1, 2, 3, 4], params, eos) for k in range(2)]
    run_mode(runner, False, warm, args)  # compile / warm the kernels, off the clock
    results = {}
    for caching in (True, False):
        r = results[caching] = run_mode(runner, caching, requests, args)
        print(f"prefix cache {'on ' if caching else 'off'}: {r['prefill_tokens_computed']} of "
              f"{r['prompt_tokens']} prompt tokens computed, {r['output_tok_s']:.1f} output "
              f"tok/s ({r['seconds']:.2f} s)", flush=True)
        print(json.dumps(r), flush=True)
    on, off = results[True], results[False]
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    speedup = off["seconds"] / on["seconds"]
    print(f"the prefix cache saved {saved:.1%} of the prefill tokens; {speedup:.2f}x faster "
          f"end to end (same run)", flush=True)
    print(json.dumps(dict(result="w3", prefill_saved=round(saved, 4),
                          speedup=round(speedup, 3))), flush=True)
    return [Figure("prefill_saved_pct", round(100 * saved, 2), "%"),
            Figure("output_tok_s", on["output_tok_s"], "tok/s"),
            Figure("output_tok_s[cache off]", off["output_tok_s"], "tok/s"),
            Figure("speedup", round(speedup, 3), "x")]

