"""Where one worker's start-up goes, function by function: a ModelRunner built in a fresh
process with the worker settings `nanopipe serve` would give it (its defaults, or
--serve-args), once to fill the caches and then again under cProfile.

    nanopipe profile startup --make-random qwen3-0.6b            # on the GPU machine
    nanopipe profile startup --make-random qwen3-0.6b --serve-args="--kv-offloading-size 0"
    nanopipe profile startup --device cpu                          # the embedded model

Each start runs in its own interpreter, as a worker does, so the profiled one pays what a
warm start pays (imports made on first use, the CUDA context, kernels loaded from Triton's
cache) and nothing a previous start in the same process already did. Printed per start: its
phases and their parts, as the ready line names them (`nanopipe bench startup` times the
whole `nanopipe serve`); then the profiled start's costliest functions, cumulative and by
their own time. cProfile inflates Python-heavy calls (imports most); a C call that waits
(a page fault behind another thread's pinning, a device synchronize) is charged in full.
--cold first points Triton's, torch inductor's and nanopipe's caches at new empty folders,
so the filling start is a first start.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from frontend.bench.common.cold_caches import empty_caches
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from frontend.engine.startup import child_env

MODEL = "optional"
CHILD = "from frontend.bench.profiles.startup import child; child()"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--serve-args", default="", metavar="FLAGS",
                    help="`nanopipe serve` flags the worker's settings come from")
    ap.add_argument("--cold", action="store_true",
                    help="the filling start with empty Triton, torch and nanopipe caches")
    ap.add_argument("--top", type=int, default=30,
                    help="functions printed per order (default: %(default)s)")


def child() -> None:
    """One start: argv is the serve flags, then whether to profile and how many functions."""
    import cProfile
    import io
    import pstats

    from frontend.engine.serve_flags import parse_serve_args
    from gpu_workers.host_tier import pin_by_registering

    *flags, profile, top = sys.argv[1:]
    config = parse_serve_args(flags).engine.worker_config("tcp://127.0.0.1:0")
    if config.device == "cuda":
        pin_by_registering()  # as the worker does, before anything is pinned
    from gpu_workers.model_runner import ModelRunner

    prof = cProfile.Profile() if profile == "1" else None
    if prof is not None:
        prof.enable()
    runner = ModelRunner(config)
    report = ""
    if prof is not None:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(int(top))
        stats.sort_stats("tottime").print_stats(int(top))
        report = out.getvalue()
    print(report)
    print(json.dumps({"phases": [[p.name, p.seconds] for p in runner.startup.phases],
                      "parts": [[p.name, p.seconds] for p in runner.startup.parts]}))


def _start(flags: list[str], profile: bool, top: int, env: dict[str, str]) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, *flags, "1" if profile else "0",
                          str(top)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the start failed:\n{out.stderr[-3000:]}")
    *report, last = out.stdout.rstrip().splitlines()
    return json.loads(last), "\n".join(report)


def _line(label: str, times: dict) -> str:
    phases = ", ".join(f"{name} {s:.2f}" for name, s in times["phases"])
    parts = ", ".join(f"{name} {s:.2f}" for name, s in times["parts"])
    total = sum(s for _, s in times["phases"])
    return f"{label}: {total:.2f} s ({phases})" + (f" [{parts}]" if parts else "")


def run(args: argparse.Namespace) -> list[Figure]:
    if args.top < 1:
        raise BenchUsageError(f"--top must be at least 1, got {args.top}")
    model_dir = resolve_model_dir(args, args.device)
    flags = [*([model_dir] if model_dir else []), "--device", args.device,
             *shlex.split(args.serve_args)]
    env = child_env()  # the children run this checkout's nanopipe, wherever started from
    if args.cold:
        env.update(empty_caches(Path(tempfile.mkdtemp(prefix="nanopipe-cold-"))))
    filled, _ = _start(flags, False, args.top, env)
    print(_line("filling start" + (" (cold caches)" if args.cold else ""), filled), flush=True)
    profiled, report = _start(flags, True, args.top, env)
    print(_line("profiled start", profiled))
    print(report)
    return [Figure(f"start_s[{label}]", round(sum(s for _, s in t["phases"]), 3), "s")
            for label, t in (("filling", filled), ("profiled", profiled))]
