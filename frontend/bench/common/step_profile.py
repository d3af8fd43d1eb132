"""Printing a StepProfile (gpu_workers.profiling.summary): the per-step time by kernel category
that `nanopipe profile step` and `nanopipe profile tp` report.
"""

from __future__ import annotations

from gpu_workers.profiling.summary import SAMPLER_RANGE, StepProfile, summarize

__all__ = ["SAMPLER_RANGE", "StepProfile", "format_profile", "summarize"]


def format_profile(p: StepProfile, cuda: bool) -> str:
    unit = "GPU" if cuda else "CPU (aten self time)"
    lines = [f"steps {p.steps[0]}-{p.steps[1]}: wall {p.wall_ms_per_step:.3f} ms/step, "
             f"{unit} busy {p.gpu_busy_fraction:.1%} of wall, "
             f"{p.launches_per_step:.0f} launches/step, {p.kernels_per_step:.0f} kernels/step"]
    total = sum(p.gpu_ms_per_step.values())
    for cat, ms in p.gpu_ms_per_step.items():
        share = ms / total if total else 0.0
        lines.append(f"  {cat:<20} {ms:8.3f} ms/step  {share:6.1%}")
    lines.append(f"  {'total':<20} {total:8.3f} ms/step")
    lines.append("  costliest:")
    lines += [f"    {ms:8.3f} ms/step  {name}" for name, ms in p.top]
    return "\n".join(lines)
