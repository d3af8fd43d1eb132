"""Tensor parallelism through the whole pipeline: greedy parity against the first TP size, and
W1 offline throughput at each TP size with its ratio to the hardware bound of that many GPUs.

    nanopipe bench tp --make-random qwen3-8b --tp 1,2          # on a 2-GPU machine
    nanopipe bench tp --model DIR --device cpu --tp 1,2 --num-prompts 4 \\
        --max-tokens 8 --w1-num-seqs 4                                   # CPU smoke run (gloo)

Parity: --num-prompts prompts of seeded random token ids (lengths 16-256), temperature 0,
ignore_eos, --max-tokens new tokens, through frontend.LLM at each TP size; every size after the
first is compared with the first, prompt by prompt (full match, leading-match length). bf16 TP
changes the reduction order of the row-parallel all-reduces, so greedy tokens may part where two
logits nearly tie; the tool reports the match rather than assuming it, and exits non-zero only
when the fraction of fully matching prompts falls below --min-match.

W1 (docs/benchmarks.md, frontend.bench.common.w1_workload): temperature 0.6, ignore_eos, one warm-up
request. The bound for TP=N is frontend.bench.common.hardware_bound_s divided by N: N GPUs have
N times the copy bandwidth and matmul rate measured on the first of them before any engine
starts (nominal H200 figures on the CPU). Only one pipeline is alive at a time. Random
weights are built once (on the device) and reused for every TP size, then deleted.

Human lines, and one JSON line per result (its "result" key names what it is).
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import subprocess
import sys
import time

from frontend import LLM
from frontend.bench.ceilings import DeviceCeilings, device_ceilings
from frontend.bench.common import (
    SHAPES,
    Throughput,
    emit,
    greedy,
    hardware_bound_s,
    leading_match,
    param_count,
    param_shapes,
    random_prompts,
    sig,
    timed_w1,
    w1_workload,
)
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchFailed, BenchUsageError
from frontend.bench.figures import Figure
from gpu_workers import ModelConfig

PARITY_MIN_LEN, PARITY_MAX_LEN = 16, 256


def parity_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    return random_prompts(random.Random(seed), n, PARITY_MIN_LEN, PARITY_MAX_LEN, vocab)


def make_llm(model_dir: str, tp: int, args: argparse.Namespace, max_model_len: int,
             all_reduce: str = "nccl") -> LLM:
    return LLM(model_dir, tensor_parallel_size=tp, device=args.device,
               max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
               enforce_eager=args.enforce_eager, overlap=not args.no_overlap,
               worker_lookahead=args.worker_lookahead, peer_all_reduce=all_reduce == "peer")


def run_greedy(model_dir: str, tp: int, args: argparse.Namespace,
               prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    max_model_len = max(len(p) for p in prompts) + args.max_tokens
    llm = make_llm(model_dir, tp, args, max_model_len, args.all_reduce.split(",")[0])
    try:
        params = greedy(args.max_tokens)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    return [o["token_ids"] for o in outputs], elapsed


def compare(ref_tp: int, ref: list[list[int]], tp: int, got: list[list[int]],
            what: str = "parity") -> float:
    per_prompt = []
    for k, (a, b) in enumerate(zip(ref, got, strict=True)):
        lead = leading_match(a, b)
        full = a == b
        per_prompt.append(dict(prompt=k, full_match=full, leading_match=lead, tokens=len(a)))
        print(f"  prompt {k:3d}: {'match' if full else 'DIFFERS'} "
              f"(leading match {lead}/{len(a)})", flush=True)
    fraction = sum(p["full_match"] for p in per_prompt) / len(per_prompt)
    mean_lead = sum(p["leading_match"] for p in per_prompt) / len(per_prompt)
    print(f"{what} TP={tp} vs TP={ref_tp}: {fraction:.3f} of prompts match fully; "
          f"mean leading match {mean_lead:.2f} of {len(ref[0])} tokens", flush=True)
    emit(result=what, tp=tp, reference_tp=ref_tp, num_prompts=len(per_prompt),
         match_fraction=round(fraction, 4), mean_leading_match=round(mean_lead, 3),
         per_prompt=per_prompt)
    return fraction


def serve_check(model_dir: str, tp: int, args: argparse.Namespace,
                prompts: list[list[int]]) -> list[list[int]]:
    """Serve as a user does — `nanopipe serve --tp N` — and send every prompt through a Client
    (all in flight at once); SIGTERM must then stop every process with exit status 0."""
    from frontend import Client

    max_model_len = max(len(p) for p in prompts) + args.max_tokens
    cmd = [sys.executable, "-m", "frontend.engine.cli", "--model", model_dir, "--tp", str(tp),
           "--device", args.device, "--max-model-len", str(max_model_len), "--no-http"]
    if not args.worker_lookahead:
        cmd.append("--no-worker-lookahead")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = None
        for line in proc.stdout:
            print(f"  serve: {line.rstrip()}", flush=True)
            if line.startswith("clients connect to: "):
                address = line.split(": ", 1)[1].strip()
                break
        if address is None:
            raise SystemExit(f"serve --tp {tp} exited with {proc.wait()} before serving")
        print(f"serve TP={tp}: ready in {time.perf_counter() - t0:.1f} s at {address}",
              flush=True)
        params = greedy(args.max_tokens)
        with Client(address) as client:
            streams = [client.stream(prompt_token_ids=p, params=params) for p in prompts]
            served = [[t for delta in s for t in delta.token_ids] for s in streams]
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    for line in rest.splitlines():
        print(f"  serve: {line}", flush=True)
    print(f"serve TP={tp}: {len(served)} requests answered; serve exited with "
          f"{proc.returncode} after SIGTERM", flush=True)
    emit(result="serve", tp=tp, requests=len(served), exit_status=proc.returncode)
    if proc.returncode != 0:
        raise SystemExit(f"serve --tp {tp} exited with {proc.returncode} after SIGTERM")
    return served


def run_w1(model_dir: str, tp: int, args: argparse.Namespace, work,
           bound_1gpu_s: float, all_reduce: str, ceilings: DeviceCeilings) -> dict:
    llm = make_llm(model_dir, tp, args, args.w1_max_input_len + args.w1_max_output_len,
                   all_reduce)
    try:
        produced, elapsed = timed_w1(llm, work)
    finally:
        llm.close()
    t = Throughput(produced, elapsed, bound_1gpu_s / tp)
    result = dict(result="w1", tp=tp, all_reduce=all_reduce if tp > 1 else None,
                  num_seqs=len(work), output_tokens=produced,
                  seconds=round(elapsed, 3), output_tok_s=round(t.tok_s, 1),
                  hardware_bound_s=sig(t.bound_s), hardware_bound_tok_s=round(t.bound_tok_s, 1),
                  ratio_to_bound=sig(t.ratio), ceilings=ceilings.record())
    via = f" ({all_reduce} all-reduce)" if tp > 1 else ""
    print(f"W1 TP={tp}{via}: {t.tok_s:.1f} output tok/s ({produced} tokens in {elapsed:.2f} s); "
          f"hardware bound for {tp} GPU(s) {t.bound_tok_s:.0f} tok/s ({ceilings.describe()}); "
          f"ratio {t.ratio:.4g}", flush=True)
    emit(**result)
    return result


MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tp", default="1,2", help="TP sizes; parity compares each with the first")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-match", type=float, default=0.95,
                    help="exit non-zero when fewer prompts than this fraction match fully")
    ap.add_argument("--seed", type=int, default=0, help="seed of the parity prompts")
    ap.add_argument("--w1-num-seqs", type=int, default=256)
    ap.add_argument("--w1-max-input-len", type=int, default=1024)
    ap.add_argument("--w1-max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--worker-lookahead", action=argparse.BooleanOptionalAction, default=True,
                    help="workers launch the next step before this one's tokens reach the host "
                    "(default on, as in the engine)")
    ap.add_argument("--all-reduce", default="nccl", choices=("nccl", "peer", "nccl,peer"),
                    help="how TP > 1 all-reduces small tensors: nccl (the engine's default) or "
                    "peer (through the ranks' memory, --peer-all-reduce); nccl,peer runs W1 "
                    "with each (parity: the first)")
    ap.add_argument("--skip-w1", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--serve-check", action="store_true",
                    help="also serve with `nanopipe serve --tp N` (largest N) and send the "
                         "parity prompts through a Client")


def run(args: argparse.Namespace) -> list[Figure]:
    tps = [int(t) for t in args.tp.split(",") if t.strip()]
    if not tps or min(tps) < 1:
        raise BenchUsageError("--tp needs one or more sizes >= 1")
    if min(args.w1_max_input_len, args.w1_max_output_len) < 100:
        raise BenchUsageError("W1 draws lengths with randint(100, max): "
                              "--w1-max-*-len must be >= 100")
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise BenchUsageError("--num-prompts and --max-tokens must be >= 1")
    if args.make_random:
        shape = SHAPES[args.make_random]
        n = sum(math.prod(s) for s in param_shapes(shape).values())
        print(f"{args.make_random}: {n:,} parameters ({n / 1e9:.2f} B) from param_shapes",
              flush=True)
    # Before anything here holds a device; only W1 has a hardware bound.
    ceilings = None if args.skip_w1 else device_ceilings(args.device)
    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    code, figures = bench(model_dir, tps, args, ceilings)
    if code:
        raise BenchFailed("TP parity below --min-match", figures)
    return figures


def bench(model_dir: str, tps: list[int], args: argparse.Namespace,
          ceilings: DeviceCeilings | None) -> tuple[int, list[Figure]]:
    """Parity, then W1 per TP size against the bound at `ceilings` (None: W1 skipped)."""
    mc = ModelConfig.from_dir(model_dir)
    num_params = param_count(model_dir)
    print(f"model {model_dir}: {mc.model_type}, {num_params:,} parameters, dtype {mc.dtype}, "
          f"device {args.device}, TP sizes {tps}", flush=True)
    emit(result="model", model_type=mc.model_type, num_params=num_params, dtype=str(mc.dtype),
         device=args.device, tp=tps)
    code, figures = 0, []

    if not args.skip_parity and len(tps) < 2:
        print("parity skipped: it needs two or more TP sizes", flush=True)
    elif not args.skip_parity:
        prompts = parity_prompts(args.num_prompts, mc.vocab_size, args.seed)
        print(f"parity: {len(prompts)} prompts of {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} tokens, {args.max_tokens} greedy tokens each",
              flush=True)
        tokens = {}
        for tp in tps:
            tokens[tp], elapsed = run_greedy(model_dir, tp, args, prompts)
            print(f"greedy TP={tp}: {elapsed:.2f} s", flush=True)
        if args.serve_check:
            served = serve_check(model_dir, max(tps), args, prompts)
            compare(max(tps), tokens[max(tps)], max(tps), served,
                    what="serve+Client vs LLM")
        for tp in tps[1:]:
            fraction = compare(tps[0], tokens[tps[0]], tp, tokens[tp])
            figures.append(Figure(f"parity_match@tp{tp}", round(fraction, 4), "of prompts"))
            if fraction < args.min_match:
                print(f"FAIL: TP={tp} matches TP={tps[0]} on {fraction:.3f} of prompts "
                      f"(< --min-match {args.min_match})", flush=True)
                code = 1

    if ceilings is not None:
        work = w1_workload(args.w1_num_seqs, args.w1_max_input_len, args.w1_max_output_len,
                           mc.vocab_size)
        bound_1gpu_s, parts = hardware_bound_s(mc, num_params, work, ceilings)
        print(f"W1: {len(work)} sequences, {sum(len(p) for p, _ in work)} prompt tokens, "
              f"up to {sum(m for _, m in work)} output tokens; one-GPU bound "
              f"{bound_1gpu_s:.4g} s ({', '.join(f'{k} {v:.4g}' for k, v in parts.items())})",
              flush=True)
        results = [run_w1(model_dir, tp, args, work, bound_1gpu_s, how, ceilings)
                   for tp in tps for how in (args.all_reduce.split(",") if tp > 1 else ["-"])]
        ref = results[0]
        figures += [Figure(f"output_tok_s@tp{r['tp']}"
                           + ("" if r["all_reduce"] in (None, "nccl") else f"[{r['all_reduce']}]"),
                           r["output_tok_s"], "tok/s", bound=r["hardware_bound_tok_s"])
                    for r in results]
        for r in results[1:]:
            scaling = r["output_tok_s"] / ref["output_tok_s"]
            print(f"W1 scaling TP={r['tp']}/TP={ref['tp']} ({r['all_reduce']} all-reduce): "
                  f"{scaling:.3f}x (ideal {r['tp'] / ref['tp']:.1f}x)", flush=True)
            emit(result="w1_scaling", tp=r["tp"], reference_tp=ref["tp"],
                 all_reduce=r["all_reduce"], scaling=round(scaling, 4),
                 ideal=r["tp"] / ref["tp"])
    return code, figures

