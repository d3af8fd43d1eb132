"""W2 online serving: requests arrive as a Poisson process at several rates and stream
through the whole pipeline (AsyncClient -> tokenizer -> scheduler -> workers -> detokenizer).

    nanopipe bench serving                                   # embedded SmolLM2, CPU
    nanopipe bench serving --make-random qwen3-0.6b --rates 4,16,64 \\
        --num-requests 256 --max-tokens 256                           # on the GPU machine

Per rate: TTFT (arrival to first streamed text) and inter-token latency (the gap between
two deltas, divided by the tokens the later one carried) at p50 and p99, output tok/s over
the span from the first arrival to the last finish, and how many requests completed; the
TTFT's median split from the requests' own metrics: queued in the scheduler, and from the
first step's planning to the first token at the scheduler. Every request sends seeded random
token ids (lengths uniform in --prompt-len-range) and asks for exactly --max-tokens greedy
tokens (ignore_eos). Arrivals are seeded, so a rerun replays the same schedule. Human lines,
then one JSON line per rate.

--make-random SHAPE   random bf16 weights of qwen3-0.6b, qwen3-8b or smollm2-135m (the
                      embedded model's shape), built on the device
--plot OUT.png        a figure of output tok/s, TTFT and ITL (p50, p99) against the rate
                      (needs matplotlib: the `bench` extra)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from frontend import AsyncClient, SamplingParams
from frontend.bench.common import emit, greedy, random_prompts
from frontend.bench.common.model_source import add_plans_ahead, resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol.model_config import read_model_config, vocab_size


@dataclass
class Trace:
    arrival: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    """Per-token inter-token latencies (seconds)."""
    queued: float | None = None
    """Seconds the request waited in the scheduler before its first step (its metrics)."""
    scheduled: float | None = None
    """Seconds from its first step's planning to its first token at the scheduler."""
    long: bool = False
    """One of a workload's long prompts (where it mixes two kinds)."""
    transfer_s: float | None = None
    """Its KV hand-off's time, with prefill and decode replicas (its final metrics)."""
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(client: AsyncClient, start: float, trace: Trace, prompt: list[int],
                      params: SamplingParams) -> None:
    await asyncio.sleep(max(0.0, start + trace.arrival - time.perf_counter()))
    last = time.perf_counter()
    try:
        async for delta in client.stream(prompt_token_ids=prompt, params=params):
            now = time.perf_counter()
            m = delta.metrics
            if m is not None and m.ttft_s is not None and trace.queued is None:
                trace.queued = m.queue_time_s or 0.0
                trace.scheduled = m.ttft_s - trace.queued
            if m is not None:
                trace.transfer_s = m.kv_transfer_s
            if not delta.token_ids:
                continue
            if trace.first is None:
                trace.first = now
            else:
                trace.gaps.extend([(now - last) / len(delta.token_ids)] * len(delta.token_ids))
            trace.tokens += len(delta.token_ids)
            last = now
    except Exception as exc:  # reported, not fatal: the other requests go on
        trace.error = repr(exc)
    trace.done = time.perf_counter()


async def run_rate(client: AsyncClient, rate: float, args: argparse.Namespace,
                   vocab: int) -> dict:
    rng = random.Random(f"{args.seed}-{rate}")
    lo, hi = args.prompt_len_range
    prompts = random_prompts(rng, args.num_requests, lo, hi, vocab)
    t, traces = 0.0, []
    for _ in prompts:
        traces.append(Trace(arrival=t))
        t += rng.expovariate(rate)
    params = greedy(args.max_tokens)
    start = time.perf_counter()
    await asyncio.gather(*(one_request(client, start, tr, p, params)
                           for tr, p in zip(traces, prompts, strict=True)))
    ok = [tr for tr in traces if tr.error is None and tr.first is not None]
    ttft = [tr.first - (start + tr.arrival) for tr in ok]
    itl = [g for tr in ok for g in tr.gaps]
    span = max(tr.done for tr in traces) - start
    produced = sum(tr.tokens for tr in traces)
    queued = [tr.queued for tr in ok if tr.queued is not None]
    scheduled = [tr.scheduled for tr in ok if tr.scheduled is not None]
    return dict(rate_req_s=rate, requests=len(traces), completed=len(ok),
                errors=[tr.error for tr in traces if tr.error][:3],
                output_tokens=produced, seconds=round(span, 3),
                output_tok_s=round(produced / span, 1),
                ttft_ms_p50=round(percentile(ttft, 0.5) * 1e3, 2),
                ttft_ms_p99=round(percentile(ttft, 0.99) * 1e3, 2),
                itl_ms_p50=round(percentile(itl, 0.5) * 1e3, 2),
                itl_ms_p99=round(percentile(itl, 0.99) * 1e3, 2),
                mean_ttft_ms=round(statistics.fmean(ttft) * 1e3, 2) if ttft else None,
                queued_ms_p50=round(percentile(queued, 0.5) * 1e3, 2),
                scheduled_to_first_ms_p50=round(percentile(scheduled, 0.5) * 1e3, 2))


