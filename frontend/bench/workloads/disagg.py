"""Prefill/decode disaggregation on W2 mixed traffic: a Poisson stream of short chats with a
share of long prompts, served by one colocated pipeline, by `--dp 2`, and by one prefill and
one decode replica (P=1 D=1; disagg-frames and disagg-shared name how the KV moves, see
--kv-transfer), each at the same offered load (the same seeded schedule).

    nanopipe bench disagg --model DIR --device cpu               # small, e.g. a tiny model
    nanopipe bench disagg --make-random qwen3-0.6b --rate 16 --num-requests 400 \\
        --long-len-range 4096 8192                                # on the GPU machine

What disaggregation is for: a long prompt's prefill no longer stalls the decode steps of the
short requests, so their inter-token latency (ITL p99 of the short requests) should stay at
the decode step's. Per mode: ITL p50/p99 of the short requests, TTFT p50/p99 (all requests),
output tok/s over the span from the first arrival to the last finish; with P=1 D=1 also the
transfer bandwidth (bytes landed on the decode replica / its summed transfer time) and the
per-request transfer cost (its metrics' kv_transfer_s, p50/p99). On one GPU the two replicas
share it (half the memory each); on the CPU the processes share the cores, so the CPU figures
say that the path works and what a transfer costs there, not what the split buys.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from frontend import AsyncClient
from frontend.bench.common import StatsFollower, emit, greedy, random_prompts, sig
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from frontend.bench.workloads.serving import Trace, one_request, percentile
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol.model_config import read_model_config, vocab_size

SPLIT = {"prefill_replicas": 1, "decode_replicas": 1}
MODES = {"colocated": {}, "dp2": {"data_parallel_size": 2}, "disagg": SPLIT,
         "disagg-frames": {**SPLIT, "kv_transfer": "frames"},
         "disagg-shared": {**SPLIT, "kv_transfer": "shared"}}
"""disagg takes --kv-transfer auto (shared where it can work: the CPU, one GPU, GPUs with peer
access; frames otherwise: frontend.engine.disagg.kv_transfer_mode); the others name it."""


def schedule(args: argparse.Namespace, vocab: int) -> list[tuple[Trace, list[int]]]:
    """The same arrivals, prompts and long/short mix for every mode."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.num_requests):
        long = rng.random() < args.long_share
        lo, hi = args.long_len_range if long else args.short_len_range
        out.append((Trace(arrival=t, long=long), random_prompts(rng, 1, lo, hi, vocab)[0]))
        t += rng.expovariate(args.rate)
    return out


async def run_mode(config: EngineConfig, args: argparse.Namespace, mode: str) -> dict:
    print(f"{mode}: starting", flush=True)  # so that a run cut short says where it was
    with Pipeline(config) as pipeline:
        print(f"{mode}: {pipeline.startup.line() if pipeline.startup else 'ready'}", flush=True)
        followers = [StatsFollower(r.deltas_pub, r.keys) for r in pipeline.replicas]
        try:
            async with AsyncClient(pipeline.address) as client:
                vocab = vocab_size(read_model_config(config.model_dir))
                await client.generate(prompt_token_ids=[1, 2, 3, 4], params=greedy(4))
                before = [f.after(time.monotonic()) for f in followers]
                plan = schedule(args, vocab)
                start = time.perf_counter()
                await asyncio.gather(*(one_request(
                    client, start, tr, p, greedy(args.long_out if tr.long else args.short_out))
                    for tr, p in plan))
                after = [f.after(time.monotonic()) for f in followers]
        finally:
            for f in followers:
                f.close()
    traces = [tr for tr, _ in plan]
    ok = [tr for tr in traces if tr.error is None and tr.first is not None]
    ttft = [tr.first - (start + tr.arrival) for tr in ok]
    short_itl = [g for tr in ok if not tr.long for g in tr.gaps]
    span = max(tr.done for tr in traces) - start
    produced = sum(tr.tokens for tr in traces)
    moved = sum(a.kv_transfer_bytes_in - b.kv_transfer_bytes_in for a, b in zip(after, before))
    moved_s = sum(a.kv_transfer_s - b.kv_transfer_s for a, b in zip(after, before))
    transfers = [tr.transfer_s for tr in ok if tr.transfer_s is not None]
    ms = lambda values, q: round(percentile(values, q) * 1e3, 2)  # noqa: E731
    return dict(requests=len(traces), long=sum(tr.long for tr in traces), completed=len(ok),
                errors=[tr.error for tr in traces if tr.error][:3], seconds=round(span, 3),
                output_tok_s=round(produced / span, 1),
                short_itl_ms_p50=ms(short_itl, 0.5), short_itl_ms_p99=ms(short_itl, 0.99),
                ttft_ms_p50=ms(ttft, 0.5), ttft_ms_p99=ms(ttft, 0.99),
                handoffs=len(transfers), transfer_mib=round(moved / 2**20, 2),
                transfer_gib_s=sig(moved / moved_s / 2**30) if moved_s else None,
                transfer_ms_p50=ms(transfers, 0.5) if transfers else None,
                transfer_ms_p99=ms(transfers, 0.99) if transfers else None)


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--modes", default=None, type=lambda s: s.split(","),
                    help=f"comma-separated, of {list(MODES)} (default: colocated, dp2 and "
                    "disagg; on cuda with one GPU, colocated, disagg-frames and disagg-shared: "
                    "dp2's replicas each need a GPU, while the prefill and decode replicas "
                    "share one)")
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--long-share", type=float, default=0.2,
                    help="share of the requests with a long prompt")
    ap.add_argument("--short-len-range", type=int, nargs=2, default=[16, 64],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--long-len-range", type=int, nargs=2, default=[384, 512],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--short-out", type=int, default=32, help="tokens each short request asks")
    ap.add_argument("--long-out", type=int, default=8, help="tokens each long request asks")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the chunk a long prompt is prefilled in (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0)


