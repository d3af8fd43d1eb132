"""Data parallelism on W3-style traffic: several groups of requests, each group behind its own
long shared prefix, served by 2 replicas; prefix-affinity routing against round robin in the
same run, and the router's own speed.

    nanopipe bench dp --model DIR --device cpu        # e.g. a tiny model

Per routing mode a fresh pipeline (LLM, data_parallel_size=2) gets the first request of each
group, then (once every replica has published stats saying so, as the router learns it) all the
others at once (as `nanopipe bench prefix` does with one group). Measured from
the EngineStats each replica publishes: prompt tokens computed and served from the prefix
cache; from the client side: wall time and output tok/s. Then the router alone
(frontend.router.Router) places the same prompts in a loop: decisions per second, and the
bytes of its prefix summary per replica.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from frontend import LLM
from frontend.bench.common import StatsFollower, greedy, random_ids, random_prompts
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.figures import Figure
from frontend.router import Router, RouterConfig


def make_groups(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(args.seed)
    lo, hi = args.suffix_len_range
    groups = []
    for _ in range(args.groups):
        prefix = random_ids(rng, args.prefix_len, vocab)
        groups.append([prefix + s for s in random_prompts(rng, args.per_group, lo, hi, vocab)])
    return groups


def run_mode(args: argparse.Namespace, routing: str, groups: list[list[list[int]]]) -> dict:
    params = greedy(args.max_tokens)
    with LLM(args.model_dir, device=args.device,
             dtype="float32" if args.device == "cpu" else None, data_parallel_size=args.dp,
             routing=routing, max_model_len=args.max_model_len, block_size=args.block_size,
             kv_cache_bytes=args.kv_cache_bytes) as llm:
        followers = [StatsFollower(r.deltas_pub, r.keys) for r in llm.pipeline.replicas]
        try:
            before = [f.after(time.monotonic()) for f in followers]
            firsts = [g[0] for g in groups]
            rest = [p for g in groups for p in g[1:]]
            start = time.perf_counter()
            out = llm.generate(firsts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            # The router learns that the first requests finished from the stats the replicas
            # publish as soon as a step finishes requests; until then it counts them as work
            # ahead. They normally arrive before the next request; waiting for them (a few
            # milliseconds) keeps a slow machine's race out of what this measures: routing.
            warmed = time.monotonic()
            for f in followers:
                f.after(warmed)
            start = time.perf_counter()
            out += llm.generate(rest, params, use_tqdm=False)
            elapsed += time.perf_counter() - start
            done = time.monotonic()
            after = [f.after(done) for f in followers]
        finally:
            for f in followers:
                f.close()
    computed = [a.prompt_tokens - b.prompt_tokens for a, b in zip(after, before)]
    cached = [a.cached_prompt_tokens - b.cached_prompt_tokens for a, b in zip(after, before)]
    finished = [a.finished_requests - b.finished_requests for a, b in zip(after, before)]
    produced = sum(len(r["token_ids"]) for r in out)
    return dict(routing=routing, requests=len(out), prompt_tokens=sum(map(len, firsts + rest)),
                prefill_computed=sum(computed), prefill_cached=sum(cached),
                requests_per_replica=finished, computed_per_replica=computed,
                seconds=round(elapsed, 2), output_tok_s=round(produced / elapsed, 1))


def router_speed(args: argparse.Namespace, groups: list[list[list[int]]], routing: str,
                 kv_blocks: int) -> tuple[float, list[int]]:
    """Decisions per second of the router alone, and its summary bytes per replica."""
    config = RouterConfig(tuple(f"r{i}" for i in range(args.dp)),
                          tuple(f"p{i}" for i in range(args.dp)), block_size=args.block_size,
                          kv_blocks=(kv_blocks,) * args.dp, routing=routing)
    router = Router(config)
    prompts = [p for g in groups for p in g]
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:
        for p in prompts:
            router.place(p)
        n += len(prompts)
    rate = n / (time.perf_counter() - start)
    return rate, [s.compact_bytes for s in router.summaries]


MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--routing", choices=("affinity", "round_robin"), action="append",
                    help="routing modes to run, in order (default: both)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--suffix-len-range", type=int, nargs=2, default=[8, 32],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[Figure]:
    modes = args.routing or ["affinity", "round_robin"]
    args.max_model_len = args.prefix_len + args.suffix_len_range[1] + args.max_tokens
    args.model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    with open(f"{args.model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    groups = make_groups(args, vocab)
    print(f"W3 over {args.dp} replicas: {args.groups} groups x {args.per_group} requests, prefix "
          f"{args.prefix_len} + suffix {args.suffix_len_range[0]}-{args.suffix_len_range[1]}, "
          f"{args.max_tokens} output tokens each, "
          f"{args.device}; {time.strftime('%Y-%m-%d')}", flush=True)
    results = {}
    for mode in modes:
        r = results[mode] = run_mode(args, mode, groups)
        print(f"{mode}: {r['prefill_computed']} of {r['prompt_tokens']} prompt tokens computed "
              f"({r['prefill_cached']} from the prefix cache), requests per replica "
              f"{r['requests_per_replica']}, {r['output_tok_s']} output tok/s "
              f"({r['seconds']} s)", flush=True)
        print(json.dumps(r), flush=True)
    figures = [Figure(f"output_tok_s[{m}]", r["output_tok_s"], "tok/s")
               for m, r in results.items()]
    if len(results) == 2:
        a, rr = results["affinity"], results["round_robin"]
        saved = 1 - a["prefill_computed"] / rr["prefill_computed"]
        print(f"affinity computed {saved:.1%} fewer prefill tokens than round robin; "
              f"{rr['seconds'] / a['seconds']:.2f}x the throughput (same run)", flush=True)
        figures += [Figure("prefill_saved_pct", round(100 * saved, 2), "%"),
                    Figure("speedup", round(rr["seconds"] / a["seconds"], 3), "x")]
    for mode in modes:
        rate, summary = router_speed(args, groups, mode, kv_blocks=4096)
        print(f"router alone, {mode}: {rate:,.0f} decisions/s ({args.prefix_len + 20}-token "
              f"prompts); prefix summary {summary} bytes per replica (8 per block hash, at most "
              f"8 x the replica's KV blocks)", flush=True)
        figures.append(Figure(f"router_decisions_per_s[{mode}]", round(rate), "1/s"))
    return figures
