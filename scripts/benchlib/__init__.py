"""What the benchmarks share: workloads, random prompts, random-weight models of real shapes,
the hardware bound, how results are printed, and their common command-line options
(benchlib.cli); the kernel benchmarks' CUDA timing (benchlib.cuda_timing, for scripts
that run on a GPU).

Scripts run as `python scripts/bench_x.py` find this package beside them; no script imports
another script or anything under tests/.
"""

from benchlib.drive import drain, process, run
from benchlib.engine_stats import StatsFollower, timed_w1_busy
from benchlib.hardware import COPY_BYTES_PER_S, MATMUL_FLOPS_PER_S, Throughput, hardware_bound_s
from benchlib.random_model import (
    SHAPES,
    default_device,
    make_random,
    param_count,
    param_shapes,
    write_synthetic_tokenizer,
)
from benchlib.report import emit, leading_match, sig
from benchlib.truncate import truncate_model
from benchlib.workloads import (
    ID_CAP,
    W1_WARMUP_PROMPT,
    greedy,
    random_ids,
    random_prompts,
    timed_w1,
    w1_params,
    w1_workload,
)

__all__ = [
    "COPY_BYTES_PER_S",
    "ID_CAP",
    "MATMUL_FLOPS_PER_S",
    "SHAPES",
    "StatsFollower",
    "Throughput",
    "W1_WARMUP_PROMPT",
    "default_device",
    "drain",
    "emit",
    "greedy",
    "hardware_bound_s",
    "leading_match",
    "make_random",
    "param_count",
    "param_shapes",
    "process",
    "random_ids",
    "random_prompts",
    "run",
    "sig",
    "timed_w1",
    "truncate_model",
    "timed_w1_busy",
    "w1_params",
    "w1_workload",
    "write_synthetic_tokenizer",
]