def default_modes(device: str) -> list[str]:
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print("one GPU visible: dp2 left out (each of its replicas needs a GPU)", flush=True)
            return ["colocated", "disagg-frames", "disagg-shared"]
    return ["colocated", "dp2", "disagg"]


def run(args: argparse.Namespace) -> list[Figure]:
    if args.modes is None:
        args.modes = default_modes(args.device)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not 0 <= args.long_share <= 1 or args.rate <= 0 or args.num_requests < 1:
        raise BenchUsageError(f"--modes of {list(MODES)}, --long-share in [0, 1], a positive "
                              "--rate and --num-requests >= 1")
    model = resolve_model_dir(args, args.device, tokenizer=True)
    longest = max(args.long_len_range[1] + args.long_out,
                  args.short_len_range[1] + args.short_out)
    print(f"W2 mixed traffic over {args.modes}: {args.num_requests} requests at {args.rate:g}/s, "
          f"{args.long_share:.0%} long ({args.long_len_range[0]}-{args.long_len_range[1]} "
          f"tokens, {args.long_out} out), the rest short ({args.short_len_range[0]}-"
          f"{args.short_len_range[1]}, {args.short_out} out), {args.device}; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    figures = []
    for mode in args.modes:
        config = EngineConfig(model=model, device=args.device, max_model_len=longest,
                              dtype="float32" if args.device == "cpu" else None,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              log_stats_interval=0, **MODES[mode])
        r = asyncio.run(run_mode(config, args, mode))
        transfer = "" if not r["handoffs"] else (
            f"; {r['handoffs']} hand-offs, {r['transfer_mib']} MiB at "
            f"{r['transfer_gib_s']} GiB/s, {r['transfer_ms_p50']} ms p50 / "
            f"{r['transfer_ms_p99']} ms p99 per request")
        print(f"{mode}: {r['completed']}/{r['requests']} completed, {r['output_tok_s']} output "
              f"tok/s; short ITL p50 {r['short_itl_ms_p50']} ms p99 {r['short_itl_ms_p99']} ms; "
              f"TTFT p50 {r['ttft_ms_p50']} ms p99 {r['ttft_ms_p99']} ms{transfer}", flush=True)
        emit(mode=mode, **r)
        figures += [Figure(f"output_tok_s[{mode}]", r["output_tok_s"], "tok/s")]
        figures += [Figure(f"{k}[{mode}]", r[k], "ms", higher_is_better=False)
                    for k in ("short_itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99")]
        if r["handoffs"]:
            figures += [Figure(f"transfer_gib_s[{mode}]", r["transfer_gib_s"], "GiB/s"),
                        Figure(f"transfer_ms_p50[{mode}]", r["transfer_ms_p50"], "ms",
                               higher_is_better=False),
                        Figure(f"transfer_ms_p99[{mode}]", r["transfer_ms_p99"], "ms",
                               higher_is_better=False)]
    return figures
