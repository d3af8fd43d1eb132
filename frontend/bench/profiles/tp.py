"""Where a tensor-parallel step's time goes, on every rank: the full pipeline (frontend.LLM) runs
W1 with the workers' profiling window on (gpu_workers.profiling.step_profiler), then each
rank's file is read back and printed.

    nanopipe profile tp --make-random qwen3-8b --tp 1,2      # on a 2-GPU machine
    nanopipe profile tp --model DIR --device cpu --tp 1,2 --num-seqs 4 \\
        --max-input-len 100 --max-output-len 100 --window 20,30       # CPU smoke run (gloo)

Each TP size gets its own pipeline, started with NANOPIPE_PROFILE_DIR and
NANOPIPE_PROFILE_STEPS=--window in its environment: every rank profiles plans [FIRST, LAST)
(counted from its first plan, W1's warm-up request included; the default 300,340 is W1 at
full load) and writes rank{R}.json. Printed per rank: the step's wall time, the device's busy
share, device time by category, collectives and their bytes per step, host time of the
runner's launch and finish (build_batch, forward, sample, settle) per step, the costliest
kernels; then one line across the ranks. With two or more TP sizes, the ratio of each per-step
figure (rank 0) to the first size's: what scales with the ranks and what does not.

--make-random SHAPE   random bf16 weights of qwen3-0.6b, qwen3-8b or smollm2-135m
--out DIR             keep the rank files in DIR/tp{N}/ (default: a temporary directory)
--trace               also each rank's Chrome trace of the window (rank{R}.trace.json)
--json FILE           every rank's figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from frontend import LLM
from frontend.bench.common import default_device, emit, timed_w1, w1_workload
from frontend.bench.common.model_source import add_w1_shape, resolve_model_dir
from frontend.bench.common.tp_profile import compare_ranks, format_rank, format_scaling, read_ranks
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from gpu_workers import ModelConfig
from gpu_workers.profiling.step_profiler import DIR_ENV, STEPS_ENV, TRACE_ENV


def profile_one(model_dir: str, tp: int, args: argparse.Namespace, work,
                out_dir: Path) -> list[dict]:
    """One pipeline at this TP size, W1 through it with the window on; its ranks' reports."""
    shutil.rmtree(out_dir, ignore_errors=True)
    env = {DIR_ENV: str(out_dir), STEPS_ENV: args.window, TRACE_ENV: "1" if args.trace else ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the worker processes inherit the launcher's environment
    try:
        llm = LLM(model_dir, tensor_parallel_size=tp, device=args.device, dtype=args.dtype,
                  max_model_len=args.max_input_len + args.max_output_len,
                  max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes,
                  enforce_eager=args.enforce_eager, overlap=not args.no_overlap,
                  worker_lookahead=args.worker_lookahead,
                  peer_all_reduce=args.peer_all_reduce)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        produced, elapsed = timed_w1(llm, work)
    finally:
        llm.close()
    print(f"TP={tp}: W1 {produced} tokens in {elapsed:.2f} s "
          f"({produced / elapsed:.1f} output tok/s, profiler on for plans {args.window})",
          flush=True)
    return read_ranks(out_dir, tp, args.steps)


MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tp", default="1,2", help="TP sizes; each after the first is compared "
                    "with the first")
    add_w1_shape(ap, batched_tokens=False)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--peer-all-reduce", action="store_true",
                    help="TP > 1 all-reduces small tensors through the ranks' memory "
                    "(the engine's --peer-all-reduce) instead of NCCL")
    ap.add_argument("--worker-lookahead", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--window", default="300,340", help="FIRST,LAST: plans to profile")
    ap.add_argument("--out", help="keep the rank files here (DIR/tp{N}/rank{R}.json)")
    ap.add_argument("--trace", action="store_true", help="also each rank's Chrome trace")
    ap.add_argument("--json", help="write every rank's figures here as JSON")


def run(args: argparse.Namespace) -> list[Figure]:
    try:
        args.steps = tuple(int(x) for x in args.window.split(","))
        first, last = args.steps
    except ValueError:
        raise BenchUsageError(f"--window must be FIRST,LAST (two integers), "
                              f"got {args.window!r}") from None
    if not 0 <= first < last:
        raise BenchUsageError(f"--window needs 0 <= FIRST < LAST, got {args.window}")
    try:
        tps = [int(t) for t in args.tp.split(",") if t.strip()]
    except ValueError:
        raise BenchUsageError(f"--tp must be sizes separated by commas, got {args.tp!r}") from None
    if not tps or min(tps) < 1:
        raise BenchUsageError("--tp needs one or more sizes >= 1")
    if min(args.max_input_len, args.max_output_len) < 100:
        raise BenchUsageError("W1 draws lengths with randint(100, max): --max-*-len must be >= 100")
    args.device = args.device or default_device()

    scratch = Path(tempfile.mkdtemp(prefix="nanopipe-profile-tp-"))
    out = Path(args.out) if args.out else scratch
    try:
        model_dir = resolve_model_dir(args, args.device, scratch / "model", tokenizer=True)
        mc = ModelConfig.from_dir(model_dir)
        work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len,
                           mc.vocab_size)
        results: dict[int, list[dict]] = {}
        for tp in tps:
            results[tp] = profile_one(model_dir, tp, args, work, out / f"tp{tp}")
            for report in results[tp]:
                print(format_rank(report), flush=True)
            print(f"TP={tp} " + compare_ranks(results[tp]) + "\n", flush=True)
        for tp in tps[1:]:
            print(format_scaling(tps[0], results[tps[0]][0], tp, results[tp][0]), flush=True)
        summary = {str(tp): reports for tp, reports in results.items()}
        emit(result="profile_tp", device=args.device, window=list(args.steps),
             tp={tp: dict(wall_ms_per_step=[r["wall_ms_per_step"] for r in reports],
                          collectives_per_step=[r["collectives_per_step"] for r in reports])
                 for tp, reports in results.items()})
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        return [Figure(f"wall_ms_per_step@tp{tp}", round(reports[0]["wall_ms_per_step"], 4),
                       "ms", higher_is_better=False) for tp, reports in results.items()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

