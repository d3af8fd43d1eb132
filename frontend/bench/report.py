"""`nanopipe bench report`: the latest record of every workload and variant as a table in
docs/benchmarks.md (between two marker comments; the rest of the page is left as written),
and one plot per row of its headline figure over its records.

A variant is a workload run with other options: the model's shape, a longer
--max-model-len, an fp8 cache, another device. Each has its own row and plot, named by the
options of its `nanopipe bench WORKLOAD` command, less where it was recorded, its notes and
its peer (a peer adds a ratio to the same measurement). So the latest W4 of one shape never
hides another's.

    nanopipe bench report
    nanopipe bench report --results FILE --doc FILE --plots DIR

Tolerant by design: unreadable lines are skipped and counted, a record without the
workload's headline figure shows its first figure, an unknown workload is tabled as it is, a
record without the device ceilings its bound used (one from before they were recorded) shows
the ratio alone, and without matplotlib the table is still written (the plots are skipped,
saying so).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

from frontend.bench.ceilings import DeviceCeilings
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure, fmt
from frontend.bench.record import Record, read
from frontend.bench.registry import BENCHMARKS

MODEL = "none"
RECORDS = False
BEGIN = "<!-- nanopipe bench report: begin (generated; edit the records, not this table) -->"
END = "<!-- nanopipe bench report: end -->"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", default="docs/benchmarks/results.jsonl",
                    help="the records (default: %(default)s)")
    ap.add_argument("--doc", default="docs/benchmarks.md",
                    help="the page whose table is regenerated (default: %(default)s)")
    ap.add_argument("--plots", default="docs/benchmarks",
                    help="where the plots go (default: %(default)s)")
    ap.add_argument("--no-plots", action="store_true", help="the table only")


def headline(rec: Record) -> tuple[str, float] | None:
    """The figure the table shows: the workload's headline, else the record's first figure."""
    entry = BENCHMARKS.get(rec.workload)
    name = entry.headline if entry else ""
    if name not in rec.figures:
        name = next((k for k in rec.figures if "/" not in k), "")
    return (name, rec.figures[name]) if name else None


SAME_MEASUREMENT = {"--record": 1, "--notes": 1, "--peer": 2}
"""Options that do not make another variant, and how many values each may take."""


def variant(rec: Record) -> str:
    """The options that tell this record's run apart from other runs of its workload ("" for
    a command that is not `nanopipe bench WORKLOAD ...`)."""
    marker = f"nanopipe bench {rec.workload}"
    if marker not in rec.command:
        return ""
    tail = rec.command.split(marker, 1)[1].split("&&", 1)[0]
    try:
        words = shlex.split(tail)
    except ValueError:  # unbalanced quotes in a hand-written command
        words = tail.split()
    kept, i = [], 0
    while i < len(words):
        values = SAME_MEASUREMENT.get(words[i])
        if values is None:
            kept.append(words[i])
        for _ in range(values or 0):  # its values, as far as they are not options
            if i + 1 < len(words) and not words[i + 1].startswith("--"):
                i += 1
        i += 1
    return " ".join(kept)


def row_name(rec: Record) -> str:
    """The workload, and its variant's options where it has any."""
    options = variant(rec)
    return f"{rec.workload} {options}" if options else rec.workload


def plot_name(row: str) -> str:
    """A file name for a row's plot: its words joined by dashes."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", row).strip("-") + ".png"


def latest(records: list[Record]) -> dict[str, Record]:
    """Per row (workload and variant) the record with the latest date (file order breaks
    ties), in first-seen order of the rows."""
    out: dict[str, tuple[str, int, Record]] = {}
    for i, rec in enumerate(records):
        row = row_name(rec)
        best = out.get(row)
        if best is None or (rec.date, i) >= (best[0], best[1]):
            out[row] = (rec.date, i, rec)
    return {row: r for row, (_, _, r) in out.items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def bound_cell(ratio: float | None, ceilings: DeviceCeilings | None) -> str:
    """The ratio to the bound, and the ceilings it was taken at where the record has them."""
    if ratio is None:
        return "-"
    if ceilings is None:
        return f"{ratio:.3f}"
    return (f"{ratio:.3f} at {ceilings.copy_tb_s:.3g} TB/s, {ceilings.matmul_tflop_s:.0f} "
            f"TFLOP/s" + ("" if ceilings.measured else " (nominal)"))


def table(records: dict[str, Record], plots: dict[str, str]) -> str:
    rows = ["| workload | figure | value | of the bound | vs peer | hardware | commit | date "
            "| command |",
            "|---|---|---|---|---|---|---|---|---|"]
    for row, rec in records.items():
        head = headline(rec)
        name, value = head if head else ("-", None)
        bound = rec.figures.get(f"{name}/bound")
        peer = rec.figures.get(f"{name}/peer")
        label = f"[{row}]({plots[row]})" if row in plots else row
        rows.append("| " + " | ".join(_cell(c) for c in (
            label, name, "-" if value is None else fmt(value),
            bound_cell(bound, rec.ceilings), "-" if peer is None else f"{peer:.3f}x",
            rec.hardware or "-", rec.commit or "-", rec.date[:10] or "-",
            f"`{rec.command}`" if rec.command else "-")) + " |")
    return "\n".join(rows)


def write_doc(doc: Path, body: str) -> None:
    """Put `body` between the markers, adding them (at the end) where the page has none."""
    block = f"{BEGIN}\n{body}\n{END}"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    if BEGIN in text and END in text.split(BEGIN, 1)[1]:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Latest result per workload\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def plot(workload: str, records: list[Record], out: Path) -> Path | None:
    """The latest record's headline figure over the workload's records that have it (x: their
    dates), or None without one. A record whose headline is another figure (a comparison that
    measured something else) is left out: one plot shows one quantity."""
    points = [(r.date[:10], *h) for r in records if (h := headline(r))]
    points = [p for p in points if p[1] == points[-1][1]]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(len(points)), [v for _, _, v in points], "o-")
    ax.set_xticks(range(len(points)), [d for d, _, _ in points], rotation=30, fontsize=7)
    ax.set_ylabel(points[-1][1])
    ax.set_title(f"{workload}: {points[-1][1]} per record")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> list[Figure]:
    results = Path(args.results)
    if not results.is_file():
        raise BenchUsageError(f"no records at {results} (a benchmark run with --record "
                              f"{results} adds one)")
    records, skipped = read(results)
    newest = latest(records)
    doc = Path(args.doc)
    plots: dict[str, str] = {}
    if not args.no_plots and newest:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("plots skipped: matplotlib is not installed (the `bench` extra)")
        else:
            out_dir = Path(args.plots)
            out_dir.mkdir(parents=True, exist_ok=True)
            for row in newest:
                mine = [r for r in records if row_name(r) == row]
                path = plot(row, mine, out_dir / plot_name(row))
                if path is not None:  # linked relative to the page
                    plots[row] = Path(os.path.relpath(path, doc.parent)).as_posix()
    write_doc(doc, table(newest, plots))
    print(f"{doc}: {len(newest)} row(s) from {len(records)} record(s)"
          + (f", {skipped} unreadable line(s) skipped" if skipped else "")
          + (f"; {len(plots)} plot(s) in {args.plots}" if plots else ""), flush=True)
    return []
