"""The control plane's share of a decode step: the scheduler process between one step's
result and the next step's plan, with a worker that answers every plan at once.

    python scripts/bench_step_loop.py [--seqs 1] [--steps 2000] [--repeats 5]

The real scheduler process (scheduler_proc.scheduler_loop) runs with overlap off, so every
step is one round trip: plan to the worker, result back, the result processed, the next
plan out. This process plays the worker (it answers each plan with one token per
sequence) and the detokenizer (it drains the token deltas). The time per step is what a
step costs beyond the device's own time at small batches: two ZeroMQ hops, the codec on
both sides and the scheduler's work, the floor under batch-1 TPOT. Printed: the median of
--repeats runs of --steps steps, and their spread.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

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
from protocol.sockets import MessageSocket
from scheduler_proc import SchedulerConfig
from scheduler_proc.scheduler_loop import run_scheduler

BLOCK_SIZE = 16


class FakeWorker:
    """Rank 0 of a worker that samples token 7 for every sequence of a plan at once."""

    def __init__(self, ctx: zmq.Context, ep: Endpoints) -> None:
        self.steps = MessageSocket(ctx, zmq.PULL, ep.worker_steps[0], bind=True,
                                   accepts=(StepPlan, Shutdown))
        self.results = MessageSocket(ctx, zmq.PUSH, ep.step_results, bind=False)
        self.detok = MessageSocket(ctx, zmq.PULL, ep.detok_in, bind=True,
                                   accepts=(TokenDeltas,))

    def serve(self, steps: int) -> float:
        """Answer `steps` plans; the seconds they took."""
        start = time.perf_counter()
        for _ in range(steps):
            plan = self.steps.recv()
            ids = [s.seq_id for s in plan.new_seqs] + list(plan.cached.seq_ids)
            self.results.send(StepResult(plan.step_id, ids, [7] * len(ids), None))
            while self.detok.poll(0):
                self.detok.recv()
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    total = args.repeats * args.steps + 16
    config = SchedulerConfig(args.seqs * (-(-(total + 64) // BLOCK_SIZE) + 1), BLOCK_SIZE,
                             max_num_seqs=max(args.seqs, 1), max_model_len=total + 64,
                             overlap=False)
    ep = Endpoints.ipc(1)
    ctx = zmq.Context()
    control = MessageSocket(ctx, zmq.PULL, ep.control, bind=True, accepts=(Ready, StartupFailed))
    worker = FakeWorker(ctx, ep)
    scheduler = mp.get_context("spawn").Process(target=run_scheduler, args=(config, ep, 1),
                                                daemon=True)
    scheduler.start()
    front = None
    try:
        if not control.poll(30_000) or not isinstance(control.recv(), Ready):
            raise SystemExit("the scheduler did not start")
        front = MessageSocket(ctx, zmq.PUSH, ep.scheduler_in, bind=False)
        params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for rid in range(args.seqs):
            front.send(AddRequest(rid, [(rid + i) % 1000 for i in range(8)], params, []))
        worker.serve(16)  # the prefill and a few decode steps
        per_step = [worker.serve(args.steps) / args.steps for _ in range(args.repeats)]
        med = statistics.median(per_step)
        print(f"{args.seqs} decoding sequence(s), overlap off: {med * 1e6:.1f} µs per step "
              f"(median of {args.repeats} runs of {args.steps} steps; "
              f"{min(per_step) * 1e6:.1f}-{max(per_step) * 1e6:.1f})", flush=True)
    finally:
        scheduler.terminate()
        scheduler.join(5)
        for sock in (control, worker.steps, worker.results, worker.detok, front):
            if sock is not None:
                sock.close()
        ctx.term()
        ep.cleanup()


if __name__ == "__main__":
    main()
