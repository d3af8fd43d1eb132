"""The control plane's share of a decode step: the scheduler process between one step's
result and the next step's plan, with a worker that answers every plan at once.

    nanopipe bench steploop [--seqs 1] [--steps 2000] [--repeats 5]
    nanopipe bench steploop --device-us 600 --launch-us 340 --plans-ahead 1
    nanopipe bench steploop --result-spin-us 5000

The real scheduler process (scheduler_proc.scheduler_loop) runs with overlap off, so every
step is one round trip: plan to the worker, result back, the result processed, the next
plan out. This process plays the worker (it answers each plan with one token per
sequence) and the detokenizer (it drains the token deltas). The time per step is what a
step costs beyond the device's own time at small batches: two ZeroMQ hops, the codec on
both sides and the scheduler's work, the floor under batch-1 TPOT. Printed: the median of
--repeats runs of --steps steps, and their spread.

With --device-us and --launch-us the worker is modelled instead: each launch spins the host
for the launch time, each step ends on a simulated device the device time after the later of
its launch and the previous step's end, and with --plans-ahead 1 or 2 (overlap on) the worker
serves plans the way gpu_workers.worker_proc does with lookahead: a plan that arrives before
the step in flight ends is launched first. The time per step then says whether the control
plane keeps such a device busy (it cannot go below the device time). Its results report the
device time as the steps' busy time, so with --plans-ahead auto the scheduler's pacing meter
decides as on a GPU; the line ends with how many steps it planned two ahead.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

from frontend.bench.common import StatsFollower
from frontend.bench.figures import Figure
from protocol import (
    AddRequest,
    Endpoints,
    Ready,
    SamplingParams,
    Shutdown,
    StartupFailed,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from protocol.limits import resolve_plan_depth
from protocol.sockets import MessageSocket
from scheduler_proc import SchedulerConfig
from scheduler_proc.scheduler_loop import run_scheduler

BLOCK_SIZE = 16


class FakeWorker:
    """Rank 0 of a worker that samples token 7 for every sequence of a plan, either at once or
    on a simulated device (device_s per step, launch_s of host work per launch)."""

    def __init__(self, ctx: zmq.Context, ep: Endpoints, device_s: float = 0.0,
                 launch_s: float = 0.0, lookahead: bool = False) -> None:
        self.steps = MessageSocket(ctx, zmq.PULL, ep.worker_steps[0], bind=True,
                                   accepts=(StepPlan, Shutdown))
        self.results = MessageSocket(ctx, zmq.PUSH, ep.step_results, bind=False)
        self.detok = MessageSocket(ctx, zmq.PULL, ep.detok_in, bind=True,
                                   accepts=(TokenDeltas,))
        self.device_s, self.launch_s, self.lookahead = device_s, launch_s, lookahead
        self.device_free = 0.0  # when the simulated device finishes its queued steps
        self.in_flight: tuple[StepPlan, float] | None = None  # a plan and when it ends

    def serve(self, steps: int) -> float:
        """Send `steps` results; the seconds they took."""
        start = time.perf_counter()
        sent = 0
        while sent < steps:
            if self.in_flight is not None and not self._plan_before(self.in_flight[1]):
                sent += self._finish(self.in_flight)
                self.in_flight = None
                continue
            launched = self._launch(self.steps.recv())
            if self.in_flight is not None:
                sent += self._finish(self.in_flight)
            self.in_flight = launched
            if not self.lookahead:
                sent += self._finish(launched)
                self.in_flight = None
        return time.perf_counter() - start

    def _plan_before(self, deadline: float) -> bool:
        """Whether the next plan arrives before `deadline` (polled without sleeping)."""
        while time.perf_counter() < deadline:
            if self.steps.poll(0):
                return True
        return self.steps.poll(0)

    def _launch(self, plan: StepPlan) -> tuple[StepPlan, float]:
        now = _spin(self.launch_s)
        self.device_free = max(now, self.device_free) + self.device_s
        return plan, self.device_free

    def _finish(self, launched: tuple[StepPlan, float]) -> int:
        plan, ends = launched
        _spin(ends - time.perf_counter())
        ids = [s.seq_id for s in plan.new_seqs] + list(plan.cached.seq_ids)
        self.results.send(StepResult(plan.step_id, ids, [7] * len(ids), None,
                                     gpu_busy_s=self.device_s))
        while self.detok.poll(0):
            self.detok.recv()
        return 1


def _spin(seconds: float) -> float:
    """Busy the host for `seconds` (a launch's host work, or waiting on the device)."""
    end = time.perf_counter() + seconds
    now = time.perf_counter()
    while now < end:
        now = time.perf_counter()
    return now


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device-us", type=float, default=0.0,
                    help="simulated device time per step (0: the worker answers at once)")
    ap.add_argument("--launch-us", type=float, default=0.0,
                    help="host time the simulated worker spends launching a step")
    ap.add_argument("--plans-ahead", default="0", choices=("0", "1", "2", "auto"),
                    help="0: overlap off; 1, 2 or auto (two where the pacing meter says the "
                    "host paces, as on a GPU): overlap on, the worker with lookahead")
    ap.add_argument("--result-spin-us", type=float, default=0.0,
                    help="the scheduler's spin while a result is due (an engine on a GPU "
                    "spins 5000 µs; it needs a core of its own)")


