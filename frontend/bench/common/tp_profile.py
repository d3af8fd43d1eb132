"""Reading and printing the per-rank profiles the workers write
(gpu_workers.profiling.step_profiler): each rank's step, the ranks side by side, and how each
cost scales from one TP size to another (a ratio of 1/N halves with N ranks; a ratio of 1 does
not shrink at all)."""

from __future__ import annotations

import json
from pathlib import Path

from frontend.bench.common.step_profile import StepProfile, format_profile


def read_ranks(out_dir: Path, world_size: int, window: tuple[int, int]) -> list[dict]:
    """rank0.json .. rank{N-1}.json of one run, each checked to cover the whole window."""
    reports = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if not path.is_file():
            raise SystemExit(f"rank {rank} wrote no profile ({path}): the run ended before plan "
                             f"{window[1]}, the window's end; lower --window")
        report = json.loads(path.read_text())
        if report["steps_seen"] != window[1] - window[0]:
            raise SystemExit(f"rank {rank} saw {report['steps_seen']} of the window's "
                             f"{window[1] - window[0]} steps")
        reports.append(report)
    return reports


def _kib(n: float | None) -> str:
    if n is None:
        return "unknown"
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def format_rank(report: dict) -> str:
    cuda = report["device"] == "cuda"
    lines = [f"rank {report['rank']} of {report['world_size']} ({report['device']}): "
             + format_profile(StepProfile.from_dict(report), cuda)]
    kinds = ", ".join(f"{kind} {k['per_step']:g}/step x {_kib(k['bytes_per_call'])}"
                      for kind, k in report["collectives_by_kind"].items()) or "none"
    lines.append(f"  collectives: {report['collectives_per_step']:g} per step "
                 f"({report['collective_ms_per_step']:.3f} ms), "
                 f"{_kib(report['collective_bytes_per_step'])} per step "
                 f"(sizes known on {report['steps_with_bytes']} of {report['steps_seen']} "
                 f"steps): {kinds}")
    host = report["host_ms_per_step"]
    lines.append("  host ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in host.items())
                 + "  (build_batch, forward and sample run inside launch; settle in finish)")
    return "\n".join(lines)


def compare_ranks(reports: list[dict]) -> str:
    """One line: the ranks' figures side by side (rank 0 samples; the others only wait)."""
    def row(name: str, values: list[float], fmt: str) -> str:
        return f"{name} " + "/".join(format(v, fmt) for v in values)

    return "ranks " + "/".join(str(r["rank"]) for r in reports) + ": " + ", ".join([
        row("wall", [r["wall_ms_per_step"] for r in reports], ".3f") + " ms",
        row("busy", [100 * r["gpu_busy_fraction"] for r in reports], ".0f") + " %",
        row("device", [sum(r["gpu_ms_per_step"].values()) for r in reports], ".3f") + " ms",
        row("collectives", [r["collectives_per_step"] for r in reports], "g"),
        row("launch", [r["host_ms_per_step"]["launch"] for r in reports], ".3f") + " ms",
        row("finish", [r["host_ms_per_step"]["finish"] for r in reports], ".3f") + " ms"])


def scaling_rows(base: dict, other: dict) -> list[tuple[str, float, float]]:
    """(what, base figure, other figure) per step, rank 0 of each run: wall, device time by
    category, collectives, host ranges."""
    rows = [("wall ms", base["wall_ms_per_step"], other["wall_ms_per_step"]),
            ("device ms (all)", sum(base["gpu_ms_per_step"].values()),
             sum(other["gpu_ms_per_step"].values()))]
    rows += [(f"  {cat}", ms, other["gpu_ms_per_step"].get(cat, 0.0))
             for cat, ms in base["gpu_ms_per_step"].items()]
    rows.append(("collectives", base["collectives_per_step"], other["collectives_per_step"]))
    rows += [(f"host {k}", ms, other["host_ms_per_step"][k])
             for k, ms in base["host_ms_per_step"].items()]
    return rows


def format_scaling(base_tp: int, base: dict, tp: int, other: dict) -> str:
    lines = [f"per step, rank 0: TP={tp} against TP={base_tp} "
             f"(ratio {base_tp / tp:.2f} = scales with the ranks, 1.00 = does not shrink)",
             f"  {'':<22} {'TP=' + str(base_tp):>10} {'TP=' + str(tp):>10} {'ratio':>7}"]
    for what, a, b in scaling_rows(base, other):
        ratio = f"{b / a:7.2f}" if a > 0 else "      -"
        lines.append(f"  {what:<22} {a:10.3f} {b:10.3f} {ratio}")
    return "\n".join(lines)
