"""W1 offline throughput through the whole pipeline (tokenizer, scheduler, workers,
detokenizer, client) in several modes: overlap scheduling on, off, and on with worker
lookahead ("ahead").

    python scripts/bench_pipeline.py --make-random qwen3-0.6b      # on the GPU machine
    python scripts/bench_pipeline.py --make-random qwen3-0.6b --modes ahead,on
    python scripts/bench_pipeline.py --model DIR --device cpu --num-seqs 8 \
        --max-input-len 64 --max-output-len 32                     # CPU smoke run

Prints output tok/s for each mode and its ratio to the hardware bound of the workload
(the same bound as scripts/bench_offline.py computes), then each mode against the first.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchlib import (
    SHAPES,
    default_device,
    hardware_bound_s,
    make_random,
    param_count,
    timed_w1,
    w1_workload,
)

from frontend import LLM
from gpu_workers import ModelConfig


def run_mode(model_dir: str, args: argparse.Namespace, mode: str, work) -> dict:
    """mode: "off" (no overlap), "on" (scheduler overlap), "ahead" (and worker lookahead)."""
    llm = LLM(model_dir, device=args.device, overlap=mode != "off",
              worker_lookahead=mode == "ahead", max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_input_len + args.max_output_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager)
    try:
        produced, elapsed = timed_w1(llm, work)
    finally:
        llm.close()
    return dict(mode=mode, output_tokens=produced, seconds=round(elapsed, 3),
                output_tok_s=round(produced / elapsed, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--make-random", choices=sorted(SHAPES))
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--modes", default="on,off",
                    help="comma-separated: on (overlap), off, ahead (overlap + worker lookahead)")
    args = ap.parse_args()

    model_dir = args.model
    if args.make_random:
        out = Path(tempfile.mkdtemp(prefix=f"nanopipe-{args.make_random}-"))
        make_random(args.make_random, out, args.device or default_device(), tokenizer=True)
        model_dir = str(out)
    mc = ModelConfig.from_dir(model_dir)
    work = w1_workload(args.num_seqs, args.max_input_len, args.max_output_len, mc.vocab_size)
    bound_s, parts = hardware_bound_s(mc, param_count(model_dir), work)
    results = {}
    for mode in args.modes.split(","):
        result = results[mode] = run_mode(model_dir, args, mode, work)
        bound = result["output_tokens"] / bound_s
        result.update(hardware_bound_tok_s=round(bound, 1),
                      ratio_to_bound=round(result["output_tok_s"] / bound, 4))
        print(json.dumps(result), flush=True)
        print(f"pipeline W1 mode={mode}: {result['output_tok_s']:.1f} output tok/s; "
              f"hardware bound {bound:.0f} tok/s (H200 figures); "
              f"ratio {result['ratio_to_bound']:.3f}", flush=True)
    modes = list(results)
    for mode in modes[1:]:  # same run, same workload: each mode against the first
        speedup = results[mode]["output_tok_s"] / results[modes[0]]["output_tok_s"]
        print(f"same run: mode={mode} / mode={modes[0]} = {speedup:.3f}x", flush=True)


if __name__ == "__main__":
    main()
