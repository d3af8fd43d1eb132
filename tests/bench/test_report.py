"""`nanopipe bench report`: the records as the page's table and plots, records from before the
device ceilings were recorded beside those that carry them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.bench.ceilings import NOMINAL, DeviceCeilings
from frontend.bench.record import Record, append, read
from frontend.bench.report import latest, table
from tests.bench.test_tool import ROOT, nanopipe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
H100 = DeviceCeilings(3.012e12, 781.3e12, "NVIDIA H100 80GB HBM3", measured=True)


def test_the_project_records_all_read_with_or_without_ceilings():
    """Most records kept so far predate the ceilings: every one still reads, and those that
    carry ceilings were measured on a GPU."""
    records, skipped = read(ROOT / "docs" / "benchmarks" / "results.jsonl")
    assert skipped == 0 and len(records) > 100
    assert any(r.ceilings is None for r in records)
    assert all(r.ceilings.measured for r in records if r.ceilings is not None)


def test_the_table_shows_the_ceilings_a_ratio_used_where_the_record_has_them(tmp_path):
    results = tmp_path / "results.jsonl"
    old = dict(workload="latency", command="nanopipe bench latency --make-random qwen3-0.6b",
               date="2026-12-04T00:00:00Z", hardware="1x NVIDIA H200", commit="aaaa",
               figures={"tpot_ms": 1.05, "tpot_ms/bound": 0.291})
    odd = dict(old, command="nanopipe bench latency --make-random smollm2-135m",
               ceilings={"copy_tb_s": "fast"})  # a hand edit: read, its ceilings ignored
    results.write_text(json.dumps(old) + "\n" + json.dumps(odd) + "\n")
    for command, ceilings in (("--make-random qwen3-0.6b", H100), ("--device cpu", NOMINAL)):
        append(results, Record("throughput", f"nanopipe bench throughput {command}",
                               "2026-12-06T00:00:00Z", "1x NVIDIA H100 80GB HBM3", "bbbb",
                               {"output_tok_s": 30000.0, "output_tok_s/bound": 0.812},
                               ceilings=ceilings))
    records, skipped = read(results)
    assert skipped == 0
    assert [r.ceilings for r in records[:2]] == [None, None]
    assert records[2].ceilings == H100 and records[3].ceilings == NOMINAL
    rows = table(latest(records), {}).splitlines()[2:]
    assert rows[0].startswith("| latency --make-random qwen3-0.6b | tpot_ms | 1.05 | 0.291 | - |")
    assert rows[1].startswith("| latency --make-random smollm2-135m | tpot_ms | 1.05 | 0.291 |")
    assert rows[2].startswith("| throughput --make-random qwen3-0.6b | output_tok_s | 30,000 | "
                              "0.812 at 3.01 TB/s, 781 TFLOP/s | - | 1x NVIDIA H100 80GB HBM3 |")
    assert rows[3].startswith("| throughput --device cpu | output_tok_s | 30,000 | "
                              "0.812 at 4.3 TB/s, 790 TFLOP/s (nominal) | - |")


def _write_records(path: Path) -> None:
    lines = [
        dict(workload="throughput", command="nanopipe bench throughput --make-random qwen3-0.6b",
             date="2026-12-01T10:00:00Z", hardware="1x NVIDIA H200", commit="aaaa",
             figures={"output_tok_s": 24000.0, "output_tok_s/bound": 0.67}),
        "not json at all",
        dict(workload="throughput", command="nanopipe bench throughput --make-random qwen3-0.6b "
             "--peer nano-vllm ~/nano-vllm", date="2026-12-03T10:00:00Z",
             hardware="1x NVIDIA H200", commit="bbbb",
             figures={"output_tok_s": 25000.0, "output_tok_s/bound": 0.70,
                      "output_tok_s/peer": 1.5}),
        dict(workload="latency", command="nanopipe bench latency --make-random qwen3-0.6b",
             date="2026-12-02T10:00:00Z", hardware="1x NVIDIA H200", commit="cccc",
             figures={"ttft_ms": 7.3, "tpot_ms": 1.05, "tpot_ms/bound": 0.4}),
        dict(workload="returning", command="nanopipe bench returning", date="2026-12-03",
             hardware="cpu", commit="dddd", figures={"prefill_tokens": 123}),
        dict(workload="broken", figures="none"),
        dict(workload="latency", command="nanopipe bench latency --make-random qwen3-0.6b "
             "--max-model-len 131072 --record --notes 'a later, longer variant'",
             date="2026-12-03T10:00:00Z", hardware="1x NVIDIA H200", commit="ffff",
             figures={"tpot_ms": 1.09}),
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")


@pytest.mark.slow
def test_report_tables_the_latest_record_per_workload_and_plots_them(tmp_path):
    results = tmp_path / "docs" / "benchmarks" / "results.jsonl"
    results.parent.mkdir(parents=True)
    _write_records(results)
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nWritten by hand, kept.\n")
    out = nanopipe("bench", "report", cwd=tmp_path).stdout
    assert "4 row(s) from 5 record(s), 2 unreadable line(s) skipped" in out
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by hand, kept.\n")
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == 4
    # A peer adds a ratio to the same measurement: one row; another --max-model-len is a
    # variant of its own, and the later record of one variant hides nothing of another's.
    assert rows[0].startswith(
        "| [throughput --make-random qwen3-0.6b](benchmarks/throughput-make-random-qwen3-0.6b"
        ".png) | output_tok_s | 25,000 | 0.700 | 1.500x | 1x NVIDIA H200 | bbbb | 2026-12-03 |")
    assert rows[1].startswith("| [latency --make-random qwen3-0.6b](benchmarks/latency-make-"
                              "random-qwen3-0.6b.png) | tpot_ms | 1.05 | 0.400 | - |")
    assert rows[2].startswith("| [returning](benchmarks/returning.png) | prefill_tokens | 123 |")
    assert rows[3].startswith("| [latency --make-random qwen3-0.6b --max-model-len 131072]"
                              "(benchmarks/latency-make-random-qwen3-0.6b-max-model-len-131072"
                              ".png) | tpot_ms | 1.09 |")
    for row in rows:
        png = row.split("](benchmarks/", 1)[1].split(")", 1)[0]
        assert (results.parent / png).read_bytes().startswith(PNG_MAGIC)
    # Run again after one more record: the table is replaced, not appended.
    with results.open("a") as f:
        f.write(json.dumps(dict(workload="latency", command="c", date="2026-12-04T00:00:00Z",
                                hardware="h", commit="eeee", figures={"tpot_ms": 1.0})) + "\n")
    nanopipe("bench", "report", "--no-plots", cwd=tmp_path)
    again = doc.read_text()
    assert again.count("nanopipe bench report: begin") == 1
    assert "| latency | tpot_ms | 1 | - | - | h | eeee | 2026-12-04 | `c` |" in again


@pytest.mark.slow
def test_report_reads_what_a_run_recorded(tiny_qwen3_dir, tmp_path):
    """The record a workload appends is one the report reads back (the same format)."""
    rec = tmp_path / "results.jsonl"
    nanopipe("bench", "steploop", "--steps", "20", "--repeats", "1", "--record", str(rec))
    records, skipped = read(rec)
    assert skipped == 0 and [r.workload for r in records] == ["steploop"]
    nanopipe("bench", "report", "--results", str(rec), "--doc", str(tmp_path / "b.md"),
             "--no-plots")
    assert "| steploop --steps 20 --repeats 1 | us_per_step@1 |" in (tmp_path / "b.md").read_text()


@pytest.mark.slow
def test_report_runs_without_torch(tmp_path):
    """The report is plain data work: it loads neither torch nor a workload module."""
    results = tmp_path / "results.jsonl"
    _write_records(results)
    code = ("import sys\n"
            "from frontend.bench.cli import run_command\n"
            f"assert run_command('bench', ['report', '--results', {str(results)!r}, '--doc', "
            f"{str(tmp_path / 'b.md')!r}, '--no-plots']) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "'frontend.bench.workloads')))")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_report_without_records_says_how_to_make_them(tmp_path):
    done = nanopipe("bench", "report", "--results", str(tmp_path / "none.jsonl"), ok=False)
    assert done.returncode == 2
    assert f"no records at {tmp_path / 'none.jsonl'} (a benchmark run with --record" in done.stderr
