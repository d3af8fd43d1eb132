"""Where n-gram speculation's time goes at batch 1 on the CPU, in this process (Scheduler +
ModelRunner, no pipeline): the real embedded SmolLM2, float32, greedy, the copy-heavy tasks of
bench_spec.py, one request after another.

    python scripts/profile_spec.py                          # off and K=4,8 x n=3,2
    python scripts/profile_spec.py --k 4,6,8 --ngram 3,2 --min-n 1 --cprofile 15

1. Greedy outputs without speculation, and the median time of a decode step.
2. Per engine setting (--engines, K:n), the real runs interleaved over --rounds: decode time
   per token and the ratio to no speculation, the median step time by tokens verified, and
   (--cprofile) the costliest Python functions of one run.
3. Offline, per proposer setting (K, n, fallback down to --min-n): the steps and acceptance
   that setting gives on exactly those outputs (greedy outputs do not depend on speculation,
   so this needs no model), and the speedup they predict with the measured cost of a
   verifying step relative to a decode step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict

import numpy as np
from benchlib.chat_prompts import chat_prompts
from benchlib.copy_tasks import COPY_TASKS

from gpu_workers import ModelRunner, WorkerConfig
from gpu_workers.speculative import propose_ngram_batch
from protocol import AddRequest, SamplingParams
from scheduler_proc import Scheduler, SchedulerConfig


def make_engine(model_dir: str, k: int, n: int, max_len: int):
    spec = {"speculative": "ngram", "num_speculative_tokens": k, "ngram_size": n} if k else {}
    config = WorkerConfig(model=model_dir, device="cpu", dtype="float32", max_model_len=max_len,
                          max_num_seqs=4, max_num_batched_tokens=2048, **spec)
    runner = ModelRunner(config)
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=config.block_size, max_num_seqs=4,
        max_num_batched_tokens=2048, max_model_len=max_len, overlap=not k,
        num_speculative_tokens=k))
    return scheduler, runner


def generate(engine, prompts: list[list[int]], new_tokens: int, first_id: int):
    """Outputs, decode seconds (after each request's first token), and per step (tokens
    verified per entry, seconds)."""
    scheduler, runner = engine
    eos = list(runner.model_config.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    outputs, decode_s, steps = [], 0.0, []
    for i, prompt in enumerate(prompts):
        scheduler.add_request(AddRequest(first_id + i, prompt, params, eos))
        tokens: list[int] = []
        while scheduler.has_unfinished():
            start = time.perf_counter()
            plan = scheduler.schedule()
            result = runner.execute(plan)
            deltas = scheduler.process_result(result)
            took = time.perf_counter() - start
            if tokens:  # the prefill step is the same in every mode
                decode_s += took
                verified = 1 + (result.num_proposed[0] if result.num_proposed else 0)
                steps.append((verified, took))
            for t in deltas.token_ids:
                tokens.extend(t)
        outputs.append(tokens)
    return outputs, decode_s, steps


def simulate(prompt: list[int], output: list[int], k: int, n: int, min_n: int
             ) -> tuple[int, int, int, int]:
    """(steps, steps that verify proposals, proposed, accepted) to produce `output` after its
    first token."""
    seq = np.array(prompt + output, np.int32)[None, :]
    pos, end = len(prompt) + 1, len(prompt) + len(output)
    steps = verifying = proposed = accepted = 0
    while pos < end:
        cap = min(k, end - pos)  # the scheduler caps K by max_tokens (here: the output's end)
        guess, count = propose_ngram_batch(seq, np.array([0]), np.array([pos]), np.array([cap]),
                                           n, min_n=min_n)
        guess = guess[0, :count[0]]
        same = guess == seq[0, pos:pos + len(guess)]
        a = len(guess) if same.all() else int(np.argmin(same))
        steps, proposed, accepted = steps + 1, proposed + len(guess), accepted + a
        verifying += len(guess) > 0
        pos += a + 1
    return steps, verifying, proposed, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", default="4,8")
    ap.add_argument("--ngram", default="3,2")
    ap.add_argument("--min-n", type=int, default=None, help="also simulate fallback to this n")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default="", help="engine settings to run, K:n comma-separated "
                    "(default: every --k x --ngram)")
    ap.add_argument("--cprofile", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = args.model
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), COPY_TASKS[:args.prompts])
    max_len = max(map(len, prompts)) + args.new_tokens + 16
    ks = [int(v) for v in args.k.split(",")]
    ns = [int(v) for v in args.ngram.split(",")]
    engines = {"off": (0, 0)}
    pairs = ([tuple(map(int, e.split(":"))) for e in args.engines.split(",")] if args.engines
             else [(k, n) for k in ks for n in ns])
    engines.update({f"K={k} n={n}": (k, n) for k, n in pairs})
    built = {name: make_engine(model_dir, k, n, max_len) for name, (k, n) in engines.items()}

    outputs, off_s, off_steps = generate(built["off"], prompts, args.new_tokens, 0)
    produced = sum(len(o) - 1 for o in outputs)
    step_ms = statistics.median(t for _, t in off_steps) * 1e3
    print(f"{len(prompts)} prompts, {produced} decoded tokens; decode step without "
          f"speculation: median {step_ms:.1f} ms")
    per_token: dict[str, list[float]] = defaultdict(list)
    by_width: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    first_id = 100
    for _ in range(args.rounds):
        for name, engine in built.items():
            out, secs, steps = generate(engine, prompts, args.new_tokens, first_id)
            first_id += len(prompts)
            assert out == outputs, f"{name}: greedy tokens differ"
            per_token[name].append(secs / produced)
            for width, took in steps:
                by_width[name][width].append(took)
    off = statistics.median(per_token["off"])
    print(f"in-process decode, median of {args.rounds} interleaved rounds:")
    for name in built:
        t = statistics.median(per_token[name])
        widths = ", ".join(f"{w}: {statistics.median(v) * 1e3:.1f} ms ({len(v)})"
                           for w, v in sorted(by_width[name].items()))
        print(f"  {name:>9}: {t * 1e3:6.1f} ms/token ({off / t:.2f}x); step by tokens "
              f"verified per entry: {widths}")
    # A step that verifies proposals costs `ratio` decode steps (small-M GEMMs on the CPU).
    off_step = statistics.median(t for name in built for w, ts in by_width[name].items()
                                 if w == 1 for t in ts)
    wide = [t for name in built for w, ts in by_width[name].items() if w > 1 for t in ts]
    ratio = statistics.median(wide) / off_step if wide else 1.0
    print(f"offline (exact on these outputs): steps, tokens per step, acceptance, and the "
          f"speedup predicted if a verifying step costs {ratio:.2f} decode steps (measured)")
    for k in ks:
        for n in ns:
            for min_n in sorted({n, args.min_n or n}, reverse=True):
                sims = [simulate(p, o, k, n, min_n) for p, o in zip(prompts, outputs)]
                steps, verifying, proposed, accepted = (sum(s[i] for s in sims)
                                                        for i in range(4))
                cost = steps - verifying + verifying * ratio
                print(f"  K={k} n={n}{f' down to {min_n}' if min_n < n else ''}: {steps} "
                      f"steps ({verifying} verify), {produced / steps:.2f} tokens/step, "
                      f"{accepted} of {proposed} accepted ({accepted / max(proposed, 1):.1%}), "
                      f"predicted {produced / cost:.2f}x")
    if args.cprofile:
        for name in list(built)[-1:]:
            prof = cProfile.Profile()
            prof.enable()
            generate(built[name], prompts, args.new_tokens, first_id)
            prof.disable()
            print(f"cProfile of {name}:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
