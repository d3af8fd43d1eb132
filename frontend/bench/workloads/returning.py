"""W8 returning conversations: N conversations, each a long context that its user returns to
after the other conversations have pushed it out of the device pool; host tier on vs off in
the same run, through the scheduler and the runtime.

    nanopipe bench returning                                    # embedded SmolLM2, CPU
    nanopipe bench returning --make-random qwen3-0.6b --context-len 8192 \\
        --num-conversations 16                                       # on the GPU machine

The scheduler manages a device pool of a quarter of the contexts (the runner's pool may be
larger; the blocks past that are left unused) and a host tier that holds all of them. Every
conversation takes a first turn, one at a time, then each returns for a second turn, one at a
time. Measured per mode: prefill tokens computed in the returning turns, their TTFT p50 / p99
(from the request's arrival to its first token) and output tok/s over the run; the greedy
tokens of the two modes must be identical (on cuda, in bf16, against a third run whose device
pool keeps every context: a cached prefix and a recomputed one round differently there). On
cuda it also prints the tier's host-to-device load bandwidth against a plain pinned copy_.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from frontend.bench.common import drain, greedy, random_ids
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from gpu_workers import ModelRunner, WorkerConfig
from gpu_workers.config import ModelConfig
from protocol import AddRequest
from scheduler_proc import Scheduler, SchedulerConfig

MODEL = "optional"


class CountingRunner:
    """Counts the tokens each executed plan computed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.computed = 0

    def execute(self, plan):
        self.computed += sum(s.num_new for s in plan.new_seqs) + sum(plan.cached.num_new)
        return self.runner.execute(plan)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-conversations", type=int, default=8)
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)


def _turn(scheduler: Scheduler, counting: CountingRunner, req: AddRequest,
          sync, tokens: list[int]) -> tuple[float, int, int]:
    """One request alone: its TTFT, the prefill tokens it computed and the tokens it made
    (appended to `tokens`)."""
    before = counting.computed
    first: list[float] = []
    start = time.perf_counter()
    scheduler.add_request(req)

    def on_deltas(deltas) -> None:
        if not first and any(deltas.token_ids):
            sync()
            first.append(time.perf_counter() - start)
        for t in deltas.token_ids:
            tokens.extend(t)

    produced = drain(scheduler, counting, on_deltas)
    return first[0], counting.computed - before - (produced - 1), produced


def run_mode(runner: ModelRunner, host_slots: int, num_blocks: int,
             conversations: list[list[int]], args: argparse.Namespace, eos: list[int]) -> dict:
    cfg = runner.config
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
        overlap=False, num_host_slots=host_slots))
    counting = CountingRunner(runner)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    params = greedy(args.max_tokens)
    rng = random.Random(args.seed + 1)
    vocab = runner.model_config.vocab_size
    questions = [[random_ids(rng, args.question_len, vocab) for _ in conversations]
                 for _turn_no in (1, 2)]
    sync()
    start = time.perf_counter()
    produced, ttfts, prefill, outputs = 0, [], 0, []
    for turn in (0, 1):
        for k, ctx in enumerate(conversations):
            req = AddRequest(turn * len(conversations) + k, ctx + questions[turn][k], params, eos)
            ttft, computed, made = _turn(scheduler, counting, req, sync, outputs)
            produced += made
            if turn == 1:
                ttfts.append(ttft)
                prefill += computed
    sync()
    elapsed = time.perf_counter() - start
    ttfts.sort()
    returning_prompt = len(conversations) * (args.context_len + args.question_len)
    return dict(host_tier=bool(host_slots), returning_prompt_tokens=returning_prompt,
                returning_prefill_computed=prefill,
                ttft_p50_ms=round(1000 * statistics.median(ttfts), 2),
                ttft_p99_ms=round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 2),
                output_tok_s=round(produced / elapsed, 1), seconds=round(elapsed, 3),
                tokens=outputs)


