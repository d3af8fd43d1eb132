"""W1 loaded into the runtime of this process (a ModelRunner and a Scheduler without overlap),
for the profiles of its decode steps one at a time (`nanopipe profile step`, `profile host`)."""

from __future__ import annotations

import argparse

from frontend.bench.common.drive import run
from frontend.bench.common.model_source import add_kv_cache_dtype
from frontend.bench.common.workloads import W1_WARMUP_PROMPT, w1_params, w1_workload
from gpu_workers import ModelRunner, WorkerConfig
from protocol import AddRequest
from scheduler_proc import Scheduler, SchedulerConfig


def warm_runtime(args: argparse.Namespace, model_dir: str, device: str, *, block_size: int,
                 max_model_len: int, dtype: str | None = None
                 ) -> tuple[Scheduler, ModelRunner]:
    """A runner and a scheduler (no overlap) sized by the W1 options, warmed up on one
    request: --max-num-seqs, --max-num-batched-tokens (at least max_model_len, so any W1
    prompt is one chunk), --kv-cache-bytes, --kv-cache-dtype and --enforce-eager."""
    config = WorkerConfig(
        model=model_dir, device=device, dtype=dtype, max_model_len=max_model_len,
        block_size=block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager)
    runner = ModelRunner(config)
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, overlap=False))
    run(scheduler, runner, [(W1_WARMUP_PROMPT, w1_params(16))], 1 << 40)
    return scheduler, runner


def w1_runtime(args: argparse.Namespace, model_dir: str, device: str
               ) -> tuple[Scheduler, ModelRunner]:
    """warm_runtime with --dtype and --block-size, and W1's requests added, none of them
    stepped yet."""
    scheduler, runner = warm_runtime(
        args, model_dir, device, block_size=args.block_size, dtype=args.dtype,
        max_model_len=args.max_input_len + args.max_output_len)
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len,
                       runner.model_config.vocab_size)
    eos = list(runner.model_config.eos_token_ids)
    for k, (prompt, max_tokens) in enumerate(work):
        scheduler.add_request(AddRequest(k, prompt, w1_params(max_tokens), eos))
    return scheduler, runner


def add_runtime_options(ap: argparse.ArgumentParser) -> None:
    """The runtime options w1_runtime reads beside the W1 shape."""
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    add_kv_cache_dtype(ap)
    ap.add_argument("--enforce-eager", action="store_true")
