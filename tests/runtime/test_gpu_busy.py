"""Each StepResult carries the device time of the step's forward and sample (on the CPU its
wall time): positive for every step that ran the model, never more than the step took, also
for a prefill chunk that samples nothing."""

from __future__ import annotations

import time

from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from protocol import SamplingParams


def test_every_step_reports_its_busy_time_within_its_wall_time(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i in range(3):
        planner.add(i, [5 + i] * 40, 4, SamplingParams(temperature=0.7, top_p=0.9))
    steps = 0
    while (plan := planner.plan()) is not None:
        start = time.perf_counter()
        result = runner.execute(plan)
        wall = time.perf_counter() - start
        if result.seq_ids:
            assert 0 < result.gpu_busy_s <= wall
            steps += 1
        planner.apply(result)
    assert steps == 4


def test_a_chunk_that_samples_nothing_is_counted_too(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    planner.add(0, list(range(10, 90)), 2, SamplingParams(temperature=0.0))
    start = time.perf_counter()
    first = runner.execute(planner.plan({0: 50}))  # 50 of 80 prompt tokens: nothing sampled
    planner.apply(first)
    second = runner.execute(planner.plan())
    wall = time.perf_counter() - start
    planner.apply(second)
    assert first.seq_ids == [] and second.seq_ids == [0]
    # Each chunk is counted once, in the first result that finds it finished on the device.
    assert first.gpu_busy_s > 0 and second.gpu_busy_s > 0
    assert first.gpu_busy_s + second.gpu_busy_s <= wall
