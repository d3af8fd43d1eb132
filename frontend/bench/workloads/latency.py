"""W4 latency floor: one request at a time, time to first token (TTFT) and time per output
token (TPOT), through the whole pipeline and through the runtime called directly; plus the
latency of one ZeroMQ hop carrying a real protocol message.

    nanopipe bench latency --make-random qwen3-0.6b       # on the GPU machine
    nanopipe bench latency --model DIR --device cpu \\
        --prompt-len 128 --max-tokens 32                            # CPU smoke run

Workload (docs/benchmarks.md, W4): a prompt of --prompt-len random token ids (passed as
prompt_token_ids), greedy, ignore_eos, --max-tokens output tokens; one request at a time.
Every repetition uses a fresh prompt (random.seed(rep)), so the prefix cache never turns
a prefill into a cache hit; the same prompts go through both paths. One warm-up request
of the same shape precedes each path's timed repetitions; the medians are printed.

- pipeline: Pipeline + Client.stream. TTFT is from the call to the first delta carrying a
  token; TPOT is (last token's arrival - first's) / (tokens after the first delta). Over
  the timed requests it also prints, from the scheduler's published counters, how many
  steps were planned two ahead and the workers' device time per step: what the pacing
  meter behind `--plans-ahead auto` compares the host's chain with.
- direct: scheduler_proc.Scheduler + gpu_workers.ModelRunner in this process, as in
  `nanopipe bench throughput --modes runtime` (overlap off: execute() is synchronous, there
  is nothing to overlap with). TTFT is from add_request to the first sampled token; TPOT is
  the mean time of the later steps. Same block size, batching limits and KV sizing as the pipeline.
- overhead: pipeline TPOT - direct TPOT (absolute) and pipeline / direct (ratio).
- peer (--peer nano-vllm DIR, Qwen3 shapes): the same prompts through nano-vLLM, one at a
  time, each timed to one token (TTFT) and to --max-tokens (TPOT from the difference).
- hop: one ZeroMQ hop of a StepResult and of a 256-entry decode StepPlan
  (frontend.bench.common.zmq_hop), the median round trip / 2.

The hardware floor (as for W1, at the ceilings measured on the device before the first
request; nominal H200 figures on the CPU): TTFT >= prefill FLOPs at the matmul rate + one
read of the weights and the prompt's KV; TPOT >= one read of the weights plus the KV of the
mean context, at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time

from frontend.bench.ceilings import device_ceilings
from frontend.bench.common import (
    StatsFollower,
    drain,
    greedy,
    hardware_bound_s,
    random_ids,
)
from frontend.bench.common import run as run_requests
from frontend.bench.common.model_source import add_plans_ahead, resolve_model_dir
from frontend.bench.common.peer import check_checkout, run_nano_vllm_latency
from frontend.bench.common.zmq_hop import bench_hop
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from protocol import (
    AddRequest,
)

# ---------------------------------------------------------------- workload


def prompts(num: int, prompt_len: int, vocab_size: int, first_seed: int) -> list[list[int]]:
    """One fresh random prompt per repetition, deterministic per seed, from the whole vocab."""
    return [random_ids(random.Random(first_seed + k), prompt_len, vocab_size, cap=None)
            for k in range(num)]


def ttft_tpot(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, float, int]:
    """(TTFT, TPOT, tokens) from (arrival time, tokens in that arrival) pairs."""
    if not arrivals:
        raise RuntimeError("the request produced no tokens")
    first_t, first_n = arrivals[0]
    total = sum(n for _, n in arrivals)
    later = total - first_n
    tpot = (arrivals[-1][0] - first_t) / later if later else float("nan")
    return first_t - start, tpot, total


# ---------------------------------------------------------------- pipeline path


def bench_pipeline(engine_cfg, reqs: list[list[int]], warm: list[int], max_tokens: int):
    from frontend import Client
    from frontend.engine.pipeline import Pipeline

    params = greedy(max_tokens)
    t0 = time.perf_counter()
    with Pipeline(engine_cfg) as pipeline, Client(pipeline.address) as client:
        startup = time.perf_counter() - t0
        ep = pipeline.endpoints
        stats = StatsFollower(ep.deltas_pub, ep.keys)

        splits: list[dict[str, float]] = []

        def one(prompt: list[int]) -> tuple[float, float, int]:
            arrivals: list[tuple[float, int]] = []
            start, wall = time.perf_counter(), time.time()
            first_wall, metrics = None, None
            for delta in client.stream(prompt_token_ids=prompt, params=params):
                if delta.token_ids:
                    arrivals.append((time.perf_counter(), len(delta.token_ids)))
                    first_wall = first_wall or time.time()
                metrics = delta.metrics or metrics
            if metrics is not None and metrics.ttft_s is not None and first_wall is not None:
                splits.append(ttft_split(wall, first_wall, metrics))
            return ttft_tpot(start, arrivals)

        try:
            one(warm)
            splits.clear()
            before = stats.after(time.monotonic())
            runs = [one(p) for p in reqs]
            after = stats.after(time.monotonic())
        finally:
            stats.close()
    return startup, runs, splits, step_counts(before, after)


def step_counts(before, after) -> dict | None:
    """Steps between two EngineStats, those planned two ahead, and the workers' device time
    per step (ms)."""
    steps = after.steps - before.steps
    if steps == 0:
        return None
    return dict(steps=steps, two_ahead=after.steps_two_ahead - before.steps_two_ahead,
                busy_ms=1e3 * (after.gpu_busy_s - before.gpu_busy_s) / steps)


def ttft_split(sent: float, first_token: float, m) -> dict[str, float]:
    """Where a pipeline TTFT goes, in ms, from the request's RequestMetrics (wall clocks of
    one host): client to the tokenizer's stamp, waiting in the scheduler, scheduled to the
    first token at the scheduler (the workers' prefill and the hops to and from them), and
    the scheduler to the client (detokenizer and the hops)."""
    return {"to_tokenizer": m.arrival_time - sent, "queue": m.queue_time_s or 0.0,
            "prefill": m.ttft_s - (m.queue_time_s or 0.0),
            "to_client": first_token - m.first_token_time}


# ---------------------------------------------------------------- direct path


def bench_direct(engine_cfg, reqs: list[list[int]], warm: list[int], max_tokens: int):
    from gpu_workers import ModelRunner
    from scheduler_proc import Scheduler

    t0 = time.perf_counter()
    runner = ModelRunner(engine_cfg.worker_config(None))
    sched_cfg = dataclasses.replace(engine_cfg, overlap=False, plans_ahead=1).scheduler_config(
        runner.num_kv_blocks)
    scheduler = Scheduler(sched_cfg)
    startup = time.perf_counter() - t0
    eos = list(runner.model_config.eos_token_ids)
    params = greedy(max_tokens)

    def one(request_id: int, prompt: list[int]) -> tuple[float, float, int]:
        arrivals: list[tuple[float, int]] = []

        def arrived(deltas) -> None:
            n = sum(len(t) for t in deltas.token_ids)
            if n:
                arrivals.append((time.perf_counter(), n))

        start = time.perf_counter()
        scheduler.add_request(AddRequest(request_id, prompt, params, eos))
        drain(scheduler, runner, arrived)
        return ttft_tpot(start, arrivals)

    run_requests(scheduler, runner, [(warm, params)], 1 << 40)  # the warm-up
    runs = [one(k, p) for k, p in enumerate(reqs)]
    num_params = sum(p.numel() for p in runner.model.parameters())
    return startup, runs, num_params


# ---------------------------------------------------------------- main


def summarize(runs: list[tuple[float, float, int]]) -> dict:
    return dict(ttft_ms=round(statistics.median(r[0] for r in runs) * 1e3, 3),
                tpot_ms=round(statistics.median(r[1] for r in runs) * 1e3, 4),
                ttft_ms_all=[round(r[0] * 1e3, 3) for r in runs],
                tpot_ms_all=[round(r[1] * 1e3, 4) for r in runs],
                output_tokens=runs[0][2])


MODEL = "required"
PEERS = ("nano-vllm",)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="timed requests per path")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default: --prompt-len + --max-tokens); "
                    "a larger one measures what the limit alone costs a step")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="overlap scheduling in the pipeline (default on)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--worker-lookahead", action=argparse.BooleanOptionalAction, default=True,
                    help="workers launch the next step before this one's tokens reach the host "
                    "(default on, as in the engine)")
    add_plans_ahead(ap)
    ap.add_argument("--hop-iters", type=int, default=5000)
    ap.add_argument("--hop-plan-seqs", type=int, default=256)


def run(args: argparse.Namespace) -> list[Figure]:
    if args.prompt_len < 1 or args.max_tokens < 2 or args.reps < 1:
        raise BenchUsageError("--prompt-len >= 1, --max-tokens >= 2 and --reps >= 1 are required")

    checkout = check_checkout(args.peer[1]) if args.peer else None
    # The hop first: nothing else is running and this process holds no GPU yet.
    hops = bench_hop(args.hop_iters, max(100, args.hop_iters // 10), args.hop_plan_seqs)
    for h in hops:
        print(f"ZMQ hop ({h['message']}, {h['bytes']} B, ipc PUSH/PULL, encode+send+recv+"
              f"decode): {h['hop_us']:.1f} us (median round trip / 2)", flush=True)

    from frontend.engine.config import EngineConfig
    from gpu_workers import ModelConfig

    device = args.device
    ceilings = device_ceilings(device)  # before anything here holds the device
    model_dir = resolve_model_dir(args, device, tokenizer=True)
    mc = ModelConfig.from_dir(model_dir)
    if checkout is not None and mc.model_type != "qwen3":
        raise BenchUsageError(f"--peer nano-vllm runs Qwen3 models only; this is {mc.model_type}")
    needed = args.prompt_len + args.max_tokens
    if args.max_model_len is not None and args.max_model_len < needed:
        raise BenchUsageError(f"--max-model-len must be at least --prompt-len + --max-tokens "
                              f"({needed})")
    max_model_len = args.max_model_len or needed
    base = EngineConfig(model=model_dir, device=device, max_model_len=max_model_len,
                        enforce_eager=args.enforce_eager)
    engine_cfg = dataclasses.replace(
        base, overlap=args.overlap, worker_lookahead=args.worker_lookahead,
        plans_ahead=args.plans_ahead,
        max_num_batched_tokens=max(base.resolved_max_num_batched_tokens, needed))
    reqs = prompts(args.reps, args.prompt_len, mc.vocab_size, first_seed=1)
    warm_p, warm_d = prompts(2, args.prompt_len, mc.vocab_size, first_seed=1_000_000)

    # The pipeline first: its processes give the GPU back entirely when it stops.
    p_start, p_runs, p_splits, p_steps = bench_pipeline(engine_cfg, reqs, warm_p,
                                                         args.max_tokens)
    pipe = summarize(p_runs)
    print(f"pipeline (overlap={'on' if args.overlap else 'off'}, start-up {p_start:.1f} s): "
          f"TTFT {pipe['ttft_ms']:.2f} ms, TPOT {pipe['tpot_ms']:.3f} ms "
          f"(median of {args.reps})", flush=True)
    if p_steps:
        pipe["steps"] = p_steps
        print(f"pipeline steps: {p_steps['steps']}, {p_steps['two_ahead']} planned two ahead; "
              f"the workers' device time {p_steps['busy_ms']:.3f} ms per step", flush=True)
    if p_splits:
        split = {k: 1e3 * statistics.median(s[k] for s in p_splits) for k in p_splits[0]}
        pipe["ttft_split_ms"] = {k: round(v, 3) for k, v in split.items()}
        print("pipeline TTFT split (medians): " + ", ".join(
            f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in split.items()), flush=True)
    d_start, d_runs, num_params = bench_direct(engine_cfg, reqs, warm_d, args.max_tokens)
    direct = summarize(d_runs)
    print(f"direct runtime (in-process, overlap off, start-up {d_start:.1f} s): "
          f"TTFT {direct['ttft_ms']:.2f} ms, TPOT {direct['tpot_ms']:.3f} ms "
          f"(median of {args.reps})", flush=True)

    peer = None
    if checkout is not None:  # last: nanopipe's processes have given the GPU back
        peer = run_nano_vllm_latency(checkout, model_dir, reqs, warm_p, args.max_tokens,
                                     args.enforce_eager)
        print(f"nano-vLLM (one request at a time, timed to 1 and to {args.max_tokens} tokens): "
              f"TTFT {peer['ttft_ms']:.2f} ms, TPOT {peer['tpot_ms']:.3f} ms", flush=True)
        if peer["tpot_ms"] <= 0:
            print(f"nano-vLLM's TPOT is lost in the noise of its timings (the runs to "
                  f"{args.max_tokens} tokens were no slower than those to 1); no ratio to it "
                  f"is recorded: raise --max-tokens or --reps", flush=True)
    tpot_over = pipe["tpot_ms"] - direct["tpot_ms"]
    ttft_over = pipe["ttft_ms"] - direct["ttft_ms"]
    tpot_ratio = pipe["tpot_ms"] / direct["tpot_ms"]
    print(f"pipeline overhead: {tpot_over * 1e3:+.1f} us per output token "
          f"(TPOT ratio {tpot_ratio:.3f}); TTFT {ttft_over:+.2f} ms "
          f"(ratio {pipe['ttft_ms'] / direct['ttft_ms']:.3f})")

    # Hardware floor for this request at the run's ceilings, from hardware_bound_s: B(m)
    # covers a request of m output tokens, so B(1) is the prefill and
    # (B(M) - B(1)) / (M - 1) is one decode step at the mean context.
    prompt = reqs[0]
    b1, _ = hardware_bound_s(mc, num_params, [(prompt, 1)], ceilings)
    bm, _ = hardware_bound_s(mc, num_params, [(prompt, args.max_tokens)], ceilings)
    ttft_bound_ms = b1 * 1e3
    tpot_bound_ms = (bm - b1) / (args.max_tokens - 1) * 1e3
    print(f"hardware floor ({ceilings.describe()}): TTFT {ttft_bound_ms:.4g} ms, TPOT "
          f"{tpot_bound_ms:.4g} ms; TPOT ratio to the floor: pipeline "
          f"{tpot_bound_ms / pipe['tpot_ms']:.4g}, direct {tpot_bound_ms / direct['tpot_ms']:.4g}")

    print(json.dumps(dict(
        workload="W4", device=device, model=args.make_random or os.path.basename(
            os.path.normpath(args.model)),
        prompt_len=args.prompt_len, max_tokens=args.max_tokens, reps=args.reps,
        overlap=args.overlap, plans_ahead=args.plans_ahead,
        block_size=engine_cfg.resolved_block_size,
        pipeline=pipe, direct=direct,
        overhead_tpot_us=round(tpot_over * 1e3, 2), overhead_tpot_ratio=round(tpot_ratio, 4),
        overhead_ttft_ms=round(ttft_over, 3),
        overhead_ttft_ratio=round(pipe["ttft_ms"] / direct["ttft_ms"], 4),
        hardware_floor_ttft_ms=float(f"{ttft_bound_ms:.4g}"),
        hardware_floor_tpot_ms=float(f"{tpot_bound_ms:.4g}"),
        pipeline_tpot_ratio_to_floor=float(f"{tpot_bound_ms / pipe['tpot_ms']:.4g}"),
        direct_tpot_ratio_to_floor=float(f"{tpot_bound_ms / direct['tpot_ms']:.4g}"),
        ceilings=ceilings.record(),
        zmq_hop=hops,
    )), flush=True)
    return [Figure("tpot_ms", pipe["tpot_ms"], "ms", bound=tpot_bound_ms, higher_is_better=False,
                   peer=peer and round(peer["tpot_ms"], 4)),
            Figure("ttft_ms", pipe["ttft_ms"], "ms", bound=ttft_bound_ms, higher_is_better=False,
                   peer=peer and round(peer["ttft_ms"], 3)),
            Figure("tpot_ms[direct]", direct["tpot_ms"], "ms", bound=tpot_bound_ms,
                   higher_is_better=False),
            Figure("ttft_ms[direct]", direct["ttft_ms"], "ms", bound=ttft_bound_ms,
                   higher_is_better=False),
            *(Figure(f"zmq_hop_us[{what}]", h["hop_us"], "us", higher_is_better=False)
              for what, h in zip(("result", "plan"), hops))]

