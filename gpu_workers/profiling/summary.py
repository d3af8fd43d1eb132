"""Per-step time by kernel category from a torch.profiler trace of a window of engine steps.

On CUDA the device events (kernels, copies) are summed by category, the host's launch calls
are counted, and the union of the kernels' intervals over the window's wall time is the GPU
busy fraction. On the CPU (smoke runs) the aten ops' self times stand in for kernels, and
gloo's collectives (which run on gloo's own threads) for NCCL's. The
sampler's kernels are told apart by the profiler range the caller puts around the sampler
(SAMPLER_RANGE); its reductions and the one-pass sampler's kernels (kernels.sampling,
`_sample_*`) are recognised by name too, where no range reaches the device (sampling inside a
CUDA graph).

It lives with the workers because each rank's profiling window (gpu_workers.profiling.step_profiler)
summarises its own trace; frontend.bench.common.step_profile prints it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

RANGE_PREFIX = "nanopipe."
"""Every profiler range the engine opens is named RANGE_PREFIX + what it covers."""
SAMPLER_RANGE = RANGE_PREFIX + "sampler"
CATEGORIES = ("attention", "GEMM", "norm", "rotary/kv-store", "elementwise/copies", "sampler",
              "collectives", "other")
COLLECTIVE = re.compile(
    r"^(nccl|gloo):|^symm_mem::|^nccl\w*kernel|^(void )?[\w:]*all_reduce\w*_kernel", re.IGNORECASE)
"""A collective: the backend's host-side op (`nccl:all_reduce`, `gloo:broadcast`,
`symm_mem::one_shot_all_reduce_copy_out`, with the tensor's shape when shapes are recorded) or
its kernel on the device (NCCL's, or symmetric memory's `one_shot_all_reduce_kernel`)."""
_PATTERNS = [  # first match wins; names are lower-cased
    ("collectives", r"^nccl|^gloo:|^symm_mem::|all_reduce\w*_kernel"),
    ("sampler", r"argmax|argmin|exponential|distribution|topk|sort|softmax|logsumexp|cumsum"
                r"|radix|bitonic|^_sample_"),
    ("rotary/kv-store", r"rotary|rope|store_kv|reshape_and_cache|kv_cache|qk_norm"),
    ("attention", r"attention|attn|flash|fmha|decode_split|decode_reduce|sdpa"),
    ("GEMM", r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|xmma|nvjet|cublas|wgmma"
             r"|sm90_|splitk"),
    ("norm", r"norm"),
    ("elementwise/copies", r"elementwise|vectorized|copy|memcpy|memset|fill|cat|index|silu"
                           r"|act_and_mul|aten::(add|mul|div|sub|neg|log|exp|where|to|_to_copy"
                           r"|view|reshape|slice|select|empty|clone|contiguous|embedding)"),
]
CPU_OPS = ("aten::", "mkldnn::")
"""On the CPU the ops of these namespaces stand in for kernels (mkldnn::_linear_pointwise is
the matmul over oneDNN-reordered weights: gpu_workers.layers.cpu_linear)."""
LAUNCH_CALLS = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"}


def categorize(name: str) -> str:
    low = name.lower()
    for cat, pattern in _PATTERNS:
        if re.search(pattern, low):
            return cat
    return "other"


@dataclass
class StepProfile:
    steps: tuple[int, int]
    """The window: steps [first, last) of the run."""
    wall_ms_per_step: float
    gpu_ms_per_step: dict[str, float]
    launches_per_step: float
    """Host launch calls (kernels, graph replays, async copies); on the CPU, aten ops."""
    kernels_per_step: float
    gpu_busy_fraction: float
    top: list[tuple[str, float]] = field(default_factory=list)
    """The costliest kernels: (name, ms per step)."""

    def as_dict(self) -> dict:
        return dict(steps=list(self.steps), wall_ms_per_step=round(self.wall_ms_per_step, 4),
                    gpu_ms_per_step={k: round(v, 4) for k, v in self.gpu_ms_per_step.items()},
                    launches_per_step=round(self.launches_per_step, 1),
                    kernels_per_step=round(self.kernels_per_step, 1),
                    gpu_busy_fraction=round(self.gpu_busy_fraction, 4),
                    top=[[n, round(ms, 4)] for n, ms in self.top])

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        """The inverse of as_dict (extra keys ignored): a profile read back from JSON."""
        return cls(steps=tuple(d["steps"]), wall_ms_per_step=d["wall_ms_per_step"],
                   gpu_ms_per_step=dict(d["gpu_ms_per_step"]),
                   launches_per_step=d["launches_per_step"],
                   kernels_per_step=d["kernels_per_step"],
                   gpu_busy_fraction=d["gpu_busy_fraction"],
                   top=[(n, ms) for n, ms in d["top"]])


def summarize(events, steps: tuple[int, int], wall_s: float, cuda: bool) -> StepProfile:
    """`events`: prof.events() of a torch.profiler run over the window's steps."""
    n = steps[1] - steps[0]
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    per_name: dict[str, float] = {}
    launches = kernels = 0
    intervals: list[tuple[float, float]] = []
    if cuda:
        device = [e for e in events if e.device_type.name == "CUDA"]
        ranges = [(e.time_range.start, e.time_range.end) for e in device
                  if e.name == SAMPLER_RANGE]
        launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
        for e in device:
            # Our ranges (nanopipe.*) show up on the device too, spanning their kernels:
            # counting them would count those kernels twice and the gaps as busy.
            if e.name.startswith(RANGE_PREFIX) or e.name.startswith("gpu_user_annotation"):
                continue
            start, end = e.time_range.start, e.time_range.end
            in_sampler = any(a <= start < b for a, b in ranges)
            cat = "sampler" if in_sampler else categorize(e.name)
            us = end - start
            per_cat[cat] += us
            per_name[e.name] = per_name.get(e.name, 0.0) + us
            intervals.append((start, end))
            kernels += 1
        busy_us = _union(intervals)
    else:
        busy_us = 0.0
        stack = _sampler_ids(events)
        for e in events:
            collective = COLLECTIVE.match(e.name)
            if not (collective or e.name.startswith(CPU_OPS)):
                continue
            # gloo's ops run on its own threads: the profiler counts no self time for them.
            us = e.time_range.elapsed_us() if collective else e.self_cpu_time_total
            cat = "sampler" if id(e) in stack else categorize(e.name)
            per_cat[cat] += us
            per_name[e.name] = per_name.get(e.name, 0.0) + us
            busy_us += us
            launches += 1
        kernels = launches
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:10]
    return StepProfile(
        steps=steps, wall_ms_per_step=wall_s * 1e3 / n,
        gpu_ms_per_step={k: v / 1e3 / n for k, v in per_cat.items()},
        launches_per_step=launches / n, kernels_per_step=kernels / n,
        gpu_busy_fraction=min(1.0, busy_us / 1e6 / wall_s),
        top=[(name[:80], us / 1e3 / n) for name, us in top])


def _sampler_ids(events) -> set[int]:
    """ids of the CPU events nested inside a SAMPLER_RANGE."""
    out: set[int] = set()

    def walk(e) -> None:
        for child in e.cpu_children:
            out.add(id(child))
            walk(child)

    for e in events:
        if e.name == SAMPLER_RANGE and e.device_type.name == "CPU":
            walk(e)
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
