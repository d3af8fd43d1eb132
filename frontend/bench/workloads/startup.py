"""Start-up: `nanopipe serve` from the command's start to the first 200 from /health, from
empty caches (cold) and from the caches a cold run filled (warm), with the server's own ready
line by phase and the time of its first answer (docs/startup.md).

    nanopipe bench startup --make-random qwen3-0.6b --cold 1 --warm 2   # on the GPU machine
    nanopipe bench startup --device cpu                                  # the embedded model
    nanopipe bench startup --model DIR --serve-args="--enforce-eager --max-num-seqs 64"

Each run starts `nanopipe serve [MODEL] --port P --device D` (P a free loopback port, then
--serve-args' flags) as a child, asks http://127.0.0.1:P/health every 50 ms until it answers
200, sends one short greedy /v1/completions request (first answer), and stops the server
(SIGINT, then SIGKILL; no process is left behind, whatever way the bench ends). The ready line
the server prints on stderr gives the phases, which add up to the engine's own total; the
command's total adds the launcher's imports before the engine starts and the HTTP server's
start after it.

Cold runs point Triton's, torch inductor's and nanopipe's caches at new empty folders in
the child's environment only (frontend/bench/common/cold_caches.py); the warm runs reuse the
first cold run's (with --cold 0, the user's own caches, as they are). The folders are removed
at the end; the user's caches are never touched. Each figure is the median of its runs. The
goals (docs/startup.md: a Qwen3-0.6B shape on an H200 ready in 10 s warm and 25 s cold; the
embedded model on the CPU in 5 s warm) are printed as ratios: above 1 beats the goal.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import statistics
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from frontend.bench.common.cold_caches import empty_caches
from frontend.bench.common.model_source import resolve_model_dir
from frontend.bench.errors import BenchFailed, BenchUsageError
from frontend.bench.figures import Figure
from frontend.engine.startup_times import StartupTimes, parse_ready_line

MODEL = "optional"

GOALS_S = {("cuda", "cold"): 25.0, ("cuda", "warm"): 10.0, ("cpu", "warm"): 5.0}
"""docs/startup.md's goals: seconds to ready by device and caches."""

PROMPT = "The capital of France is"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cold", type=int, default=1,
                    help="start-ups from empty caches, first (default: %(default)s)")
    ap.add_argument("--warm", type=int, default=2,
                    help="start-ups on the first cold run's caches, or with --cold 0 on the "
                    "user's own (default: %(default)s)")
    ap.add_argument("--serve-args", default="", metavar="FLAGS",
                    help="more `nanopipe serve` flags in one string, given with `=`: "
                    "--serve-args=\"--enforce-eager\"")
    ap.add_argument("--answer-tokens", type=int, default=8,
                    help="tokens of the first answer (default: %(default)s)")
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds a start-up may take before the run fails (default: %(default)s)")


@dataclass(frozen=True)
class StartupRun:
    """One measured start-up."""

    kind: str  # "cold" or "warm"
    ready_s: float
    """The command's start to /health's first 200."""
    first_answer_s: float
    engine: StartupTimes
    """The server's ready line: its total and phases."""


def measure(kind: str, command: list[str], port: int, env: dict[str, str],
            args: argparse.Namespace) -> StartupRun:
    """Start the server, time it to healthy and to its first answer, stop it."""
    from frontend.bench.common.serve_process import ServeProcess

    with ServeProcess(command, env) as server:
        try:
            ready_s = server.wait_healthy(port, args.ready_timeout)
            answer_s, text = server.first_answer(port, PROMPT, args.answer_tokens)
        except (RuntimeError, OSError, KeyError, ValueError) as exc:
            raise BenchFailed(f"{kind} start-up: {exc}", []) from exc
        engine = parse_ready_line(server.stderr_text(wait_for="ready in"))
    if engine is None:
        raise BenchFailed(f"{kind} start-up: the server printed no ready line:\n"
                          f"{server.output_tail()}", [])
    print(f"{kind}: healthy in {ready_s:.2f} s, first answer in {answer_s * 1000:.0f} ms "
          f"({text!r}); the server's {engine.line()}", flush=True)
    return StartupRun(kind, ready_s, answer_s, engine)


def figures_of(runs: list[StartupRun], device: str) -> list[Figure]:
    """Per kind of run: the medians of the totals, the first answer, and each phase."""
    out: list[Figure] = []
    for kind in ("cold", "warm"):
        mine = [r for r in runs if r.kind == kind]
        if not mine:
            continue
        goal = GOALS_S.get((device, kind))
        out.append(Figure(f"ready_s[{kind}]", round(statistics.median(r.ready_s for r in mine), 3),
                          "s", bound=goal, higher_is_better=False,
                          bound_name="the goal" if goal else None))
        out.append(Figure(f"first_answer_ms[{kind}]",
                          round(statistics.median(r.first_answer_s for r in mine) * 1000, 1),
                          "ms", higher_is_better=False))
        out.append(Figure(f"engine_ready_s[{kind}]",
                          statistics.median(r.engine.total_s for r in mine), "s",
                          higher_is_better=False))
        for phase in (p.name for p in mine[0].engine.phases):
            out.append(Figure(f"phase_s[{kind} {phase}]",
                              statistics.median(r.engine.phase(phase) for r in mine), "s",
                              higher_is_better=False))
    return out


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # the runs' finally blocks stop the server


def run(args: argparse.Namespace) -> list[Figure]:
    if args.cold < 0 or args.warm < 0 or args.cold + args.warm == 0:
        raise BenchUsageError("--cold and --warm must be >= 0, and one of them >= 1")
    if importlib.util.find_spec("psutil") is None:  # follows the server's processes
        raise BenchUsageError("needs psutil: pip install \"nanopipe[bench]\"")
    from frontend.bench.common.serve_process import free_port, serve_command

    if args.answer_tokens < 1 or args.ready_timeout <= 0:
        raise BenchUsageError("--answer-tokens and --ready-timeout must be positive")
    try:
        extra = shlex.split(args.serve_args)
    except ValueError as exc:
        raise BenchUsageError(f"--serve-args: {exc}") from exc
    if {"--port", "--http", "--device", "--model", "--no-http"} & {a.split("=")[0] for a in extra}:
        raise BenchUsageError("--serve-args: the bench sets --port, --device and the model")
    model_dir = resolve_model_dir(args, args.device, tokenizer=True)
    print(f"startup: nanopipe serve {model_dir or '(embedded model)'} --device {args.device}"
          f"{' ' + shlex.join(extra) if extra else ''}; {args.cold} cold, {args.warm} warm",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="nanopipe-startup-"))
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if main else None
    runs: list[StartupRun] = []
    try:
        warm_env = dict(os.environ)
        for i in range(args.cold):
            env = dict(os.environ, **empty_caches(root / f"cold{i}"))
            if i == 0:
                warm_env = env
            port = free_port()
            runs.append(measure("cold", serve_command(model_dir, port, args.device, extra),
                                port, env, args))
        for _ in range(args.warm):
            port = free_port()
            runs.append(measure("warm", serve_command(model_dir, port, args.device, extra),
                                port, warm_env, args))
    except BenchFailed as exc:
        raise BenchFailed(str(exc), figures_of(runs, args.device)) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(root, ignore_errors=True)
    return figures_of(runs, args.device)
