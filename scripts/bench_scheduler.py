"""Scheduler CPU time per step with many running decode sequences (goal: <= 0.5 ms/step).

Times the CPU time of schedule() + process_result() only; the "worker" answers with a fixed
token.
"""

from __future__ import annotations

import argparse
import time

from protocol import AddRequest, SamplingParams, StepResult, encode
from scheduler_proc import Scheduler, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    max_len = args.prompt + args.steps + 64
    blocks = args.seqs * (-(-max_len // args.block_size) + 1)
    cfg = SchedulerConfig(blocks, args.block_size, max_num_seqs=args.seqs,
                          max_num_batched_tokens=args.seqs * args.prompt, max_model_len=max_len,
                          overlap=True)
    sched = Scheduler(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for rid in range(args.seqs):
        prompt = [(rid * 31 + i) % 50000 for i in range(args.prompt)]
        sched.add_request(AddRequest(rid, prompt, params, [2]))

    def answer(plan):
        ids = [ns.seq_id for ns in plan.new_seqs] + plan.cached.seq_ids
        return StepResult(plan.step_id, ids, [7] * len(ids), None)

    # Warm up: prefill everything and reach steady decoding.
    outstanding = None
    for _ in range(3):
        plan = sched.schedule()
        result = answer(plan)
        if outstanding is not None:
            sched.process_result(outstanding)
        outstanding = result

    t_sched = t_proc = 0.0
    clock = time.thread_time  # CPU time: not inflated by other processes on a busy machine
    for _ in range(args.steps):
        t0 = clock()
        plan = sched.schedule()
        t1 = clock()
        result = answer(plan)
        t2 = clock()
        sched.process_result(outstanding)
        t3 = clock()
        t_sched += t1 - t0
        t_proc += t3 - t2
        outstanding = result
    n = args.steps
    assert len(plan.cached.seq_ids) == args.seqs, "not all sequences decoded every step"
    print(f"{args.seqs} decode seqs, block_size {args.block_size}, {n} steps")
    print(f"schedule()        {t_sched / n * 1e3:.3f} ms/step")
    print(f"process_result()  {t_proc / n * 1e3:.3f} ms/step")
    print(f"total             {(t_sched + t_proc) / n * 1e3:.3f} ms/step  (goal <= 0.5)")
    print(f"plan size         {len(encode(plan))} bytes")


if __name__ == "__main__":
    main()
