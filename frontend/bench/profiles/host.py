"""What the host does per decode step, stage by stage, against the device time of the step:
the runtime (Scheduler + ModelRunner) in this process on a W1-like batch, each plan and
result passed through the wire codec as the pipeline passes them.

    nanopipe profile host --make-random qwen3-0.6b --num-seqs 1 --at 60   # batch 1
    nanopipe profile host --make-random smollm2-135m --at 300             # W1 load
    nanopipe profile host --model DIR --device cpu --num-seqs 4 \\
        --max-input-len 100 --max-output-len 100 --at 4 --steps 8              # CPU smoke run

Steps run one at a time (no overlap), so when a step is launched the device is idle and the
launch's wall time is host work alone. Printed per step, in ms: the scheduler's planning,
the plan's encoding and decoding, the runner's launch (mirror update, batch building, the
graph or kernel launches, sampling launches, the token copy), its finish (which also waits
for the device), the result's encoding and decoding and the scheduler's processing; then
the device time the runner's own timer measured (StepResult.gpu_busy_s) and the wall time.
With lookahead a worker's launch and finish, plus a plan's round trip through the scheduler,
must fit in the device time of one step, or the device waits on the host.

--at N        steps run before the measured ones (default 300: ~190 sequences on W1)
--steps N     measured steps (default 60)
--cprofile N  then the same steps again under cProfile: the N costliest functions
--host-ops N  then the same steps again under torch.profiler (host activity only): the N
              ops and CUDA runtime calls (graph launches, copies, event records, pinned
              allocations) with the most host time of their own, per step
--functions   then the same steps again with a wall-clock timer around each function of the
              launch and finish (FUNCTIONS): µs per step and calls per step, cumulative. The
              timers only add (~1 µs a call), unlike cProfile's, which inflate every call.
--json FILE   the figures as JSON
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from frontend.bench.common import default_device
from frontend.bench.common.model_source import add_w1_shape, resolve_model_dir
from frontend.bench.common.w1_runtime import add_runtime_options, w1_runtime
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from protocol import Decoder, StepPlan, StepResult, encode

FUNCTIONS = {
    "gpu_workers.model_runner": ["ModelRunner.launch", "ModelRunner.finish", "build_batch",
                                 "graph_sample_inputs", "pending_patch", "patch_in_flight"],
    "gpu_workers.batch": ["lay_out"],
    "gpu_workers.sequence_table": ["SequenceTable.apply", "SequenceTable.append_placeholders",
                           "SequenceTable.fill_tokens"],
    "gpu_workers.static_inputs": ["StaticInputs.stage", "Staged.send"],
    "gpu_workers.decode_graphs": ["DecodeGraphs.run", "DecodeGraphs.sample_step"],
    "gpu_workers.step_timer": ["BusyTimes.start", "BusyTimes.stop", "BusyTimes.take"],
    "gpu_workers.pending_step": ["PendingStep.copy_to_host", "PendingStep.wait"],
}
"""--functions: where each is looked up (a name imported into a module is timed there)."""

STAGES = ("schedule", "encode_plan", "decode_plan", "launch", "finish", "encode_result",
          "decode_result", "process")


class HostSteps:
    """Steps the runtime, timing each stage on the host."""

    def __init__(self, scheduler, runner, device: str) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.cuda = device == "cuda"
        self.plans, self.results = Decoder(StepPlan), Decoder(StepResult)
        self.ms = dict.fromkeys(STAGES, 0.0)
        self.device_s = 0.0

    def step(self, timed: bool = True) -> None:
        clock = [time.perf_counter()]

        def lap() -> None:
            clock.append(time.perf_counter())

        plan = self.scheduler.schedule()
        if plan is None:
            raise SystemExit("W1 finished before the last measured step: lower --at or --steps")
        lap()
        frame = encode(plan)
        lap()
        plan = self.plans.decode(frame)
        lap()
        with torch.inference_mode():
            pending = self.runner.launch(plan)
            lap()
            result = self.runner.finish(pending)
            lap()
        frame = encode(result)
        lap()
        result = self.results.decode(frame)
        lap()
        deltas = self.scheduler.process_result(result)
        lap()
        if any(deltas.errors):
            raise RuntimeError(f"request failed: {[e for e in deltas.errors if e]}")
        if timed:
            for name, a, b in zip(STAGES, clock[:-1], clock[1:], strict=True):
                self.ms[name] += (b - a) * 1e3
            self.device_s += result.gpu_busy_s or 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


MODEL = "required"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_w1_shape(ap)
    add_runtime_options(ap)
    ap.add_argument("--at", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--host-ops", type=int, default=0)
    ap.add_argument("--functions", action="store_true")
    ap.add_argument("--json")


def run(args: argparse.Namespace) -> list[Figure]:
    if args.at < 0 or args.steps < 1:
        raise BenchUsageError("--at must be >= 0 and --steps >= 1")
    device = args.device or default_device()
    model_dir = resolve_model_dir(args, device)
    scheduler, runner = w1_runtime(args, model_dir, device)
    steps = HostSteps(scheduler, runner, device)
    for _ in range(args.at):
        steps.step(timed=False)
    running = len(scheduler.state.running)
    steps.sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        steps.step()
    steps.sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    per_step = {k: round(v / args.steps, 4) for k, v in steps.ms.items()}
    device_ms = steps.device_s * 1e3 / args.steps
    print(f"{Path(model_dir).name} on {device}: {running} sequences running at step {args.at}; "
          f"cuda_graphs={runner.graphs is not None}")
    print("host ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in per_step.items()))
    print(f"device {device_ms:.3f} ms per step (the runner's timer), wall {wall_ms:.3f} ms; "
          f"launch / device {per_step['launch'] / max(device_ms, 1e-9):.2f}", flush=True)
    result = dict(result="profile_host", device=device, model=Path(model_dir).name,
                  running=running, at=args.at, steps=args.steps, host_ms=per_step,
                  device_ms=round(device_ms, 4), wall_ms=round(wall_ms, 4))
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            steps.step(timed=False)
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.cprofile)
        stats.sort_stats("cumulative").print_stats(args.cprofile)
    if args.host_ops:
        print_host_ops(steps, args.steps, args.host_ops)
    if args.functions:
        print_functions(steps, args.steps)
    return [Figure("wall_ms_per_step", round(wall_ms, 4), "ms", bound=round(device_ms, 4),
                   higher_is_better=False),
            *(Figure(f"host_ms[{k}]", v, "ms", higher_is_better=False)
              for k, v in per_step.items())]


def print_functions(steps: HostSteps, num_steps: int) -> None:
    """Wall time per step inside each of FUNCTIONS (cumulative), timed by wrappers."""
    import importlib

    spent = dict.fromkeys((n for names in FUNCTIONS.values() for n in names), 0.0)
    calls = dict.fromkeys(spent, 0)
    for module_name, names in FUNCTIONS.items():
        module = importlib.import_module(module_name)
        for name in names:
            *owner_path, attr = name.split(".")
            owner = getattr(module, owner_path[0]) if owner_path else module
            setattr(owner, attr, _timed(getattr(owner, attr), name, spent, calls))
    for _ in range(num_steps):
        steps.step(timed=False)
    print(f"host µs per step inside each function (cumulative), over {num_steps} steps:")
    for name in sorted(spent, key=spent.get, reverse=True):
        print(f"  {spent[name] * 1e6 / num_steps:9.1f}  {calls[name] / num_steps:5.1f} calls  "
              f"{name}")


def _timed(fn, name: str, spent: dict[str, float], calls: dict[str, int]):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
    return timed


def print_host_ops(steps: HostSteps, num_steps: int, top: int) -> None:
    """Host time of each torch op and CUDA runtime call over num_steps steps, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            steps.step(timed=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"host time per step by op (self, µs), over {num_steps} steps:")
    for e in events[:top]:
        print(f"  {e.self_cpu_time_total / num_steps:9.1f}  {e.count / num_steps:6.1f} calls"
              f"  {e.key}")

