"""W1 offline throughput (docs/benchmarks.md): 256 random prompts of 100-1,024 tokens, 100-1,024
output tokens each, temperature 0.6, ignore_eos, after one warm-up request.

Modes (--modes, comma-separated, run one after another on the same workload):
  ahead    the whole pipeline with its defaults (overlap, worker lookahead, plans ahead auto)
  ahead1   the same, one plan ahead always; ahead2: two plans ahead always
  on       scheduler overlap without worker lookahead; off: no overlap
  runtime  the scheduler and the model runner in this process, no processes or sockets

    nanopipe bench throughput --make-random qwen3-0.6b                     # on a GPU
    nanopipe bench throughput --make-random qwen3-0.6b --peer nano-vllm ~/nano-vllm
    nanopipe bench throughput --model DIR --device cpu --num-seqs 8 \\
        --max-input-len 64 --max-output-len 32                             # CPU smoke run

Prints output tok/s per mode with its ratio to the hardware bound of this very workload (KV
and weight reads at the copy bandwidth, prefill FLOPs at the matmul rate, both measured on the
device before the first mode; nominal H200 figures on the CPU), the share of the wall time
the GPU sat idle (the workers' own busy time), and each mode against the first. --peer
nano-vllm DIR runs W1 through nano-vLLM from its checkout, in a process of its own, on the
same weights (Qwen3 shapes only), and prints each mode's ratio to it.
With NANOPIPE_HOST_TIMELINE=DIR each mode's pipeline writes its host timeline into
DIR/1-MODE, DIR/2-MODE, ... (`nanopipe profile timeline` reads one).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from frontend.bench.ceilings import device_ceilings
from frontend.bench.common import (
    Throughput,
    hardware_bound_s,
    param_count,
    timed_w1_busy,
    w1_workload,
)
from frontend.bench.common.model_source import (
    add_kv_cache_dtype,
    add_w1_shape,
    resolve_model_dir,
)
from frontend.bench.common.peer import check_checkout, run_nano_vllm
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure

MODEL = "required"
PEERS = ("nano-vllm",)
HEADLINE = "output_tok_s"
PLANS_AHEAD = {"off": 1, "on": 1, "ahead": None, "ahead1": 1, "ahead2": 2, "runtime": None}
"""--plans-ahead of each mode (None: the engine's default)."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_w1_shape(ap)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--modes", default="ahead", help=f"comma-separated, of: "
                    f"{', '.join(PLANS_AHEAD)} (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default: the longest W1 sequence); a "
                    "larger one measures what the limit alone costs a step")
    add_kv_cache_dtype(ap)
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="KV cache size (default: sized from free memory)")
    ap.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                    help="the host KV tier per rank, as `nanopipe serve` takes it; 0 turns "
                    "it off, which shows what pinning it beside the first run costs "
                    "(default: the engine's)")
    ap.add_argument("--plot", metavar="OUT.png", help="a figure of the modes (needs matplotlib)")
    ap.add_argument("--profile-json", metavar="FILE",
                    help="`nanopipe profile step --json` output to add to the figure")


def w1_max_model_len(args: argparse.Namespace) -> int:
    """--max-model-len, or the longest sequence W1 makes."""
    return args.max_model_len or args.max_input_len + args.max_output_len


def run_pipeline(model_dir: str, args: argparse.Namespace, mode: str, work) -> dict:
    from frontend import LLM

    llm = LLM(model_dir, device=args.device, overlap=mode != "off",
              worker_lookahead=mode.startswith("ahead"), plans_ahead=PLANS_AHEAD[mode],
              max_num_seqs=args.max_num_seqs,
              max_model_len=w1_max_model_len(args),
              max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, kv_cache_bytes=args.kv_cache_bytes,
              kv_cache_dtype=args.kv_cache_dtype,
              **({} if args.kv_offloading_size is None
                 else {"kv_offloading_size": args.kv_offloading_size}))
    try:
        produced, elapsed, busy = timed_w1_busy(llm, work)
    finally:
        llm.close()
    return dict(mode=mode, output_tokens=produced, seconds=round(elapsed, 3),
                output_tok_s=round(produced / elapsed, 1), gpu_busy_s=round(busy, 3),
                gpu_idle_pct=round(100 * (1 - busy / elapsed), 1))