def run(args: argparse.Namespace) -> list[Figure]:
    if args.num_conversations < 4 or args.context_len < 1 or args.question_len < 1:
        raise BenchUsageError("need --num-conversations >= 4, --context-len >= 1 and "
                              "--question-len >= 1")
    model_dir = resolve_model_dir(args, args.device)
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    block_size = args.block_size or (256 if args.device == "cuda" else 16)
    max_model_len = args.context_len + args.question_len + args.max_tokens
    per_conv = -(-max_model_len // block_size)
    block_bytes = ModelConfig.from_dir(model_dir).kv_bytes_per_token() * block_size
    host_gib = 1.1 * args.num_conversations * per_conv * block_bytes / 2**30
    runner = ModelRunner(WorkerConfig(
        model=model_dir, device=args.device, max_model_len=max_model_len, block_size=block_size,
        max_num_seqs=4, max_num_batched_tokens=max(8192, max_model_len),
        kv_cache_bytes=None if args.device == "cuda" else (2 * args.num_conversations * per_conv
                                                           * block_bytes),
        kv_offloading_size=host_gib))
    num_blocks = max(per_conv + 1, args.num_conversations * per_conv // 4)
    if num_blocks > runner.num_kv_blocks:
        raise BenchUsageError(f"the device pool has {runner.num_kv_blocks} blocks; W8 needs "
                              f"{num_blocks}")
    rng = random.Random(args.seed)
    vocab = runner.model_config.vocab_size
    conversations = [random_ids(rng, args.context_len, vocab)
                     for _ in range(args.num_conversations)]
    eos = list(runner.model_config.eos_token_ids)
    print(f"W8 returning conversations: {Path(model_dir).name} on {args.device}, "
          f"{args.num_conversations} contexts of {args.context_len} tokens + "
          f"{args.question_len}-token questions, {args.max_tokens} output tokens, device pool "
          f"{num_blocks} blocks of {block_size}, host tier {runner.num_host_slots} blocks; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    warm = [[1, 2, 3, 4] * 4] * 4
    run_mode(runner, 0, num_blocks, warm, argparse.Namespace(**{**vars(args), "context_len": 16}),
             eos)  # compile / warm the kernels, off the clock
    results = {}
    for slots in (runner.num_host_slots, 0):
        r = results[bool(slots)] = run_mode(runner, slots, num_blocks, conversations, args, eos)
        print(f"host tier {'on ' if slots else 'off'}: returning turns computed "
              f"{r['returning_prefill_computed']} of {r['returning_prompt_tokens']} prompt "
              f"tokens, TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, "
              f"{r['output_tok_s']} output tok/s", flush=True)
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    on, off = results[True], results[False]
    same_as = off
    if runner.device.type == "cuda":
        # In bf16 a prompt computed whole and one computed after a cached prefix take different
        # kernels and round differently; the tier must give exactly the tokens of a device-cache
        # hit, which takes the same path as a host-tier hit.
        big = len(conversations) * per_conv
        if big > runner.num_kv_blocks:
            raise BenchUsageError(f"the device pool has {runner.num_kv_blocks} blocks; the "
                                  f"device-cache reference needs {big}")
        same_as = run_mode(runner, 0, big, conversations, args, eos)
        print(f"device cache: TTFT p50 {same_as['ttft_p50_ms']} ms (every context kept in a "
              "device pool large enough)", flush=True)
    reference = "the device cache" if same_as is not off else "the host tier off"
    if on["tokens"] != same_as["tokens"]:
        raise RuntimeError(f"greedy tokens differ with the host tier on and {reference}")
    print(f"greedy tokens identical with the host tier on and {reference}", flush=True)
    bandwidth = load_bandwidth(runner, per_conv) if runner.device.type == "cuda" else []
    served = 1 - on["returning_prefill_computed"] / on["returning_prompt_tokens"]
    ttft_ratio = on["ttft_p50_ms"] / off["ttft_p50_ms"]
    print(f"the host tier served {served:.1%} of the returning turns' prefill; returning TTFT "
          f"p50 is {ttft_ratio:.1%} of recompute (same run)", flush=True)
    return [Figure("host_served_pct", round(100 * served, 2), "%"),
            Figure("ttft_ratio_pct", round(100 * ttft_ratio, 2), "%", higher_is_better=False),
            Figure("ttft_p50_ms", on["ttft_p50_ms"], "ms", higher_is_better=False),
            Figure("ttft_p50_ms[tier off]", off["ttft_p50_ms"], "ms", higher_is_better=False),
            Figure("output_tok_s", on["output_tok_s"], "tok/s"),
            Figure("output_tok_s[tier off]", off["output_tok_s"], "tok/s"), *bandwidth]


def load_bandwidth(runner: ModelRunner, num_blocks: int) -> list[Figure]:
    """Host-to-device bandwidth of the tier's load of one context's blocks against a plain
    pinned copy_ of the same bytes, on the same device."""
    mover = runner.mover
    blocks = list(range(num_blocks))
    source = torch.empty(num_blocks * mover.block_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(source, device=runner.device)

    def seconds(copy) -> float:
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            copy()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5

    def tier_load() -> None:
        mover.load(blocks, blocks)
        mover.wait_loads()

    plain = source.numel() / seconds(lambda: target.copy_(source, non_blocking=True)) / 1e9
    tier = source.numel() / seconds(tier_load) / 1e9
    print(f"host-to-device: the tier's load {tier:.1f} GB/s, a plain pinned copy_ {plain:.1f} "
          f"GB/s ({tier / plain:.0%}), {source.numel() / 2**20:.0f} MiB", flush=True)
    return [Figure("load_gb_s", round(tier, 1), "GB/s"),
            Figure("load_gb_s[plain copy]", round(plain, 1), "GB/s"),
            Figure("load_bw_ratio", round(tier / plain, 3), "x")]
