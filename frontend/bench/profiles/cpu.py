"""W5 per decode step, in this process: nanopipe's runtime (Scheduler + ModelRunner) against
transformers' model forward on the same prompts, batch 1 and 16, float32 on the CPU.

    nanopipe profile cpu                     # embedded SmolLM2, batches 1 and 16
    nanopipe profile cpu --ops 12 --cprofile # with the costliest aten ops / Python
    nanopipe profile cpu --no-matmul         # what a step costs besides its matmuls

Both sides first prefill the W5 chat prompts (transformers left-padded at batch > 1, as
`generate` does), then run --steps greedy decode steps; the figure is the median wall time
of a step (the CPU may be shared, so the median of many steps is steadier than a total).
nanopipe's step is everything the worker does per step (batch building, model, logits,
sampler, mirror) plus the scheduler's planning; transformers' is one forward with its
KV cache plus the argmax, what `generate` does per token. With --ops the aten ops' self
times of a profiled window are printed per step, and --cprofile the Python functions.
With --no-matmul every linear layer of the decode steps (the LM head's too) returns a
preallocated output instead of computing it, on both sides: the step times then show what
each engine spends besides the matmuls (the tokens are then meaningless and not compared).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from frontend.bench.common import process
from frontend.bench.common.chat_prompts import QUESTIONS, chat_prompts
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.figures import Figure
from gpu_workers import ModelRunner, WorkerConfig
from protocol import AddRequest, SamplingParams
from scheduler_proc import Scheduler, SchedulerConfig


def nanopipe_engine(model_dir: str, prompts: list[list[int]], steps: int, args) -> tuple:
    """After the prefill: (one decode step, the tokens so far per sequence)."""
    extra = profiled_steps(args)
    max_len = max(map(len, prompts)) + steps + extra + 8
    config = WorkerConfig(model=model_dir, device="cpu", dtype="float32", max_model_len=max_len,
                          max_num_seqs=16, max_num_batched_tokens=max(2048, max_len))
    runner = ModelRunner(config)
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=config.block_size,
        max_num_seqs=16, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len, overlap=False))
    eos = list(runner.model_config.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=steps + extra + 4, ignore_eos=True)
    for k, p in enumerate(prompts):
        scheduler.add_request(AddRequest(k, p, params, eos))

    tokens: list[list[int]] = [[] for _ in prompts]

    def step() -> None:
        deltas = process(scheduler, runner.execute(scheduler.schedule()))
        for sid, toks in zip(deltas.request_ids, deltas.token_ids, strict=True):
            tokens[sid].extend(toks)

    step()  # prefill
    return step, tokens


def profiled_steps(args) -> int:
    """The steps the --ops and --cprofile windows run after the timed ones."""
    return args.window * (bool(args.ops) + bool(args.cprofile))


def hf_engine(model, prompts: list[list[int]], pad_id: int, steps: int, args) -> tuple:
    """The same for transformers: forward with its cache (what `generate` runs per token)."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    state = {}
    tokens: list[list[int]] = [[] for _ in prompts]

    @torch.inference_mode()
    def forward(input_ids, attention_mask, cache):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            tokens[i].append(t)
        return nxt

    state["cache"] = DynamicCache()
    state["mask"] = mask
    state["next"] = forward(ids, mask, state["cache"])

    def step() -> None:
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(len(prompts), 1)], 1)
        state["next"] = forward(state["next"][:, None], state["mask"], state["cache"])

    return step, tokens


class MatmulStub:
    """Linear layers that return a preallocated output of the right shape once switched on
    (after the prefill), for --no-matmul."""

    def __init__(self) -> None:
        self.on = False
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.skipped = {"nanopipe": 0, "transformers": 0}
        """Matmuls not computed, per engine (printed, so a run shows the stub was in force)."""

    def output(self, x: torch.Tensor, out_features: int) -> torch.Tensor:
        key = (*x.shape[:-1], out_features)
        if key not in self.outputs:
            self.outputs[key] = torch.full(key, 0.01)
        return self.outputs[key]

    def install(self) -> None:
        import gpu_workers.layers.embedding as embedding
        import gpu_workers.layers.linear as linear

        real_cpu_linear, real_forward = linear.cpu_linear, torch.nn.Linear.forward

        def cpu_linear(x, weight, onednn_weight, bias=None):
            if not self.on:
                return real_cpu_linear(x, weight, onednn_weight, bias)
            w = weight if weight is not None else onednn_weight
            self.skipped["nanopipe"] += 1
            return self.output(x, w.shape[0])

        def forward(module, x):
            if not self.on:
                return real_forward(module, x)
            self.skipped["transformers"] += 1
            return self.output(x, module.out_features)

        linear.cpu_linear = embedding.cpu_linear = cpu_linear
        torch.nn.Linear.forward = forward


