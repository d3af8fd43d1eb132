"""`nanopipe bench <workload> ...` and `nanopipe profile <what> ...`.

The named module (frontend.bench.registry) adds its own flags to the shared ones and runs;
the figures it returns are printed with their ratios to the hardware bound and the peer, and
with --record FILE appended as one JSON record (frontend.bench.record); both name the device
ceilings the run's bounds were taken at (frontend.bench.ceilings).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from types import ModuleType

from frontend.bench.ceilings import used_ceilings
from frontend.bench.errors import BenchFailed, BenchUsageError
from frontend.bench.figures import as_record, print_figures
from frontend.bench.registry import BENCHMARKS, PROFILES, Entry
from frontend.engine.options import ConfigError

RESULTS = "docs/benchmarks/results.jsonl"
"""Where `--record` without a file appends, relative to the directory it runs in."""


def _overview(kind: str, table: dict[str, Entry]) -> str:
    width = max(len(n) for n in table)
    rows = "\n".join(f"  {name:<{width}}  {e.summary}" for name, e in table.items())
    return (f"usage: nanopipe {kind} NAME [flags]   (nanopipe {kind} NAME --help for its "
            f"flags)\n\n{rows}\n")


def add_shared(ap: argparse.ArgumentParser, module: ModuleType) -> None:
    """The flags every workload shares; the model source only where the workload runs one."""
    shared = ap.add_argument_group("shared")
    model = getattr(module, "MODEL", "none")
    if model != "none":  # --model DIR or --make-random SHAPE, and --device
        from frontend.bench.common.model_source import add_model_source

        add_model_source(shared, required=model == "required")
    else:
        shared.add_argument("--device", default=None, help="cuda or cpu (default: cuda when "
                            "visible)")
    if getattr(module, "PEERS", ()):
        shared.add_argument("--peer", nargs=2, metavar=("NAME", "DIR"),
                            help=f"also run the peer engine NAME ({', '.join(module.PEERS)}) "
                            "from its checkout DIR in the same run, and print the ratio to it")
    if getattr(module, "RECORDS", True):
        shared.add_argument("--record", metavar="FILE", nargs="?", const=RESULTS,
                            help="append one JSON record of the figures to FILE (without "
                            f"FILE: {RESULTS}, the project's records)")
        shared.add_argument("--notes", metavar="TEXT", default="",
                            help="what else the record's reader needs (the machine's state, "
                            "what changed)")


def _normalise(args: argparse.Namespace, module: ModuleType) -> None:
    """Defaults every module may rely on: a device, model/make_random, peer (name, dir).
    A module that runs nothing (no model, no record: the report) is left without torch."""
    if args.device is None and (getattr(module, "MODEL", "none") != "none"
                                or getattr(module, "RECORDS", True)):
        from frontend.bench.common.random_model import default_device

        args.device = default_device()
    for name in ("model", "make_random", "peer", "record", "notes"):
        if not hasattr(args, name):
            setattr(args, name, None)
    if args.peer is not None:
        name, checkout = args.peer
        if name not in module.PEERS:
            raise BenchUsageError(f"--peer {name}: this workload runs "
                                  f"{', '.join(module.PEERS)}")
        args.peer = (name, checkout)


def run_entry(kind: str, table: dict[str, Entry], argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview(kind, table), end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"nanopipe {kind}: unknown {name!r}; one of: {', '.join(table)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name].module)
    prog = f"nanopipe {kind} {name}"
    ap = argparse.ArgumentParser(prog=prog, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(ap)
    add_shared(ap, module)
    args = ap.parse_args(rest)
    try:
        _normalise(args, module)
        figures = module.run(args) or []
    except (BenchUsageError, ConfigError) as exc:  # a flag, or a value the engine refuses
        ap.error(str(exc))
    except BenchFailed as exc:
        print_figures(exc.figures, args.peer[0] if args.peer else None, used_ceilings())
        print(f"{prog}: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    peer = args.peer[0] if args.peer else None
    print_figures(figures, peer, used_ceilings())
    if args.record:
        from frontend.bench.record import append, make_record, portable

        if not figures:
            print(f"{prog}: nothing recorded: the run gave no figures", file=sys.stderr)
            return 1
        workload = name if kind == "bench" else f"profile {name}"
        command = shlex.join(["nanopipe", kind, name, *portable(rest)])
        append(args.record, make_record(workload, command, args.device, as_record(figures),
                                        args.notes, used_ceilings()))
        print(f"recorded in {args.record}", flush=True)
    return 0


def run_command(kind: str, argv: list[str]) -> int:
    """`nanopipe bench ARGV` (kind "bench") or `nanopipe profile ARGV` (kind "profile")."""
    return run_entry(kind, BENCHMARKS if kind == "bench" else PROFILES, argv)