def run_runtime(model_dir: str, args: argparse.Namespace, work) -> dict:
    """W1 through a Scheduler and a ModelRunner without overlap, in a process of its own: its
    KV pool and graphs go back to the driver when it exits, so a pipeline mode after it sizes
    its pool from the whole device again (freed tensors alone stay in torch's cache)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_runtime_w1, model_dir, args, work).result()


def _runtime_w1(model_dir: str, args: argparse.Namespace, work) -> dict:
    import torch

    from frontend.bench.common import run, w1_params
    from frontend.bench.common.w1_runtime import warm_runtime
    from protocol.limits import BLOCK_SIZE

    scheduler, runner = warm_runtime(  # the engine's block size for the device, as it runs
        args, model_dir, args.device, block_size=BLOCK_SIZE[args.device],
        max_model_len=w1_max_model_len(args))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    produced = run(scheduler, runner, [(p, w1_params(m)) for p, m in work], 0)
    sync()
    elapsed = time.perf_counter() - start
    return dict(mode="runtime", output_tokens=produced, seconds=round(elapsed, 3),
                output_tok_s=round(produced / elapsed, 1))


def run(args: argparse.Namespace) -> list[Figure]:
    from gpu_workers import ModelConfig
    from protocol.profile_settings import HOST_TIMELINE_ENV as TIMELINE_ENV

    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - PLANS_AHEAD.keys()
    if unknown or not modes:
        raise BenchUsageError(f"--modes takes {', '.join(PLANS_AHEAD)}; got {args.modes!r}")
    peer = check_checkout(args.peer[1]) if args.peer else None
    profile = json.loads(Path(args.profile_json).read_text()) if args.profile_json else None
    if args.plot:
        import matplotlib  # noqa: F401  (fail before the runs, not after them)
    ceilings = device_ceilings(args.device)  # before anything here holds the device
    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    mc = ModelConfig.from_dir(model_dir)
    if peer is not None and mc.model_type != "qwen3":
        raise BenchUsageError(f"--peer nano-vllm runs Qwen3 models only; this is {mc.model_type}")
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len, mc.vocab_size)
    num_params = param_count(model_dir)
    bound_s, _ = hardware_bound_s(mc, num_params, work, ceilings)
    # The bound reads the KV in the model's dtype (the goal a smaller cache is measured
    # against); a quantized cache also gets its ratio to the bound of its own bytes.
    own_mc = mc.with_kv_cache_dtype(args.kv_cache_dtype)
    own_bound_s = (None if own_mc.kv_dtype == mc.kv_dtype else
                   hardware_bound_s(own_mc, num_params, work, ceilings)[0])
    results: dict[str, dict] = {}
    timeline_dir = os.environ.get(TIMELINE_ENV)
    for i, mode in enumerate(modes, 1):
        if timeline_dir:  # the actors inherit the environment as they start
            os.environ[TIMELINE_ENV] = str(Path(timeline_dir) / f"{i}-{mode}")
        key = mode if mode not in results else f"{mode}#{i}"
        result = results[key] = (run_runtime(model_dir, args, work) if mode == "runtime"
                                 else run_pipeline(model_dir, args, mode, work))
        t = Throughput(result["output_tokens"], result["seconds"], bound_s)
        result.update(hardware_bound_tok_s=round(t.bound_tok_s, 1),
                      ratio_to_bound=round(t.ratio, 4), ceilings=ceilings.record())
        own = None if own_bound_s is None else Throughput(t.tokens, t.seconds, own_bound_s)
        if own is not None:
            result.update(kv_dtype_bound_tok_s=round(own.bound_tok_s, 1),
                          ratio_to_kv_dtype_bound=round(own.ratio, 4))
        print(json.dumps(result), flush=True)
        idle = result.get("gpu_idle_pct")
        print(f"W1 mode={mode}: {result['output_tok_s']:.1f} output tok/s "
              f"({result['output_tokens']} tokens in {result['seconds']:.2f} s); hardware bound "
              f"{t.bound_tok_s:.0f} tok/s ({ceilings.describe()}); ratio {t.ratio:.3f}"
              + ("" if own is None else f" ({own.ratio:.3f} of the {own.bound_tok_s:.0f} "
                 f"tok/s bound with {args.kv_cache_dtype} KV reads)")
              + ("" if idle is None else f"; GPU idle {idle:.1f}%"), flush=True)
    keys = list(results)
    for key in keys[1:]:
        speedup = results[key]["output_tok_s"] / results[keys[0]]["output_tok_s"]
        print(f"same run: mode={key} / mode={keys[0]} = {speedup:.3f}x", flush=True)
    nv = None
    if peer is not None:
        nv = run_nano_vllm(peer, model_dir, work, args.max_input_len + args.max_output_len,
                           args.max_num_seqs, args.max_num_batched_tokens, args.enforce_eager)
        nv["mode"] = "nano-vLLM"
        print(json.dumps(nv), flush=True)
    figures = []
    for n, key in enumerate(keys):
        r = results[key]
        name = HEADLINE if n == 0 else f"{HEADLINE}[{key}]"
        figures.append(Figure(name, r["output_tok_s"], "tok/s", bound=r["hardware_bound_tok_s"],
                              peer=None if nv is None else nv["output_tok_s"]))
        if r.get("gpu_idle_pct") is not None:
            figures.append(Figure(f"gpu_idle_pct[{key}]", r["gpu_idle_pct"], "%"))
    if nv is not None:  # the peer's own figure against the same bound
        figures.append(Figure(f"{HEADLINE}[nano-vllm]", nv["output_tok_s"], "tok/s",
                              bound=nv["output_tokens"] / bound_s))
    if args.plot:
        from frontend.bench.common.plots import plot_pipeline

        rows = list(results.values()) + ([nv] if nv else [])
        print(f"figure: {plot_pipeline(rows, args.plot, profile)}", flush=True)
    return figures
