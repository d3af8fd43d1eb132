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
import time
from pathlib import Path

from bench_offline import SHAPES, hardware_bound_s, make_random, workload

from frontend import LLM, SamplingParams
from gpu_workers import ModelConfig


def write_synthetic_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer that names every id, so random-weight models run end to end."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="t0")
    fast.save_pretrained(model_dir)


def timed_w1(llm: LLM, work) -> tuple[int, float]:
    """One warm-up request, then the whole workload: (output tokens, wall seconds)."""
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for _, m in work]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o["token_ids"]) for o in outputs), elapsed


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
        import torch

        out = Path(tempfile.mkdtemp(prefix=f"nanopipe-{args.make_random}-"))
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        make_random(args.make_random, out, device)
        write_synthetic_tokenizer(out, SHAPES[args.make_random]["vocab_size"])
        model_dir = str(out)
    mc = ModelConfig.from_dir(model_dir)
    work = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    if mc.vocab_size <= 10000:
        work = [([t % mc.vocab_size for t in p], m) for p, m in work]
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


def param_count(model_dir: str) -> int:
    """Parameters in a checkpoint, read from the safetensors headers (no weights loaded)."""
    from math import prod

    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


if __name__ == "__main__":
    main()
