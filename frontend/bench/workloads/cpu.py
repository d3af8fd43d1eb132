"""W5 CPU: the real SmolLM2-135M-Instruct on this machine's CPU, batch 1 and batch 16,
nanopipe (the whole pipeline: client, tokenizer, scheduler, worker, detokenizer) against
Hugging Face transformers' `generate` on the same weights, in the same run.

    nanopipe bench cpu                        # embedded model, 64 new tokens
    nanopipe bench cpu --model DIR --new-tokens 32 --batch-sizes 1,4,16

Both engines run float32 greedy decoding on the same chat prompts (SmolLM2's chat template,
~45-50 tokens each) and produce exactly --new-tokens tokens per sequence: nanopipe with
ignore_eos, transformers with min_new_tokens (batches left-padded). Each engine is warmed up
once on other prompts before it is timed, and the two never run at the same time (nanopipe
is shut down before transformers loads). Batch 1 runs --batch1-prompts prompts one after
another. Each figure is the best of --repeats runs (the CPU may be shared). Prints output
tok/s per engine and batch size, the ratio nanopipe / transformers, and the machine (CPUs,
torch threads, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

from frontend import LLM, SamplingParams
from frontend.bench.common.chat_prompts import QUESTIONS, WARMUP_QUESTIONS, chat_prompts
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure


def batches(prompts: list[list[int]], batch_size: int, batch1_prompts: int):
    """The timed batches for one batch size: batch 1 runs prompts one after another."""
    if batch_size == 1:
        return [[p] for p in prompts[:batch1_prompts]]
    return [prompts[:batch_size]]


def timed(run_batch, prompt_batches, repeats: int) -> tuple[float, list[list[int]]]:
    """The best wall time of `repeats` runs (the CPU may be shared), and the last outputs."""
    best = float("inf")
    for _ in range(repeats):
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for batch in prompt_batches:
            outputs.extend(run_batch(batch))
        best = min(best, time.perf_counter() - start)
    return best, outputs


# ---------------------------------------------------------------- nanopipe


def bench_nanopipe(model_dir: str, prompts, warmup, args) -> dict:
    llm = LLM(model_dir, device="cpu", dtype="float32",
              max_model_len=max(map(len, prompts + warmup)) + args.new_tokens,
              max_num_seqs=max(args.batch_sizes),
              enable_prefix_caching=not args.no_prefix_cache)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def run_batch(batch):
        outs = llm.generate(batch, [params] * len(batch), use_tqdm=False)
        return [o["token_ids"] for o in outs]

    results = {}
    try:
        run_batch(warmup)
        for bs in args.batch_sizes:
            results[bs] = timed(run_batch, batches(prompts, bs, args.batch1_prompts), args.repeats)
    finally:
        llm.close()
    return results


# ---------------------------------------------------------------- transformers


def bench_transformers(model, pad_id: int, prompts, warmup, args) -> dict:
    def run_batch(batch):
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=pad_id)
        return out[:, width:].tolist()

    results = {}
    run_batch(warmup)
    for bs in args.batch_sizes:
        results[bs] = timed(run_batch, batches(prompts, bs, args.batch1_prompts), args.repeats)
    return results


# ---------------------------------------------------------------- report


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _agree_until_eos(a: list[int], b: list[int], eos: set[int]) -> bool:
    """Same tokens before nanopipe's first EOS: from there on, ignore_eos and min_new_tokens
    differ by design (nanopipe keeps the EOS it picked; transformers masks EOS and takes the
    runner-up)."""
    for x, y in zip(a, b):
        if x in eos:
            return True
        if x != y:
            return False
    return True


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--batch1-prompts", type=int, default=2,
                    help="prompts run one after another for batch 1")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per engine and batch size; the best one counts")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="turn nanopipe's prefix cache off (the prompts share the chat "
                         "template's system prompt)")


def run(args: argparse.Namespace) -> list[Figure]:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(args.batch_sizes) > len(QUESTIONS):
        raise BenchUsageError(f"batch sizes up to {len(QUESTIONS)}")

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(args, "cpu", tokenizer=True)
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    warmup = chat_prompts(tokenizer, WARMUP_QUESTIONS)
    eos = {int(tokenizer.eos_token_id)}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)

    print(f"W5 CPU  {dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine: {_cpu_model()}; nproc {os.cpu_count()} "
          f"(usable {len(os.sched_getaffinity(0))}); torch {torch.__version__} "
          f"threads {torch.get_num_threads()}; transformers {transformers.__version__}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model: {model_dir}; float32 greedy; {args.new_tokens} new tokens per sequence; "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"nanopipe prefix cache {'off' if args.no_prefix_cache else 'on'}", flush=True)

    t0 = time.perf_counter()
    nano = bench_nanopipe(model_dir, prompts, warmup, args)
    nano_total = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf = bench_transformers(model, pad_id, prompts, warmup, args)
    hf_total = time.perf_counter() - t0

    rows = []
    for bs in args.batch_sizes:
        (n_s, n_out), (h_s, h_out) = nano[bs], hf[bs]
        n_tok, h_tok = sum(map(len, n_out)), sum(map(len, h_out))
        assert n_tok == h_tok == len(n_out) * args.new_tokens, (n_tok, h_tok)
        same = sum(_agree_until_eos(a, b, eos) for a, b in zip(n_out, h_out))
        row = dict(batch=bs, sequences=len(n_out), output_tokens=n_tok,
                   nanopipe_s=round(n_s, 3), nanopipe_tok_s=round(n_tok / n_s, 1),
                   transformers_s=round(h_s, 3), transformers_tok_s=round(h_tok / h_s, 1),
                   ratio=round((n_tok / n_s) / (h_tok / h_s), 3), same_tokens=same)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print()
    print(f"{'batch':>5} {'seqs':>4} {'tokens':>6} | {'nanopipe tok/s':>14} "
          f"{'transformers tok/s':>18} | {'nanopipe/transformers':>21} | same tokens*")
    for r in rows:
        print(f"{r['batch']:>5} {r['sequences']:>4} {r['output_tokens']:>6} | "
              f"{r['nanopipe_tok_s']:>14.1f} {r['transformers_tok_s']:>18.1f} | "
              f"{r['ratio']:>21.2f}x | {r['same_tokens']}/{r['sequences']}")
    print("* sequences whose tokens agree up to the first EOS (batch > 1 in transformers is "
          "left-padded, which may flip a near-tie)")
    print(f"wall: nanopipe {nano_total:.1f} s (start-up, warm-up, runs, shutdown); "
          f"transformers {hf_total:.1f} s (load, warm-up, runs); "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return [Figure(f"output_tok_s@{r['batch']}", r["nanopipe_tok_s"], "tok/s",
                   peer=r["transformers_tok_s"], peer_name="transformers") for r in rows]

