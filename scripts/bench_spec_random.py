"""Speculative decoding on random weights of a real shape (the GPU figure): without speculation,
with n-gram proposals, and with a draft model — the target itself (acceptance 1: the speed-up
a perfect draft gives) and the target's first --draft-layers layers (on random weights nearly
nothing is accepted: the cost per step of drafting and verifying) — in the same run, outputs
asserted identical.

    python scripts/bench_spec_random.py --make-random qwen3-0.6b        # on the GPU machine
    python scripts/bench_spec_random.py --model DIR --device cpu --new-tokens 16 --batch-sizes 1

Workload: each prompt is a random segment of --segment tokens repeated --repeats times, so the
prompt itself holds the continuation n-gram lookup needs; greedy, ignore_eos, --new-tokens
tokens. Batch 1 runs --batch1-prompts prompts one after another; batch B runs B at once.
Prints per mode and batch size: TPOT (mean of the requests' RequestMetrics.tpot_s), output
tok/s (tokens / wall time), the acceptance rate (accepted / proposed over the requests).
On the CPU (float32) the outputs must be identical; in bf16 the share of tokens generated
before the first difference is printed instead. A model's tokens depend on its weights, so
how far a real model's outputs follow the prompt decides its acceptance; the two draft rows
bracket what any draft can give.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import random
import shutil
import tempfile
import time
from pathlib import Path

from benchlib import default_device, truncate_model
from benchlib.cli import add_model_source, resolve_model_dir

from frontend import LLM, SamplingParams


def prompts(num: int, segment: int, repeats: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        chunk = [rng.randrange(100, min(vocab, 10_000)) for _ in range(segment)]
        out.append(chunk * repeats)
    return out


def leading_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of the tokens generated before each request's first difference from `want`.
    In bf16 a step that verifies K+1 positions rounds differently from K+1 decode steps, so
    on nearly flat random logits greedy paths part; in float32 (the CPU) they must not."""
    same = total = 0
    for g, w in zip(got, want, strict=True):
        total += len(w)
        same += next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return same / total if total else 1.0


def run_mode(model: str, device: str, options: dict, batches: dict[int, list[list[int]]],
             new_tokens: int) -> dict[int, dict]:
    llm = LLM(model, device=device, **options)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    try:
        llm.generate([batches[1][0]], params, use_tqdm=False)  # warm-up
        figures = {}
        for size, work in batches.items():
            groups = [[p] for p in work] if size == 1 else [work]
            t0 = time.perf_counter()
            results = [r for group in groups
                       for r in llm.generate(group, params, use_tqdm=False)]
            wall = time.perf_counter() - t0
            metrics = [r["metrics"] for r in results]
            proposed = sum(m.spec_proposed_tokens for m in metrics)
            accepted = sum(m.spec_accepted_tokens for m in metrics)
            tpots = [m.tpot_s for m in metrics if m.tpot_s is not None]
            figures[size] = dict(
                tokens=[r["token_ids"] for r in results],
                tpot_ms=1000 * sum(tpots) / len(tpots),
                tok_s=sum(len(r["token_ids"]) for r in results) / wall,
                acceptance=accepted / proposed if proposed else None)
        return figures
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_source(ap, device_default=default_device(),
                     model_help="a model directory (with a tokenizer)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--batch1-prompts", type=int, default=3)
    ap.add_argument("--segment", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--modes", default="off,ngram,draft-target,draft-layers",
                    help="comma-separated subset (off is always run: the reference)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nanopipe-spec-"))  # the draft, and a random target
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model = resolve_model_dir(args, args.device, work / "target", tokenizer=True)
    draft = str(truncate_model(model, work / "draft", args.draft_layers))
    import json
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    batches = {s: prompts(args.batch1_prompts if s == 1 else s, args.segment, args.repeats,
                          vocab, seed=s) for s in sizes}
    spec = dict(num_speculative_tokens=args.k)
    every = {
        "off": ("off", {}),
        "ngram": (f"ngram (n={args.ngram})",
                  dict(speculative="ngram", ngram_size=args.ngram, **spec)),
        "draft-target": ("draft = target", dict(speculative="draft", draft_model=model, **spec)),
        "draft-layers": (f"draft = first {args.draft_layers} layers",
                         dict(speculative="draft", draft_model=draft, **spec)),
    }
    chosen = {"off", *args.modes.split(",")}
    if chosen - every.keys():
        raise SystemExit(f"--modes: unknown {sorted(chosen - every.keys())}; "
                         f"choose from {sorted(every)}")
    modes = dict(every[m] for m in every if m in chosen)
    results = {name: run_mode(model, args.device, opts, batches, args.new_tokens)
               for name, opts in modes.items()}
    base = results["off"]
    print(f"device {args.device}, K={args.k}, {args.new_tokens} new tokens, prompts "
          f"{args.segment}x{args.repeats} tokens, {dt.date.today()}")
    for size in sizes:
        for name, figs in results.items():
            f = figs[size]
            agree = leading_share(f["tokens"], base[size]["tokens"])
            acc = "-" if f["acceptance"] is None else f"{f['acceptance']:.1%}"
            print(f"batch {size:2d}  {name:24s} TPOT {f['tpot_ms']:7.3f} ms  "
                  f"{f['tok_s']:9.1f} tok/s  x{f['tok_s'] / base[size]['tok_s']:.2f}  "
                  f"acceptance {acc}  tokens as without speculation {agree:.1%}")
            if agree < 1 and args.device == "cpu":
                raise SystemExit(f"{name}: greedy tokens differ from the run without "
                                 "speculation")


if __name__ == "__main__":
    main()
