"""Fair sharing between clients: a victim's time to first token alone, then while another
client (the hog) holds every slot with long streams and keeps a backlog waiting.

    nanopipe bench fairness --model DIR --device cpu        # DIR: scripts/make_tiny_model.py

One pipeline, two client connections. The victim first sends `--victim-requests` short
requests one at a time on an idle engine (TTFT alone); then the hog opens `--hog-streams`
streams of `--hog-tokens` tokens each and the victim sends the same requests again, all at
once (TTFT under the hog): when the hog has more streams than the engine has slots, once it
holds every slot (a backlog waits behind them); otherwise once its first token came (its
prompts' prefill still queued). The hog is aborted after the victim's last answer. TTFT is the
engine's own (RequestMetrics.ttft_s: from the request's arrival at the tokenizer to its
first token). First come first served makes the victim wait for the hog's streams to finish
and then for the whole backlog ahead of it; fair sharing (scheduler_proc.fair_share) admits
it at once.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from frontend.bench.common import random_ids
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure

MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hog-streams", type=int, default=320,
                    help="the hog's streams (default 320: all 256 slots and a backlog)")
    ap.add_argument("--hog-tokens", type=int, default=384, help="tokens per hog stream")
    ap.add_argument("--hog-prompt-len", type=int, default=40,
                    help="tokens of each hog prompt (random ids: no shared prefix)")
    ap.add_argument("--victim-requests", type=int, default=3)
    ap.add_argument("--victim-prompt-len", type=int, default=100,
                    help="tokens of the victim's prompt")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="slots per replica (default: the engine's)")


def _ttft_ms(stream) -> float:
    """The engine's TTFT of a request, once its stream is read to the end."""
    metrics = [d.metrics for d in stream][-1]
    return metrics.ttft_s * 1000


def run(args: argparse.Namespace) -> list[Figure]:
    from frontend import Client
    from frontend.engine.config import EngineConfig
    from frontend.engine.pipeline import Pipeline
    from protocol import SamplingParams

    if args.hog_streams < 1 or args.victim_requests < 1:
        raise BenchUsageError("--hog-streams and --victim-requests must be >= 1")
    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    victim_prompt = random_ids(rng, args.victim_prompt_len, vocab)
    hog_params = SamplingParams(temperature=0, max_tokens=args.hog_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    settings = dict(model=model_dir, device=args.device, data_parallel_size=args.dp,
                    max_model_len=args.hog_tokens + max(args.victim_prompt_len,
                                                        args.hog_prompt_len) + 8,
                    dtype="float32" if args.device == "cpu" else None)
    if args.max_num_seqs is not None:
        settings["max_num_seqs"] = args.max_num_seqs
    config = EngineConfig(**settings)
    print(f"fairness: victim {args.victim_requests} x {args.victim_prompt_len}-token prompt, "
          f"hog {args.hog_streams} streams x {args.hog_prompt_len}-token prompt + "
          f"{args.hog_tokens} tokens, {config.max_num_seqs} "
          f"slots x {args.dp} replica(s), {args.device}; {time.strftime('%Y-%m-%d')}",
          flush=True)
    with Pipeline(config) as pipeline, Client(pipeline.address) as victim, \
            Client(pipeline.address) as hog:
        alone = [_ttft_ms(victim.stream(prompt_token_ids=victim_prompt, params=short))
                 for _ in range(args.victim_requests)]
        print(f"victim alone: TTFT {[round(t) for t in alone]} ms", flush=True)
        start = time.perf_counter()
        streams = [hog.stream(prompt_token_ids=random_ids(rng, args.hog_prompt_len, vocab),
                              params=hog_params) for _ in range(args.hog_streams)]
        slots = config.max_num_seqs * args.dp
        for s in streams[:slots] if len(streams) > slots else streams[:1]:
            next(s)
        print(f"hog running ({time.perf_counter() - start:.1f} s)", flush=True)
        burst = [victim.stream(prompt_token_ids=victim_prompt, params=short)
                 for _ in range(args.victim_requests)]
        hogged = [_ttft_ms(s) for s in burst]
        print(f"victim under the hog: TTFT {[round(t) for t in hogged]} ms", flush=True)
        for s in streams:
            hog.abort(s.request_id)
        hog_done = sum([d.finish_reason for d in s][-1] == "length" for s in streams)
    result = dict(ttft_ms_alone=[round(t, 1) for t in alone],
                  ttft_ms_under_hog=[round(t, 1) for t in hogged],
                  hog_streams_finished_first=hog_done)
    print(json.dumps(result), flush=True)
    return [Figure("victim_ttft_ms[alone]", round(statistics.median(alone), 1), "ms",
                   higher_is_better=False),
            Figure("victim_ttft_ms[hog]", round(statistics.median(hogged), 1), "ms",
                   higher_is_better=False),
            Figure("victim_ttft_ms_max[hog]", round(max(hogged), 1), "ms",
                   higher_is_better=False)]