def run(args: argparse.Namespace) -> list[Figure]:
    total = args.repeats * args.steps + 16
    ahead = 2 if args.plans_ahead == "auto" else int(args.plans_ahead)
    depth = resolve_plan_depth(None if args.plans_ahead == "auto" else max(ahead, 1),
                               overlap=ahead > 0, lookahead=True, speculative=False, gpu=True)
    config = SchedulerConfig(args.seqs * (-(-(total + 64) // BLOCK_SIZE) + 1), BLOCK_SIZE,
                             max_num_seqs=max(args.seqs, 1), max_model_len=total + 64,
                             overlap=depth.overlap, plans_ahead=depth.plans_ahead,
                             deep_plan_max_seqs=depth.deep_plan_max_seqs,
                             result_spin_s=args.result_spin_us * 1e-6)
    ep = Endpoints.ipc(1)
    ctx = zmq.Context()
    control = MessageSocket(ctx, zmq.PULL, ep.control, bind=True, accepts=(Ready, StartupFailed))
    worker = FakeWorker(ctx, ep, args.device_us * 1e-6, args.launch_us * 1e-6,
                        depth.worker_lookahead)
    scheduler = mp.get_context("spawn").Process(target=run_scheduler, args=(config, ep, 1),
                                                daemon=True)
    scheduler.start()
    front = stats = None
    figures = []
    try:
        if not control.poll(30_000) or not isinstance(control.recv(), Ready):
            raise SystemExit("the scheduler did not start")
        front = MessageSocket(ctx, zmq.PUSH, ep.scheduler_in, bind=False)
        stats = StatsFollower(ep.deltas_pub, ep.keys)
        params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for rid in range(args.seqs):
            front.send(AddRequest(rid, [(rid + i) % 1000 for i in range(8)], params, []))
        worker.serve(16)  # the prefill and a few decode steps
        per_step = [worker.serve(args.steps) / args.steps for _ in range(args.repeats)]
        med = statistics.median(per_step)
        mode = f"{args.plans_ahead} plan(s) ahead, worker lookahead" if ahead else "overlap off"
        if args.device_us or args.launch_us:
            mode += f", device {args.device_us:g} µs and launch {args.launch_us:g} µs a step"
        if args.result_spin_us:
            mode += f", the scheduler spinning {args.result_spin_us:g} µs"
        print(f"{args.seqs} decoding sequence(s), {mode}: {med * 1e6:.1f} µs per step "
              f"(median of {args.repeats} runs of {args.steps} steps; "
              f"{min(per_step) * 1e6:.1f}-{max(per_step) * 1e6:.1f}); "
              f"{stats.after(time.monotonic()).steps_two_ahead} steps planned two ahead",
              flush=True)
        figures.append(Figure(f"us_per_step@{args.seqs}", round(med * 1e6, 2), "us",
                              bound=args.device_us or None, higher_is_better=False))
    finally:
        scheduler.terminate()
        scheduler.join(5)
        if stats is not None:
            stats.close()
        for sock in (control, worker.steps, worker.results, worker.detok, front):
            if sock is not None:
                sock.close()
        ctx.term()
        ep.cleanup()
    return figures
