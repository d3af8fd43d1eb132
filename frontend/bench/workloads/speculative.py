"""W6 speculative decoding: by default the real SmolLM2-135M-Instruct (the embedded default
model; float32 on the CPU), greedy, the whole pipeline, without speculation, with
`--speculative ngram` and (with --draft-layers N) with `--speculative draft` whose draft is
the model's own first N layers (frontend.bench.common.truncate), in the same run, on a
copy-heavy workload (repeat a paragraph, edit a piece of code).

    nanopipe bench speculative                          # batch 1 and 8, K=6, n=3
    nanopipe bench speculative --batch-sizes 1 --k 4,8 --ngram 3,2 --rounds 3
    nanopipe bench speculative --draft-layers 4 --new-tokens 48 --batch1-prompts 2

Batch 1 sends the prompts one after another, batch B sends B at once (streaming clients).
Prints per mode and batch size: TPOT (mean over requests of (last - first token) / (tokens -
1)), output tok/s (tokens / wall time), the engine's acceptance rate (accepted / proposed, from
its published EngineStats), and asserts that the greedy tokens are identical in every mode.
--k and --ngram take lists (one n-gram mode per pair); every engine stays up and --rounds
alternates between them, so a shared machine's load falls on all alike; compare the ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime as dt
import os
import platform
import statistics
import tempfile
import time

import zmq

from frontend import LLM, Client, SamplingParams
from frontend.bench.common import truncate_model
from frontend.bench.common.copy_tasks import COPY_TASKS
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.figures import Figure
from protocol import Decoder
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats


def latest_stats(address: str) -> EngineStats:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
    sub.connect(address)
    try:
        deadline, last = time.monotonic() + 3.0, None
        while time.monotonic() < deadline:  # the newest of ~2 s of messages (sent every 0.5 s)
            if sub.poll(100):
                last = Decoder(EngineStats).decode(sub.recv())
        return last
    finally:
        sub.close(0)


def run_batch(client: Client, prompts: list[str], batch: int, params: SamplingParams):
    """Token ids per prompt, TPOT (s) and output tok/s."""
    def one(prompt: str):
        first = end = None
        tokens: list[int] = []
        for delta in client.stream(messages=[{"role": "user", "content": prompt}],
                                   params=params):
            if delta.token_ids:
                now = time.perf_counter()
                first = first or now
                end = now
                tokens.extend(delta.token_ids)
        tpot = (end - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        return tokens, tpot

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as pool:
        out = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    tokens = [t for t, _ in out]
    tpot = sum(p for _, p in out) / len(out)
    return tokens, tpot, sum(map(len, tokens)) / wall


def mode_options(args) -> dict[str, dict]:
    """The engine options of every mode: off, one n-gram mode per (K, n), and the draft."""
    modes: dict[str, dict] = {"off": {}}
    if args.off_no_overlap:  # what losing overlap alone costs (speculation turns it off)
        modes["off, no overlap"] = {"overlap": False}
    for k in (int(v) for v in args.k.split(",")):
        for n in (int(v) for v in args.ngram.split(",")):
            modes[f"ngram K={k} n={n}"] = {"speculative": "ngram", "num_speculative_tokens": k,
                                           "ngram_size": n}
    return modes


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--k", default="6", help="proposal lengths, comma-separated (one mode each)")
    ap.add_argument("--ngram", default="3", help="n-gram sizes, comma-separated (one mode each)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every mode this many times, interleaved (all engines stay up)")
    ap.add_argument("--off-no-overlap", action="store_true",
                    help="also run without speculation and without overlap")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="also run --speculative draft with the model's first N layers (0: no)")


def run(args: argparse.Namespace) -> list[Figure]:
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = mode_options(args)
    tmp = tempfile.TemporaryDirectory(prefix="bench_spec_draft_")
    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = str(default_model_dir())
    dtype = "float32" if args.device == "cpu" else None
    if args.draft_layers:
        draft = truncate_model(model_dir, tmp.name, args.draft_layers)
        modes["draft"] = {"speculative": "draft",
                          "num_speculative_tokens": int(args.k.split(",")[0]),
                          "draft_model": str(draft)}
    # Every engine stays up and the rounds alternate between them, so the load of a shared
    # machine falls on every mode alike; the ratios are taken within a round.
    results: dict = {}
    with contextlib.ExitStack() as stack:
        engines = {}
        for mode, extra in modes.items():
            llm = stack.enter_context(LLM(model_dir, device=args.device, dtype=dtype, **extra))
            client = stack.enter_context(Client(llm.pipeline.address))
            run_batch(client, ["Say hello."], 1, SamplingParams(temperature=0, max_tokens=8))
            engines[mode] = llm, client
        for r in range(args.rounds):
            for b in sizes:
                prompts = (COPY_TASKS[:args.batch1_prompts] if b == 1
                           else (COPY_TASKS * b)[:b])
                for mode, (_, client) in engines.items():
                    results[mode, b, r] = run_batch(client, prompts, b, params)
        for mode, (llm, _) in engines.items():
            stats = latest_stats(llm.pipeline.endpoints.deltas_pub)
            if mode != "off" and stats is not None and stats.spec_proposed_tokens:
                rate = stats.spec_accepted_tokens / stats.spec_proposed_tokens
                print(f"{mode} acceptance: {stats.spec_accepted_tokens} of "
                      f"{stats.spec_proposed_tokens} proposed tokens ({rate:.1%})")
    tmp.cleanup()
    draft = f", draft = first {args.draft_layers} layers" if args.draft_layers else ""
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, {dt.date.today()}{draft}, {args.new_tokens} new "
          f"tokens max, {args.rounds} round(s)")
    figures = []
    for b in sizes:
        tps = statistics.median(results["off", b, r][2] for r in range(args.rounds))
        tpot = statistics.median(results["off", b, r][1] for r in range(args.rounds))
        figures += [Figure(f"output_tok_s@{b}[off]", round(tps, 2), "tok/s"),
                    Figure(f"tpot_ms@{b}[off]", round(tpot * 1e3, 3), "ms",
                           higher_is_better=False)]
    for mode in [m for m in modes if m != "off"]:
        for b in sizes:
            ratios = []
            for r in range(args.rounds):
                (t0, tpot0, tps0), (t1, tpot1, tps1) = results["off", b, r], results[mode, b, r]
                assert t0 == t1, f"{mode}, batch {b}: greedy tokens differ with speculation"
                ratios.append(tps1 / tps0)
                print(f"{mode}, batch {b}, round {r}: TPOT {tpot0 * 1e3:.1f} -> "
                      f"{tpot1 * 1e3:.1f} ms, output {tps0:.1f} -> {tps1:.1f} tok/s "
                      f"({tps1 / tps0:.2f}x), identical tokens ({sum(map(len, t0))} tokens)")
            if args.rounds > 1:
                print(f"{mode}, batch {b}: median {statistics.median(ratios):.2f}x over "
                      f"{args.rounds} rounds ({', '.join(f'{x:.2f}' for x in ratios)})")
            name = "" if mode == next(m for m in modes if m != "off") else f"[{mode}]"
            tps = statistics.median(results[mode, b, r][2] for r in range(args.rounds))
            figures += [Figure(f"speedup@{b}{name}", round(statistics.median(ratios), 3), "x"),
                        Figure(f"output_tok_s@{b}[{mode}]", round(tps, 2), "tok/s")]
    return figures