def profile_ops(step, window: int, top: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(window):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / window / 1e3
    calls = sum(e.count for e in rows) / window
    print(f"    aten self time {total:.2f} ms/step, {calls:.0f} op calls/step; costliest:")
    for e in rows[:top]:
        print(f"    {e.self_cpu_time_total / window / 1e3:7.3f} ms  {e.count / window:5.1f}x  "
              f"{e.key}")


def profile_python(step, window: int, top: int, sort: str = "tottime") -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(window):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(top)


def interleaved(steps: dict, n: int) -> dict[str, tuple[float, float]]:
    """Per engine, the median ms per step of wall time and of this process's CPU time, their
    steps alternating (shared noise hits both). On a shared machine the CPU time at one
    thread is the steadier figure: time spent preempted is not counted."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
    return {name: (statistics.median(w for w, _ in t) * 1e3,
                   statistics.median(c for _, c in t) * 1e3) for name, t in times.items()}


MODEL = "optional"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--window", type=int, default=8, help="profiled steps")
    ap.add_argument("--ops", type=int, default=0, help="print this many costliest aten ops")
    ap.add_argument("--cprofile", type=int, default=0, help="print this many Python functions")
    ap.add_argument("--sort", default="tottime", help="cProfile order (tottime, cumulative)")
    ap.add_argument("--only", choices=("nanopipe", "transformers"), default=None)
    ap.add_argument("--no-matmul", action="store_true",
                    help="decode steps without their matmuls (see above)")


def run(args: argparse.Namespace) -> list[Figure]:
    stub = MatmulStub()
    if args.no_matmul:
        stub.install()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(args, "cpu")
    if model_dir is None:
        from frontend.embedded_model import default_model_dir

        model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, QUESTIONS)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model = None
    if args.only != "nanopipe":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    figures: list[Figure] = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batch = prompts[:bs]
        engines = {}
        if args.only != "transformers":
            engines["nanopipe"] = nanopipe_engine(model_dir, batch, args.steps, args)
        if args.only != "nanopipe":
            engines["transformers"] = hf_engine(model, batch, pad_id, args.steps, args)
        stub.on = args.no_matmul  # the prefills above ran with their matmuls
        ms = interleaved({name: step for name, (step, _) in engines.items()}, args.steps)
        line = "  ".join(f"{name} {w:7.2f} ms (cpu {c:7.2f})" for name, (w, c) in ms.items())
        ratio = ""
        if len(ms) == 2:
            (nw, nc), (hw, hc) = ms["nanopipe"], ms["transformers"]
            ratio = f"  transformers/nanopipe wall {hw / nw:.2f}x cpu {hc / nc:.2f}x"
        print(f"batch {bs:>2}: per decode step (median of {args.steps}, interleaved)  "
              f"{line}{ratio}", flush=True)
        mine, theirs = ms.get("nanopipe"), ms.get("transformers")
        if mine is not None:  # a step's CPU time, the steadier figure on a shared machine
            figures.append(Figure(f"step_cpu_ms@{bs}" + ("[no matmul]" if args.no_matmul else ""),
                                  round(mine[1], 3), "ms", higher_is_better=False,
                                  peer=None if theirs is None else round(theirs[1], 3),
                                  peer_name="transformers"))
        for name, (step, _) in engines.items():
            if args.ops:
                print(f"  {name}:")
                profile_ops(step, args.window, args.ops)
            if args.cprofile:
                print(f"  {name}:")
                profile_python(step, args.window, args.cprofile, args.sort)
        stub.on = False
        if args.no_matmul:
            print(f"batch {bs:>2}: matmuls skipped: " + ", ".join(
                f"{name} {stub.skipped[name]}" for name in engines), flush=True)
            stub.skipped = dict.fromkeys(stub.skipped, 0)
        if len(engines) == 2 and not args.no_matmul:
            n = min(len(t) for t in engines["transformers"][1])
            outs = {name: [t[:n] for t in tokens] for name, (_, tokens) in engines.items()}
            same = sum(a == b for a, b in zip(outs["nanopipe"], outs["transformers"]))
            print(f"batch {bs:>2}: same greedy tokens over {n}: {same}/{bs} sequences", flush=True)
    return figures
