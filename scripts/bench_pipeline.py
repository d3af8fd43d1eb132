"""W1 offline throughput through the whole pipeline (tokenizer, scheduler, workers,
detokenizer, client) in several modes: overlap scheduling on, off, on with worker
lookahead ("ahead": the defaults, the scheduler two plans ahead in small all-decoding batches
on a GPU), and that with one plan ahead always ("ahead1": --plans-ahead 1) or two ("ahead2").

    python scripts/bench_pipeline.py --make-random qwen3-0.6b      # on the GPU machine
    python scripts/bench_pipeline.py --make-random qwen3-0.6b --modes ahead,on
    python scripts/bench_pipeline.py --make-random qwen3-0.6b --nano-vllm ~/nano-vllm \\
        --plot w1.png --profile-json profile.json                  # with the peer and a figure
    python scripts/bench_pipeline.py --model DIR --device cpu --num-seqs 8 \\
        --max-input-len 64 --max-output-len 32                     # CPU smoke run

Prints output tok/s for each mode and its ratio to the hardware bound of the workload
(the same bound as scripts/bench_offline.py computes), the share of the W1 wall time the GPU
sat idle (1 - busy / wall, busy as the workers measured each step's forward and sample:
EngineStats.gpu_busy_s), then each mode against the first.

--make-random SHAPE   random bf16 weights of qwen3-0.6b, qwen3-8b or smollm2-135m (the
                      embedded model's Llama shape) built on the device, with a tokenizer
--nano-vllm DIR       also run W1 through nano-vLLM from the checkout DIR (the directory
                      holding its `nanovllm` package; it needs CUDA and flash-attn), in a
                      process of its own, on the same weights; prints nanopipe / nano-vLLM
                      for each mode. Qwen3 shapes only (nano-vLLM loads nothing else)
--plot OUT.png        a figure of the modes (tok/s, GPU idle %) and, with --profile-json
                      (the file scripts/profile_step.py --json writes), the per-step GPU
                      time by kernel category (needs matplotlib: the `bench` extra)

With NANOPIPE_HOST_TIMELINE=DIR in the environment each mode's pipeline writes its host
timeline into a subdirectory of its own, DIR/1-ahead, DIR/2-ahead2, ... in the order of
--modes (scripts/host_timeline.py reads one).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchlib import default_device, hardware_bound_s, param_count, timed_w1_busy, w1_workload
from benchlib.cli import add_model_source, add_w1_shape, resolve_model_dir
from benchlib.peer import check_checkout, run_nano_vllm

from frontend import LLM
from gpu_workers import ModelConfig
from protocol.host_timeline import ENV as TIMELINE_ENV

PLANS_AHEAD = {"off": 1, "on": 1, "ahead": None, "ahead1": 1, "ahead2": 2}
"""--plans-ahead of each mode (None: the engine's default)."""


def run_mode(model_dir: str, args: argparse.Namespace, mode: str, work) -> dict:
    """mode: "off" (no overlap), "on" (scheduler overlap), "ahead" (and worker lookahead: the
    defaults), "ahead1" / "ahead2" (and the scheduler one / two steps ahead of the results in
    every step)."""
    llm = LLM(model_dir, device=args.device, overlap=mode != "off",
              worker_lookahead=mode.startswith("ahead"), plans_ahead=PLANS_AHEAD[mode],
              max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_input_len + args.max_output_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager)
    try:
        produced, elapsed, busy = timed_w1_busy(llm, work)
    finally:
        llm.close()
    return dict(mode=mode, output_tokens=produced, seconds=round(elapsed, 3),
                output_tok_s=round(produced / elapsed, 1), gpu_busy_s=round(busy, 3),
                gpu_idle_pct=round(100 * (1 - busy / elapsed), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_source(ap)
    add_w1_shape(ap)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--modes", default="on,off",
                    help="comma-separated: on (overlap), off, ahead (overlap + worker "
                    "lookahead: the defaults), ahead1, ahead2 (one, two plans ahead always)")
    ap.add_argument("--nano-vllm", metavar="DIR", help="a nano-vLLM checkout to run W1 with too")
    ap.add_argument("--plot", metavar="OUT.png", help="write a figure of the results")
    ap.add_argument("--profile-json", metavar="FILE",
                    help="scripts/profile_step.py --json output to add to the figure")
    args = ap.parse_args()
    peer = check_checkout(args.nano_vllm) if args.nano_vllm else None
    profile = json.loads(Path(args.profile_json).read_text()) if args.profile_json else None
    if args.plot:
        import matplotlib  # noqa: F401  (fail before the runs, not after them)

    model_dir = resolve_model_dir(args, args.device or default_device(), tokenizer=True)
    mc = ModelConfig.from_dir(model_dir)
    if peer is not None and mc.model_type != "qwen3":
        ap.error(f"--nano-vllm runs Qwen3 models only; this one is {mc.model_type}")
    unknown = set(args.modes.split(",")) - PLANS_AHEAD.keys()
    if unknown:
        ap.error(f"unknown --modes {sorted(unknown)}: {', '.join(PLANS_AHEAD)}")
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len, mc.vocab_size)
    bound_s, parts = hardware_bound_s(mc, param_count(model_dir), work)
    results = {}
    timeline_dir = os.environ.get(TIMELINE_ENV)
    for i, mode in enumerate(args.modes.split(","), 1):
        if timeline_dir:  # the actors inherit the environment as they start
            os.environ[TIMELINE_ENV] = str(Path(timeline_dir) / f"{i}-{mode}")
        result = results[mode] = run_mode(model_dir, args, mode, work)
        bound = result["output_tokens"] / bound_s
        result.update(hardware_bound_tok_s=round(bound, 1),
                      ratio_to_bound=round(result["output_tok_s"] / bound, 4))
        print(json.dumps(result), flush=True)
        print(f"pipeline W1 mode={mode}: {result['output_tok_s']:.1f} output tok/s; "
              f"hardware bound {bound:.0f} tok/s (H200 figures); "
              f"ratio {result['ratio_to_bound']:.3f}; GPU idle {result['gpu_idle_pct']:.1f}% "
              f"of {result['seconds']:.2f} s", flush=True)
    modes = list(results)
    for mode in modes[1:]:  # same run, same workload: each mode against the first
        speedup = results[mode]["output_tok_s"] / results[modes[0]]["output_tok_s"]
        print(f"same run: mode={mode} / mode={modes[0]} = {speedup:.3f}x", flush=True)
    rows = list(results.values())
    if peer is not None:
        nv = run_nano_vllm(peer, model_dir, work, args.max_input_len + args.max_output_len,
                           args.max_num_seqs, args.max_num_batched_tokens, args.enforce_eager)
        nv.update(mode="nano-vLLM", ratio_to_bound=round(
            nv["output_tok_s"] / (nv["output_tokens"] / bound_s), 4))
        print(json.dumps(nv), flush=True)
        print(f"nano-vLLM W1: {nv['output_tok_s']:.1f} output tok/s ({nv['seconds']:.2f} s); "
              f"ratio {nv['ratio_to_bound']:.3f}", flush=True)
        for mode in modes:
            print(f"same run: nanopipe mode={mode} / nano-vLLM = "
                  f"{results[mode]['output_tok_s'] / nv['output_tok_s']:.3f}x", flush=True)
        rows.append(nv)
    if args.plot:
        from benchlib.plots import plot_pipeline

        print(f"figure: {plot_pipeline(rows, args.plot, profile)}", flush=True)


if __name__ == "__main__":
    main()
