"""Speculative decoding on the CPU: the real SmolLM2-135M-Instruct (the embedded default
model), float32 greedy, the whole pipeline, without speculation, with `--speculative ngram` and
(with --draft-layers N) with `--speculative draft` whose draft is the model's own first N
layers (scripts/truncate_model.py), in the same run, on a copy-heavy workload (repeat a
paragraph, edit a piece of code).

    python scripts/bench_spec.py                          # batch 1 and 8, K=4, n=3
    python scripts/bench_spec.py --batch-sizes 1 --k 6 --ngram 2 --new-tokens 96
    python scripts/bench_spec.py --draft-layers 4 --new-tokens 48 --batch1-prompts 2

Batch 1 sends the prompts one after another, batch B sends B at once (streaming clients).
Prints per mode and batch size: TPOT (mean over requests of (last - first token) / (tokens -
1)), output tok/s (tokens / wall time), the engine's acceptance rate (accepted / proposed, from
its published EngineStats), and asserts that the greedy tokens are identical in both modes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import os
import platform
import tempfile
import time

import zmq
from benchlib import truncate_model

from frontend import LLM, Client, SamplingParams
from protocol import Decoder
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats

PARAGRAPH = ("The river rose slowly through the night, and by morning the low fields along "
             "the valley were under water. Farmers moved their animals to the hills, and the "
             "old stone bridge, which had stood for three hundred years, held firm again.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
        "        total += item.price * item.quantity\n    return total * (1 + tax_rate)\n")
TASKS = [
    f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rename the function total_price to compute_total in this code and show the whole "
    f"code:\n\n{CODE}",
    f"Copy this text and then copy it once more:\n\n{PARAGRAPH}",
    f"Add a docstring to this function and return the full code:\n\n{CODE}",
    f"Rewrite this paragraph with every sentence on its own line:\n\n{PARAGRAPH}",
    f"Change the loop variable item to entry in this code and show the result:\n\n{CODE}",
    f"Repeat the following text twice:\n\n{PARAGRAPH}",
    f"Rename tax_rate to vat in this code and print the whole function:\n\n{CODE}",
]


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


def run(client: Client, prompts: list[str], batch: int, params: SamplingParams):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="also run --speculative draft with the model's first N layers (0: no)")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = {"off": {}, "ngram": {"speculative": "ngram", "num_speculative_tokens": args.k,
                                  "ngram_size": args.ngram}}
    tmp = tempfile.TemporaryDirectory(prefix="bench_spec_draft_")
    if args.draft_layers:
        from frontend.embedded_model import default_model_dir

        draft = truncate_model(args.model or default_model_dir(), tmp.name, args.draft_layers)
        modes["draft"] = {"speculative": "draft", "num_speculative_tokens": args.k,
                          "draft_model": str(draft)}
    results: dict = {}
    for mode, extra in modes.items():
        with LLM(args.model, device="cpu", dtype="float32", **extra) as llm:
            with Client(llm.pipeline.address) as client:
                run(client, ["Say hello."], 1, SamplingParams(temperature=0, max_tokens=8))
                for b in sizes:
                    prompts = TASKS[:args.batch1_prompts] if b == 1 else (TASKS * b)[:b]
                    results[mode, b] = run(client, prompts, b, params)
            stats = latest_stats(llm.pipeline.endpoints.deltas_pub)
            if mode != "off" and stats is not None and stats.spec_proposed_tokens:
                rate = stats.spec_accepted_tokens / stats.spec_proposed_tokens
                print(f"{mode} acceptance: {stats.spec_accepted_tokens} of "
                      f"{stats.spec_proposed_tokens} proposed tokens ({rate:.1%})")
    tmp.cleanup()
    draft = f", draft = first {args.draft_layers} layers" if args.draft_layers else ""
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{dt.date.today()}; K={args.k}, n={args.ngram}{draft}, {args.new_tokens} new "
          f"tokens max")
    for mode in [m for m in modes if m != "off"]:
        for b in sizes:
            (t0, tpot0, tps0), (t1, tpot1, tps1) = results["off", b], results[mode, b]
            assert t0 == t1, f"{mode}, batch {b}: greedy tokens differ with speculation"
            print(f"{mode}, batch {b}: TPOT {tpot0 * 1e3:.1f} -> {tpot1 * 1e3:.1f} ms, output "
                  f"{tps0:.1f} -> {tps1:.1f} tok/s ({tps1 / tps0:.2f}x), identical tokens "
                  f"({sum(map(len, t0))} tokens)")


if __name__ == "__main__":
    main()
