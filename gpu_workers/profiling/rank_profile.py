"""What one rank's profiling window cost, step by step: the host time of the runner's ranges,
and the collectives (how many, how many bytes), beside the per-category device time of
gpu_workers.profiling.summary.

Steps are told apart by the host: step k runs from the start of its launch range to the start
of the next one (the last to the window's end marker). A host event belongs to the step in
which it starts; a device kernel to the step in which the host op that launched it started
(its own start where the profiler does not link it).

Collectives: on CUDA the NCCL kernels are counted (they run inside CUDA graphs too); on the
CPU gloo's ops. Their bytes are the size of the tensor this rank passes in, as the backend's
host-side op records it (`nccl:all_reduce`, `gloo:broadcast`, with shapes recorded); a
collective replayed inside a CUDA graph has no host op, and a step where the host ops do not
account for every kernel reports no bytes rather than too few.
"""

from __future__ import annotations

import bisect
import math
import re
from typing import Any

from gpu_workers.profiling.summary import COLLECTIVE, summarize

LAUNCH_RANGE = "nanopipe.launch"
FINISH_RANGE = "nanopipe.finish"
BUILD_BATCH_RANGE = "nanopipe.build_batch"
FORWARD_RANGE = "nanopipe.forward"
SAMPLE_RANGE = "nanopipe.sample"
SETTLE_RANGE = "nanopipe.settle"
WINDOW_END = "nanopipe.window_end"
HOST_RANGES = {LAUNCH_RANGE: "launch", FINISH_RANGE: "finish", BUILD_BATCH_RANGE: "build_batch",
               FORWARD_RANGE: "forward", SAMPLE_RANGE: "sample", SETTLE_RANGE: "settle"}
_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
             "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
_NCCL_KIND = re.compile(r"kernel_([a-z]+)", re.IGNORECASE)
_SYMM_KIND = re.compile(r"(\w*all_reduce)\w*_kernel")


def rank_profile(events: Any, steps: tuple[int, int], wall_s: float, cuda: bool) -> dict:
    """`events`: prof.events() of the window; the plain dict that rank{R}.json holds."""
    cpu = [e for e in events if e.device_type.name == "CPU"]
    starts = sorted(e.time_range.start for e in cpu if e.name == LAUNCH_RANGE)
    ends = [e.time_range.start for e in cpu if e.name == WINDOW_END]
    end = ends[0] if ends else max((e.time_range.end for e in cpu), default=0.0)
    bounds = starts + [end]
    n = len(starts)
    per_step = [dict(step=steps[0] + k, wall_ms=(bounds[k + 1] - bounds[k]) / 1e3,
                     host_ms=dict.fromkeys(HOST_RANGES.values(), 0.0), collectives=0,
                     host_collectives=0, collective_bytes=0, collective_ms=0.0,
                     by_kind={}) for k in range(n)]

    def step_of(t: float) -> dict | None:
        k = bisect.bisect_right(starts, t) - 1
        return per_step[k] if 0 <= k < n and t < end else None

    for e in cpu:
        s = step_of(e.time_range.start)
        if s is None:
            continue
        if e.name in HOST_RANGES:
            s["host_ms"][HOST_RANGES[e.name]] += e.time_range.elapsed_us() / 1e3
        elif COLLECTIVE.match(e.name):
            kind = e.name.rsplit(":", 1)[1]
            size = _bytes(e)
            s["host_collectives"] += 1
            s["collective_bytes"] = None if size is None or s["collective_bytes"] is None \
                else s["collective_bytes"] + size
            if not cuda:
                _count(s, kind, size, e.time_range.elapsed_us())
    if cuda:
        # A kernel's linked id is the id of the host op it was launched under; host ops have
        # no linked id themselves (runtime calls do, and their ids are another sequence).
        # Some torch builds do not expose the link: a kernel then counts where it started.
        launched_at = {e.id: e.time_range.start for e in cpu
                       if getattr(e, "linked_correlation_id", None) == 0}
        for e in events:
            if e.device_type.name != "CUDA" or not COLLECTIVE.match(e.name):
                continue
            link = getattr(e, "linked_correlation_id", None)
            s = step_of(launched_at.get(link, e.time_range.start))
            if s is not None:
                _count(s, _kind(e.name), None, e.time_range.elapsed_us())
    for s in per_step:
        if s["host_collectives"] != s["collectives"]:
            s["collective_bytes"] = None
        s["collective_ms"] = round(s["collective_ms"], 4)
        s["wall_ms"] = round(s["wall_ms"], 4)
        s["host_ms"] = {k: round(v, 4) for k, v in s["host_ms"].items()}
    summary = summarize(events, steps, wall_s, cuda).as_dict()
    known = [s["collective_bytes"] for s in per_step if s["collective_bytes"] is not None]
    return dict(
        summary, steps_seen=n, per_step=per_step,
        host_ms_per_step={k: round(_mean(s["host_ms"][k] for s in per_step), 4)
                          for k in HOST_RANGES.values()},
        collectives_per_step=round(_mean(s["collectives"] for s in per_step), 3),
        collective_ms_per_step=round(_mean(s["collective_ms"] for s in per_step), 4),
        collective_bytes_per_step=round(_mean(known), 1) if known else None,
        steps_with_bytes=len(known),
        collectives_by_kind=_kinds(per_step))


def _count(step: dict, kind: str, size: int | None, us: float) -> None:
    step["collectives"] += 1
    step["collective_ms"] += us / 1e3
    k = step["by_kind"].setdefault(kind, dict(count=0, bytes=0))
    k["count"] += 1
    k["bytes"] = None if size is None or k["bytes"] is None else k["bytes"] + size


def _kinds(per_step: list[dict]) -> dict[str, dict]:
    """Per kind: count per step, and bytes per call where every call's size is known."""
    out: dict[str, dict] = {}
    for s in per_step:
        for kind, k in s["by_kind"].items():
            o = out.setdefault(kind, dict(count=0, bytes=0))
            o["count"] += k["count"]
            o["bytes"] = None if k["bytes"] is None or o["bytes"] is None \
                else o["bytes"] + k["bytes"]
    n = max(1, len(per_step))
    return {kind: dict(per_step=round(o["count"] / n, 3),
                       bytes_per_call=None if o["bytes"] is None
                       else round(o["bytes"] / o["count"], 1))
            for kind, o in sorted(out.items())}


def _bytes(e: Any) -> int | None:
    """The size of the first tensor a collective's host op was given, where recorded."""
    shapes, dtypes = e.input_shapes or [], getattr(e, "input_dtypes", None) or []
    if not shapes or not dtypes or (dtypes[0] not in _ITEMSIZE and "Float8" not in dtypes[0]):
        return None
    return math.prod(shapes[0]) * _ITEMSIZE.get(dtypes[0], 1)


def _kind(kernel: str) -> str:
    """ncclDevKernel_AllReduce_Sum_bf16_RING_LL -> all_reduce (gloo's host names' style);
    c10d::symmetric_memory::one_shot_all_reduce_kernel<...> -> one_shot_all_reduce."""
    if (symm := _SYMM_KIND.search(kernel)) is not None:
        return symm.group(1)
    m = _NCCL_KIND.search(kernel)
    if not m:
        return "nccl"
    return re.sub(r"(?<!^)([A-Z])", r"_\1", m.group(1)).lower()


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
