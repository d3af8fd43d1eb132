"""Parity check: nanopipe's ModelRunner against transformers, greedy tokens and prefill logits.

    python scripts/check_gpu_parity.py --make-random qwen3-0.6b          # on the GPU machine
    python scripts/check_gpu_parity.py --model DIR --device cpu --dtype float32 --num-prompts 8

Acceptance (bf16, the Qwen3-0.6B shape with random weights built on the GPU machine itself):
the prefill logits agree with transformers within bf16 tolerance, and the greedy tokens agree
for the first --max-tokens (32) tokens on at least 95% of --num-prompts (64) prompts.

Steps:
  1. Prompts: seeded random token ids, lengths uniform in --prompt-len-range.
  2. nanopipe: one ModelRunner driven by the Scheduler in this process, all prompts planned
     together (one batched prefill step, then batched decode steps; CUDA graphs unless
     --enforce-eager), greedy sampling. The fp32 logits of the prefill step (last prompt
     position of every prompt) are captured on the way.
  3. transformers: AutoModelForCausalLM from the same directory, same dtype and device,
     attn_implementation=sdpa (or --hf-attn eager), an explicit greedy loop per prompt with the
     KV cache; the logits of its prefill forward at the last prompt position are kept.
  4. Per prompt: whether the first --max-tokens tokens match exactly, how many leading tokens
     match and, where they differ, the gap: transformers' logit of its own token minus its logit
     of nanopipe's token at the first differing step (a near-tie when it is within the noise
     the logit comparison measures). Logits on the first --logit-prompts prompts: max and mean
     abs difference, both also relative to the logits' std, top-1 and exact top-5 agreement.

Logits "within bf16 tolerance", per compared prompt, with tol = --logit-rtol (0.05) times the
largest |logit| transformers gives at that position:
  * max |nanopipe - transformers| <= tol, and
  * the top-5 sets agree up to tol: every token in one side's top 5 has, on the other side, a
    logit no lower than that side's 5th-largest logit minus tol. (Exact top-5 set equality is
    reported too, but tokens that tie within bf16 rounding may legitimately swap places.)

Random weights in bf16 make many near-ties in the argmax: logits of a random model are nearly
flat, so two implementations that round differently (fused kernels, another summation order,
another attention kernel) pick different tokens at some steps, and after the first differing
token the rest of the continuation differs too. That is why the token criterion is a fraction
of prompts rather than all of them; the threshold stays at the required 95%. In float32 on the
CPU (a tiny model) both sides agree on every token. Two calibrations tell a near-tie from a
bug: the divergence gaps above, and --baseline (e.g. `--baseline eager --baseline sdpa:float32`),
which runs transformers again with another attention or dtype and reports how often two
implementations that are both correct agree on all tokens.

Prints a per-prompt table, a summary and one JSON line; exits 0 on acceptance, else 1.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from frontend.bench.common import drain, greedy, leading_match, process, random_prompts
from frontend.bench.common.model_source import add_model_source, resolve_model_dir
from gpu_workers import ModelRunner, WorkerConfig
from gpu_workers.config import parse_dtype
from protocol import AddRequest, TokenDeltas
from scheduler_proc import Scheduler, SchedulerConfig


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ nanopipe


def run_nanopipe(args, model_dir: str, prompts: list[list[int]]
                 ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor], dict]:
    """Greedy outputs of every prompt, batched together, and the prefill logits."""
    max_len = max(len(p) for p in prompts)
    total = sum(len(p) for p in prompts)
    block_size = args.block_size or (
        256 if args.device == "cuda" and args.attention_backend == "flash_attn" else 16)
    config = WorkerConfig(
        model=model_dir, device=args.device, dtype=args.dtype,
        max_model_len=max_len + args.max_tokens, block_size=block_size,
        max_num_seqs=max(len(prompts), 1),
        # every prompt prefills whole in the first step
        max_num_batched_tokens=max(total, max_len + args.max_tokens),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=args.kv_cache_bytes, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(config)
    startup = time.perf_counter() - t0
    info = dict(backend=runner.backend, block_size=block_size, kv_blocks=runner.num_kv_blocks,
                cuda_graphs=runner.graphs is not None, startup_s=round(startup, 2))
    print(f"nanopipe: start-up {startup:.1f} s, backend={runner.backend} "
          f"block_size={block_size} kv_blocks={runner.num_kv_blocks} "
          f"cuda_graphs={runner.graphs is not None}")

    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len, overlap=False))
    eos = list(runner.model_config.eos_token_ids)
    for i, p in enumerate(prompts):
        scheduler.add_request(AddRequest(i, p, greedy(args.max_tokens), eos))
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def collect(deltas: TokenDeltas) -> None:
        for rid, tokens in zip(deltas.request_ids, deltas.token_ids, strict=True):
            outputs[rid].extend(tokens)

    # Capture the fp32 logits of the prefill step: ModelRunner._sample computes them with
    # model.compute_logits for the entries that sample, in the result's seq_ids order.
    model = runner.model
    captured: list[torch.Tensor] = []
    original = model.compute_logits

    def capture(hidden: torch.Tensor):
        logits = original(hidden)
        captured.append(logits.detach().float().cpu())
        return logits

    prefill_logits: dict[int, torch.Tensor] = {}
    sync(args.device)
    t0 = time.perf_counter()
    plan = scheduler.schedule()
    model.compute_logits = capture
    try:
        result = runner.execute(plan)
    finally:
        del model.compute_logits  # back to the class method
    if len(captured) != 1 or set(result.seq_ids) != set(range(len(prompts))):
        raise RuntimeError("the first step did not prefill every prompt whole")
    for row, sid in enumerate(result.seq_ids):
        prefill_logits[sid] = captured[0][row]
    collect(process(scheduler, result))
    drain(scheduler, runner, collect)
    sync(args.device)
    info["generate_s"] = round(time.perf_counter() - t0, 3)
    print(f"nanopipe: {len(prompts)} prompts ({total} prompt tokens), "
          f"{args.max_tokens} tokens each in {info['generate_s']:.2f} s")
    del runner, model
    free_device_memory(args.device)
    return outputs, prefill_logits, info


# ------------------------------------------------------------------ transformers


def load_hf(model_dir: str, dtype: str | None, attn: str, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=parse_dtype(dtype) if dtype else "auto", attn_implementation=attn)
    return model.to(device).eval()


@dataclass
class HfRun:
    tokens: list[int]
    first_logits: torch.Tensor
    """fp32 logits of the prefill forward at the last prompt position (on the CPU)."""
    divergence_gap: float | None
    """At the first step where `other` differs: transformers' logit of its own token minus its
    logit of `other`'s token. Small = the two implementations split a near-tie."""


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int, device: str,
              other: list[int] | None = None) -> HfRun:
    """Exact greedy continuation with the KV cache, compared step by step with `other`."""
    # Newer transformers call the KV cache argument `cache`, older ones `past_key_values`.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    logits = out.logits[0, -1].float()
    first_logits, past, tokens, gap = logits.cpu(), getattr(out, key), [], None
    while True:
        nxt = int(logits.argmax())
        step = len(tokens)
        if gap is None and other is not None and step < len(other) and other[step] != nxt:
            gap = float(logits[nxt] - logits[other[step]])
        tokens.append(nxt)
        if len(tokens) == max_tokens:
            return HfRun(tokens, first_logits, gap)
        out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True,
                    **{key: past})
        past = getattr(out, key)
        logits = out.logits[0, -1].float()


