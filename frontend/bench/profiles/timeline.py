"""Where a step's host time goes between the actors: the stamps that NANOPIPE_HOST_TIMELINE=DIR
makes the scheduler and the workers write as they stop (protocol.profiling.host_timeline), lined up
step by step. The stamps cost a list append each, so unlike torch.profiler they leave the
chain they measure as it is.

    NANOPIPE_HOST_TIMELINE=/tmp/tl nanopipe bench latency --make-random smollm2-135m
    nanopipe profile timeline /tmp/tl
    NANOPIPE_HOST_TIMELINE=/tmp/tl nanopipe bench throughput --make-random smollm2-135m \\
        --modes ahead,ahead2
    nanopipe profile timeline /tmp/tl/2-ahead2      # bench throughput: one per mode

One pipeline per directory: the files are named by actor and rank, so a later pipeline's
replace an earlier one's (`nanopipe bench throughput` gives each mode a subdirectory of its own).

Printed in µs, the median and 90th percentile over the steps (the first --skip left out):
  plan hop     the scheduler hands plan k to its sockets -> worker 0 has it decoded
  launch       worker 0 has plan k -> step k is queued on the device (mirror, batch, graph
               replay; the step before it is finished next, then step k's bookkeeping)
  tokens       worker 0 starts waiting for step k's tokens -> the result is made (the wait
               for the device, then the result's making)
  result hop   worker 0 hands result k to its socket -> the scheduler has it decoded
  apply        the scheduler applies result k (its tokens go out after the next plan)
  next plan    result k applied -> the scheduler sends its next plan
  period       between launches of consecutive steps on worker 0 (batch 1: time per token)
and how often a worker ran out of plans: it had sent result k before plan k+1 arrived, so the
device sat idle from step k's end until step k+1's launch (that gap is shown too).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path

from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure

Stamps = dict[str, dict[int, int]]
"""event -> step id -> perf_counter_ns"""


def load(directory: Path) -> dict[str, Stamps]:
    """actor name (`scheduler0`, `worker0`, ...) -> its stamps; a step's first stamp of an
    event wins."""
    actors: dict[str, Stamps] = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        stamps: Stamps = {}
        for step, event, ns in data["events"]:
            stamps.setdefault(event, {}).setdefault(step, ns)
        actors[data["actor"]] = stamps
    return actors


def _between(a: dict[int, int], b: dict[int, int], first: int) -> list[float]:
    """µs from a[k] to b[k] for every step k >= first that has both."""
    return [(b[k] - a[k]) / 1e3 for k in sorted(a.keys() & b.keys()) if k >= first]


def _next_after(done: dict[int, int], out: dict[int, int], first: int) -> list[float]:
    """µs from each done[k] to the first out stamp at or after it."""
    times = sorted(out.values())
    gaps = []
    for k, t in sorted(done.items()):
        i = bisect.bisect_left(times, t)
        if k >= first and i < len(times):
            gaps.append((times[i] - t) / 1e3)
    return gaps


def _late_plans(worker: Stamps, first: int) -> tuple[int, list[float]]:
    """(steps k whose result went out before plan k+1 came in, the gap from that result to
    step k+1's launch for each): the device had nothing queued in that gap."""
    sent, came, launched = (worker.get(e, {}) for e in ("result_out", "plan_in", "launched"))
    steps = [k for k in sorted(sent) if k >= first and k + 1 in came and k + 1 in launched]
    late = [k for k in steps if sent[k] < came[k + 1]]
    return len(steps), [(launched[k + 1] - sent[k]) / 1e3 for k in late]


def summarize(actors: dict[str, Stamps], skip: int) -> dict[str, dict]:
    sched, worker = actors.get("scheduler0", {}), actors.get("worker0", {})
    steps = sorted(worker.get("launched", {}))
    if not steps:
        raise SystemExit("no worker0.json with launched steps: was NANOPIPE_HOST_TIMELINE set "
                         "for the run, and did it stop cleanly?")
    first = steps[0] + skip

    def get(stamps: Stamps, event: str) -> dict[int, int]:
        return stamps.get(event, {})

    launches = [get(worker, "launched")[k] for k in steps if k >= first]
    series = {
        "plan hop": _between(get(sched, "plan_out"), get(worker, "plan_in"), first),
        "launch": _between(get(worker, "plan_in"), get(worker, "launched"), first),
        "tokens": _between(get(worker, "finish"), get(worker, "result_out"), first),
        "result hop": _between(get(worker, "result_out"), get(sched, "result_in"), first),
        "apply": _between(get(sched, "result_in"), get(sched, "result_done"), first),
        "next plan": _next_after(get(sched, "result_done"), get(sched, "plan_out"), first),
        "period": [(b - a) / 1e3 for a, b in zip(launches, launches[1:])],
    }
    out = {name: _stats(values) for name, values in series.items()}
    counted, gaps = _late_plans(worker, first)
    out["plan late"] = dict(_stats(gaps), of=counted)
    return out


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median_us": round(statistics.median(ordered), 1),
            "p90_us": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("dir", type=Path, help="the directory NANOPIPE_HOST_TIMELINE named")
    ap.add_argument("--skip", type=int, default=20, help="leave out the first steps (warm-up)")
    ap.add_argument("--json", type=Path, help="also write the figures here")


def run(args: argparse.Namespace) -> list[Figure]:
    if not args.dir.is_dir():
        raise BenchUsageError(f"{args.dir} is not a directory")
    links = summarize(load(args.dir), args.skip)
    for name, s in links.items():
        if not s["n"]:
            print(f"{name:11s} none" + (f" of {s['of']} steps" if "of" in s else ""))
            continue
        line = f"{name:11s} median {s['median_us']:9.1f} us   p90 {s['p90_us']:9.1f} us"
        if name == "plan late":
            line += f"   ({s['n']} of {s['of']} steps: the gap from result k to launch k+1)"
        else:
            line += f"   ({s['n']} steps)"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(links, indent=1))
    return [Figure(f"{name.replace(' ', '_')}_us_p50", s["median_us"], "us",
                   higher_is_better=False) for name, s in links.items() if s["n"]]

