"""What the workloads share: request generators, random prompts, random-weight models of real
shapes, the hardware bound, how results are printed, the model-source options
(frontend.bench.common.model_source) and the kernel benchmarks' CUDA timing (cuda_timing, for
workloads that run on a GPU)."""

from frontend.bench.common.drive import drain, process, run
from frontend.bench.common.engine_stats import StatsFollower, timed_w1_busy
from frontend.bench.common.hardware import Throughput, hardware_bound_s
from frontend.bench.common.printing import emit, leading_match, sig
from frontend.bench.common.random_model import (
    SHAPES,
    default_device,
    make_random,
    param_count,
    param_shapes,
    write_synthetic_tokenizer,
)
from frontend.bench.common.truncate import truncate_model
from frontend.bench.common.workloads import (
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
    "ID_CAP",
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