def match_fraction(a: dict[int, list[int]], b: dict[int, list[int]]) -> float:
    return sum(a[i] == b[i] for i in a) / len(a)


def run_baselines(args, model_dir: str, prompts: list[list[int]], reference: dict,
                  nano: dict, reference_logits: dict[int, torch.Tensor]) -> list[dict]:
    """Other correct implementations (transformers with another attention or dtype) against
    the reference: how often do two implementations that are both right agree on all tokens?"""
    rows = []
    for spec in args.baseline:
        attn, _, dtype = spec.partition(":")
        model = load_hf(model_dir, dtype or args.dtype, attn, args.device)
        t0 = time.perf_counter()
        runs = {i: hf_greedy(model, p, args.max_tokens, args.device)
                for i, p in enumerate(prompts)}
        out = {i: r.tokens for i, r in runs.items()}
        diffs = [(runs[i].first_logits - ref).abs() for i, ref in reference_logits.items()]
        stds = [float(ref.std()) for ref in reference_logits.values()]
        del model
        free_device_memory(args.device)
        row = dict(baseline=f"transformers attn={attn} dtype={dtype or args.dtype}",
                   vs_reference=round(match_fraction(out, reference), 4),
                   vs_nanopipe=round(match_fraction(out, nano), 4),
                   logits_max_abs=round(max(float(d.max()) for d in diffs), 6),
                   logits_mean_abs=round(sum(float(d.mean()) for d in diffs) / len(diffs), 6),
                   logits_max_rel_std=round(max(float(d.max()) / s
                                                for d, s in zip(diffs, stds, strict=True)), 6),
                   seconds=round(time.perf_counter() - t0, 1))
        print(f"baseline {row['baseline']}: all {args.max_tokens} tokens equal the reference's "
              f"on {row['vs_reference']:.1%} of prompts, nanopipe's on {row['vs_nanopipe']:.1%}; "
              f"prefill logits vs the reference: max|d| {row['logits_max_abs']:.4g}, mean|d| "
              f"{row['logits_mean_abs']:.4g}, max|d|/std {row['logits_max_rel_std']:.3g}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------ comparison


def topk_agree_within(a: torch.Tensor, b: torch.Tensor, k: int, tol: float) -> bool:
    """Each of a's top-k tokens is, in b, no lower than b's k-th largest logit minus tol."""
    kth_b = b.topk(k).values[-1]
    return bool((b[a.topk(k).indices] >= kth_b - tol).all())


def compare_logits(nano: torch.Tensor, hf: torch.Tensor, rtol: float, k: int = 5) -> dict:
    diff = (nano - hf).abs()
    std = float(hf.std())
    tol = rtol * float(hf.abs().max())
    top_n, top_h = set(nano.topk(k).indices.tolist()), set(hf.topk(k).indices.tolist())
    within = (float(diff.max()) <= tol and topk_agree_within(nano, hf, k, tol)
              and topk_agree_within(hf, nano, k, tol))
    return dict(max_abs=float(diff.max()), mean_abs=float(diff.mean()),
                max_rel_std=float(diff.max()) / std if std else float("inf"),
                mean_rel_std=float(diff.mean()) / std if std else float("inf"),
                max_abs_logit=float(hf.abs().max()), tol=tol,
                top1=int(nano.argmax()) == int(hf.argmax()), top5_exact=top_n == top_h,
                within=within)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_source(ap, device_default="cuda", out=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len-range", type=int, nargs=2, default=[16, 256],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--logit-prompts", type=int, default=8,
                    help="how many prompts' prefill logits to compare (default 8)")
    ap.add_argument("--logit-rtol", type=float, default=0.05)
    ap.add_argument("--min-match-fraction", type=float, default=0.95)
    ap.add_argument("--baseline", action="append", default=[], metavar="ATTN[:DTYPE]",
                    help="also run transformers with this attention (sdpa|eager) and dtype, and "
                         "report how often it agrees with the reference (repeatable)")
    args = ap.parse_args()
    lo, hi = args.prompt_len_range
    if not 1 <= lo <= hi:
        ap.error("--prompt-len-range needs 1 <= MIN <= MAX")
    if args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--num-prompts and --max-tokens must be >= 1")

    model_dir = resolve_model_dir(args, args.device, args.out)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(random.Random(args.seed), args.num_prompts, lo, hi, vocab)

    nano_out, nano_logits, info = run_nanopipe(args, model_dir, prompts)

    hf = load_hf(model_dir, args.dtype, args.hf_attn, args.device)
    print(f"transformers: {type(hf).__name__}, dtype={hf.dtype}, attn={args.hf_attn}")
    n_logits = min(args.logit_prompts, len(prompts))
    t0 = time.perf_counter()
    rows, logit_rows, reference, reference_logits = [], [], {}, {}
    for i, p in enumerate(prompts):
        got = nano_out[i]
        ref = hf_greedy(hf, p, args.max_tokens, args.device, other=got)
        reference[i] = ref.tokens
        rows.append(dict(prompt=i, prompt_len=len(p), match=got == ref.tokens,
                         leading=leading_match(got, ref.tokens), gap=ref.divergence_gap))
        if i < n_logits:
            reference_logits[i] = ref.first_logits
            logit_rows.append(dict(prompt=i, **compare_logits(nano_logits[i],
                                                              ref.first_logits,
                                                              args.logit_rtol)))
    sync(args.device)
    hf_s = time.perf_counter() - t0
    del hf
    free_device_memory(args.device)
    baselines = run_baselines(args, model_dir, prompts, reference, nano_out, reference_logits)

    print(f"\n{'prompt':>6} {'len':>5} {'match':>5} {'leading':>8} {'gap':>8}")
    for r in rows:
        gap = "" if r["gap"] is None else f"{r['gap']:.4g}"
        print(f"{r['prompt']:>6} {r['prompt_len']:>5} {'yes' if r['match'] else 'NO':>5} "
              f"{r['leading']:>5}/{args.max_tokens} {gap:>8}")
    print(f"\n{'prompt':>6} {'max|d|':>9} {'mean|d|':>9} {'max/std':>8} {'mean/std':>9} "
          f"{'tol':>8} {'top1':>5} {'top5':>5} {'ok':>4}")
    for r in logit_rows:
        print(f"{r['prompt']:>6} {r['max_abs']:>9.4g} {r['mean_abs']:>9.4g} "
              f"{r['max_rel_std']:>8.3g} {r['mean_rel_std']:>9.3g} {r['tol']:>8.4g} "
              f"{'yes' if r['top1'] else 'NO':>5} {'yes' if r['top5_exact'] else 'NO':>5} "
              f"{'yes' if r['within'] else 'NO':>4}")

    fraction = sum(r["match"] for r in rows) / len(rows)
    mean_leading = sum(r["leading"] for r in rows) / len(rows)
    logits_ok = all(r["within"] for r in logit_rows)
    tokens_ok = fraction >= args.min_match_fraction
    passed = tokens_ok and logits_ok
    gaps = [r["gap"] for r in rows if r["gap"] is not None]
    noise = max(r["max_abs"] for r in logit_rows)
    summary = dict(
        model=model_dir, device=args.device, dtype=args.dtype, num_prompts=len(prompts),
        max_tokens=args.max_tokens, prompt_len_range=[lo, hi],
        prompt_tokens=sum(len(p) for p in prompts), hf_attn=args.hf_attn, **info,
        hf_s=round(hf_s, 2),
        match_fraction=round(fraction, 4), mean_leading_match=round(mean_leading, 3),
        min_match_fraction=args.min_match_fraction,
        mismatched_prompts=[r["prompt"] for r in rows if not r["match"]],
        logit_prompts=len(logit_rows),
        logits_max_abs=round(max(r["max_abs"] for r in logit_rows), 6),
        logits_mean_abs=round(sum(r["mean_abs"] for r in logit_rows) / len(logit_rows), 6),
        logits_max_rel_std=round(max(r["max_rel_std"] for r in logit_rows), 6),
        logits_top1_agree=round(sum(r["top1"] for r in logit_rows) / len(logit_rows), 4),
        logits_top5_exact_agree=round(sum(r["top5_exact"] for r in logit_rows)
                                      / len(logit_rows), 4),
        logit_rtol=args.logit_rtol, logits_within_tolerance=logits_ok,
        divergence_gaps_max=round(max(gaps), 6) if gaps else None,
        divergences_within_logit_noise=sum(g <= noise for g in gaps), divergences=len(gaps),
        baselines=baselines, tokens_ok=tokens_ok, passed=passed,
    )
    print(f"\nGreedy tokens: {sum(r['match'] for r in rows)}/{len(rows)} prompts match all "
          f"{args.max_tokens} tokens ({fraction:.1%}; need {args.min_match_fraction:.0%}); "
          f"mean leading match {mean_leading:.2f}/{args.max_tokens}")
    print(f"Prefill logits ({len(logit_rows)} prompts): max|d| {summary['logits_max_abs']:.4g}, "
          f"mean|d| {summary['logits_mean_abs']:.4g}, max|d|/std "
          f"{summary['logits_max_rel_std']:.3g}, top-1 {summary['logits_top1_agree']:.0%}, "
          f"exact top-5 {summary['logits_top5_exact_agree']:.0%}; within tolerance "
          f"(max|d| <= {args.logit_rtol} * max|logit|, top-5 up to tol): "
          f"{'yes' if logits_ok else 'NO'}")
    if gaps:
        print(f"Divergences: at the first differing token, transformers preferred its own token "
              f"by {min(gaps):.4g}..{max(gaps):.4g} logits (median "
              f"{sorted(gaps)[len(gaps) // 2]:.4g}); {summary['divergences_within_logit_noise']}/"
              f"{len(gaps)} within the prefill logits' max|d| {noise:.4g}, i.e. near-ties")
    print(f"RESULT: {'PASS' if passed else 'FAIL'}")
    print(json.dumps(summary))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
