"""One JSON line per benchmark run, appended to a results file (docs/benchmarks/results.jsonl):

    {"workload", "command", "date", "hardware", "commit", "figures": {NAME: number, ...},
     "notes"?, "ceilings"?: {"copy_tb_s", "matmul_tflop_s", "measured", "device"}}

`figures` holds each figure and, where known, NAME/bound and NAME/peer (its ratios); `commit`
is null where unknown; `notes` is there when given; `ceilings` are the device's copy
bandwidth and matmul rate that the run's hardware bounds used (frontend.bench.ceilings;
`measured` false: the nominal H200 figures), there when the run computed a bound (older
records have none: their bounds used the nominal figures). The command keeps no path of the
machine it ran on (`portable`).
Reading is tolerant: a line that is not such a record is counted and skipped, so a hand
edit or an older format never stops `nanopipe bench report`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from frontend.bench.ceilings import DeviceCeilings

SOURCE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Record:
    workload: str
    command: str
    date: str
    hardware: str
    commit: str | None
    """None (null) where unknown: no git checkout."""
    figures: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    """What else a reader needs (the lease, what changed); left out of the line when empty."""
    ceilings: DeviceCeilings | None = None
    """The ceilings the figures' bounds used; None where the run computed no hardware bound."""


def hardware(device: str | None) -> str:
    """The accelerator's name on cuda, else the CPU's, with the core count."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def commit() -> str | None:
    """The source tree's commit (with +dirty for uncommitted changes), or None."""
    try:
        head = subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(SOURCE_ROOT), "diff", "--quiet", "HEAD", "--"],
                               capture_output=True, timeout=10).returncode != 0
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def make_record(workload: str, command: str, device: str | None, figures: dict[str, float],
                notes: str = "", ceilings: DeviceCeilings | None = None) -> Record:
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    return Record(workload, command, now.isoformat().replace("+00:00", "Z"), hardware(device),
                  commit(), figures, notes, ceilings)


def portable(argv: list[str], cwd: Path | None = None, home: Path | None = None) -> list[str]:
    """The arguments with this machine's paths left out: a path under the working directory
    becomes relative, one under the home directory starts with ~, and one that shares only its
    first folder with the working directory is written relative to it (records are kept in
    the repository; the machine they were taken on has other paths)."""
    cwd = (cwd or Path.cwd()).resolve()
    home = (home or Path.home()).resolve()
    out = []
    for arg in argv:
        path = Path(arg)
        if not arg.startswith("/") or not path.is_absolute():
            out.append(arg)
        elif path.is_relative_to(cwd):
            out.append(path.relative_to(cwd).as_posix() or ".")
        elif path.is_relative_to(home):
            out.append("~/" + path.relative_to(home).as_posix())
        elif len(path.parts) > 1 and len(cwd.parts) > 1 and path.parts[1] == cwd.parts[1]:
            out.append(os.path.relpath(path, cwd))
        else:
            out.append(arg)
    return out


def append(path: str | Path, record: Record) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = asdict(record)
    if not line["notes"]:
        del line["notes"]
    if record.ceilings is None:
        del line["ceilings"]
    else:
        line["ceilings"] = record.ceilings.record()
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def _parse(line: str) -> Record | None:
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("workload"), str):
        return None
    figures = raw.get("figures")
    if not isinstance(figures, dict):
        return None
    numbers = {str(k): float(v) for k, v in figures.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Record(raw["workload"], str(raw.get("command", "")), str(raw.get("date", "")),
                  str(raw.get("hardware", "")), str(raw.get("commit") or ""), numbers,
                  str(raw.get("notes") or ""), DeviceCeilings.from_record(raw.get("ceilings")))


def read(path: str | Path) -> tuple[list[Record], int]:
    """The records in file order, and how many non-empty lines were skipped as unreadable."""
    records, skipped = [], 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = _parse(line)
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return records, skipped