async def serve_all(config: EngineConfig, args: argparse.Namespace) -> list[dict]:
    with Pipeline(config) as pipeline:
        async with AsyncClient(pipeline.address) as client:
            vocab = vocab_size(read_model_config(config.model_dir))
            await client.generate(prompt_token_ids=[1, 2, 3, 4], params=greedy(4))
            results = []
            for rate in args.rates:
                r = await run_rate(client, rate, args, vocab)
                results.append(r)
                print(f"rate {rate:g} req/s: {r['completed']}/{r['requests']} completed, "
                      f"{r['output_tok_s']:.1f} output tok/s; TTFT p50 {r['ttft_ms_p50']:.1f} ms "
                      f"p99 {r['ttft_ms_p99']:.1f} ms; ITL p50 {r['itl_ms_p50']:.2f} ms "
                      f"p99 {r['itl_ms_p99']:.2f} ms; TTFT split p50: queued "
                      f"{r['queued_ms_p50']:.1f} ms, scheduled to first token "
                      f"{r['scheduled_to_first_ms_p50']:.1f} ms", flush=True)
                emit(**r)
            return results


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rates", default="0.5,1,2",
                    type=lambda s: [float(x) for x in s.split(",")],
                    help="arrival rates in requests per second, comma-separated")
    ap.add_argument("--num-requests", type=int, default=24, help="requests per rate")
    ap.add_argument("--prompt-len-range", type=int, nargs=2, default=[32, 256],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker-lookahead", action=argparse.BooleanOptionalAction, default=True)
    add_plans_ahead(ap)
    ap.add_argument("--plot", metavar="OUT.png", help="write a figure of the results")


def run(args: argparse.Namespace) -> list[Figure]:
    lo, hi = args.prompt_len_range
    if not 1 <= lo <= hi or args.num_requests < 1 or args.max_tokens < 1:
        raise BenchUsageError("need 1 <= MIN <= MAX, --num-requests >= 1 and --max-tokens >= 1")
    if not args.rates or min(args.rates) <= 0:
        raise BenchUsageError("--rates must be positive")
    if args.plot:
        import matplotlib  # noqa: F401  (fail before the runs, not after them)

    model = resolve_model_dir(args, args.device, tokenizer=True)
    config = EngineConfig(model=model, device=args.device, max_num_seqs=args.max_num_seqs,
                          max_model_len=hi + args.max_tokens,
                          worker_lookahead=args.worker_lookahead,
                          plans_ahead=args.plans_ahead)
    print(f"W2 serving: {config.model_name} on {config.resolved_device}, "
          f"{args.num_requests} requests per rate, prompts {lo}-{hi} tokens, "
          f"{args.max_tokens} output tokens each; {time.strftime('%Y-%m-%d')}", flush=True)
    results = asyncio.run(serve_all(config, args))
    if args.plot:
        from frontend.bench.common.plots import plot_serving

        print(f"figure: {plot_serving(results, args.plot)}", flush=True)
    return serving_figures(results)


def serving_figures(results: list[dict]) -> list[Figure]:
    """Per rate: output tok/s, TTFT and ITL at p50 and p99 (times: lower is better)."""
    figures = []
    for r in results:
        at = f"@{r['rate_req_s']:g}"
        figures.append(Figure(f"output_tok_s{at}", r["output_tok_s"], "tok/s"))
        figures += [Figure(f"{key}{at}", r[key], "ms", higher_is_better=False)
                    for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")]
    return figures

