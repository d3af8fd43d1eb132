"""docs/benchmarks/results.jsonl holds the project's benchmark history as data: one JSON object
per line, {"workload", "command", "date", "hardware", "commit", "figures", "notes"?}, in the
order measured (a benchmark run with --record appends). `nanopipe bench report` reads it
tolerantly; this test keeps it strict, so that a hand edit cannot slip a bad record in.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import Path

import pytest

from frontend.bench.ceilings import DeviceCeilings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "benchmarks" / "results.jsonl"
REQUIRED = {"workload": str, "command": str, "date": str, "hardware": str, "figures": dict}
OPTIONAL = {"commit", "notes", "ceilings"}
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?(Z|[+-]\d{2}:\d{2})?)?$")
RATIO_SUFFIXES = ("/bound", "/peer")


def _records() -> list[tuple[int, dict]]:
    out = []
    for number, line in enumerate(RESULTS.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append((number, json.loads(line)))
            except ValueError as exc:
                pytest.fail(f"results.jsonl line {number} is not JSON: {exc}")
    return out


def _problems(rec: object) -> list[str]:
    if not isinstance(rec, dict):
        return ["not a JSON object"]
    problems = []
    for key, typ in REQUIRED.items():
        if not isinstance(rec.get(key), typ) or not rec.get(key):
            problems.append(f"{key!r} must be a non-empty {typ.__name__}")
    unknown = set(rec) - set(REQUIRED) - OPTIONAL
    if unknown:
        problems.append(f"unknown keys {sorted(unknown)}")
    if "commit" not in rec:
        problems.append("'commit' is required (null when unknown)")
    elif rec["commit"] is not None and not (isinstance(rec["commit"], str) and rec["commit"]):
        problems.append("'commit' must be a string or null")
    if "notes" in rec and not isinstance(rec["notes"], str):
        problems.append("'notes' must be a string")
    if "ceilings" in rec and DeviceCeilings.from_record(rec["ceilings"]) is None:
        problems.append("'ceilings' must hold positive copy_tb_s and matmul_tflop_s")
    date = rec.get("date")
    if isinstance(date, str):
        if not DATE.match(date):
            problems.append(f"date {date!r} is not ISO 8601")
        else:
            try:
                dt.date.fromisoformat(date[:10])
            except ValueError:
                problems.append(f"date {date!r} is not a calendar date")
    for name, value in (rec.get("figures") or {}).items() if isinstance(rec.get("figures"),
                                                                        dict) else ():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            problems.append(f"figure {name!r} is not a finite number")
        if "/" in name and not name.endswith(RATIO_SUFFIXES):
            problems.append(f"figure {name!r}: '/' only introduces a ratio {RATIO_SUFFIXES}")
    text = json.dumps(rec)
    if "/work/" in text or "/home/" in text:
        problems.append("a machine path in the record")
    return problems


def test_every_record_is_well_formed():
    bad = [f"line {n}: {p}" for n, rec in _records() for p in _problems(rec)]
    assert not bad, "malformed benchmark records:\n" + "\n".join(bad)


def test_records_are_in_the_order_measured():
    """The report takes the latest record per workload by date, then by file order."""
    dates = [(n, rec["date"][:10]) for n, rec in _records()]
    late = [f"line {n} ({d}) after {p}" for (_, p), (n, d) in zip(dates, dates[1:]) if d < p]
    assert not late, f"records out of date order: {late}"


def test_there_is_a_history():
    records = [rec for _, rec in _records()]
    workloads = {rec["workload"] for rec in records}
    for needed in ("throughput", "serving", "prefix", "latency", "cpu", "speculative", "dp", "tp"):
        assert needed in workloads, f"no record of workload {needed!r}"


@pytest.mark.parametrize("rec", [
    {"workload": "w", "command": "c", "date": "2026-13-01", "hardware": "h", "commit": None,
     "figures": {"x": 1}},
    {"workload": "w", "command": "c", "date": "2026-12-01", "hardware": "h", "commit": None,
     "figures": {"x": True}},
    {"workload": "w", "command": "c", "date": "2026-12-01", "hardware": "h",
     "figures": {"x": 1}},
    {"workload": "w", "command": "", "date": "2026-12-01", "hardware": "h", "commit": None,
     "figures": {"x": 1}},
    {"workload": "w", "command": "c", "date": "2026-12-01", "hardware": "h", "commit": None,
     "figures": {"x/ratio": 1}},
    {"workload": "w", "command": "c", "date": "2026-12-01", "hardware": "h", "commit": None,
     "figures": {"x": 1}, "extra": 1},
])
def test_a_malformed_record_is_caught(rec):
    assert _problems(rec)


def test_a_record_as_the_bench_tool_writes_it_passes():
    rec = {"workload": "throughput", "command": "nanopipe bench throughput --make-random "
           "qwen3-0.6b", "date": "2026-12-03T17:00:00Z", "hardware": "1x NVIDIA H200",
           "commit": "0123456789ab", "figures": {"output_tok_s": 25000.0,
                                                 "output_tok_s/bound": 0.7}}
    assert _problems(rec) == []
