"""`nanopipe bench startup` as a user runs it: the ready line read back into its phases, and
real start-ups of `nanopipe serve` on the CPU, cold and warm, recorded; the user's own cache
is left alone, and no server process outlives the bench."""

from __future__ import annotations

import json
import os

import pytest

from frontend.bench.cli import run_command
from frontend.bench.common.serve_process import process_tree
from frontend.bench.figures import Figure
from frontend.engine.startup_times import StartupTimes, parse_ready_line
from protocol.startup_phases import StartupPhase

PHASES = ("checks", "processes", "weights", "kv", "warm-up", "graphs", "frontend")


def test_the_ready_line_reads_back_into_its_phases():
    times = StartupTimes(12.34, tuple(StartupPhase(n, s) for n, s in zip(
        PHASES, (0.21, 1.44, 0.6, 3.05, 4.0, 2.9, 0.14))), ())
    stderr = f"nanopipe: loading\nnanopipe: {times.line()}\nnanopipe ready: tiny\n"
    parsed = parse_ready_line(stderr)
    assert parsed is not None and parsed.total_s == 12.3
    assert [p.name for p in parsed.phases] == list(PHASES)
    assert [p.seconds for p in parsed.phases] == [0.2, 1.4, 0.6, 3.0, 4.0, 2.9, 0.1]
    assert parsed.phase("warm-up") == 4.0 and parsed.line() == times.line()
    assert parse_ready_line("nanopipe: ready in 2.5 s (checks x)") is None
    assert parse_ready_line("nanopipe ready: tiny on cpu") is None


def test_a_goal_prints_as_the_goal_and_records_as_the_bound():
    fig = Figure("ready_s[warm]", 2.0, "s", bound=5.0, higher_is_better=False,
                 bound_name="the goal")
    assert fig.line() == "ready_s[warm]: 2 s  [2.5 of the goal (5 s)]"
    assert fig.record() == {"ready_s[warm]": 2.0, "ready_s[warm]/bound": 2.5}


@pytest.mark.parametrize("flags, says", [
    (["--cold", "0", "--warm", "0"], "one of them >= 1"),
    (["--serve-args=--port 9"], "sets --port"),
])
def test_bad_flags_are_one_line_usage_errors(flags, says, tiny_qwen3_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        run_command("bench", ["startup", "--model", tiny_qwen3_dir, "--device", "cpu", *flags])
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.fixture
def left_behind():
    """This process's live descendants the test started: the servers and their actors must
    all be gone (processes of fixtures that other test files keep alive do not count)."""
    before = {p.pid for p in process_tree(os.getpid())}
    return lambda: [p for p in process_tree(os.getpid()) if p.pid not in before]


@pytest.mark.slow  # three start-ups of a server
def test_cold_and_warm_start_ups_are_recorded_by_phase(tiny_qwen3_dir, tmp_path, monkeypatch,
                                                       capsys, left_behind):
    own_cache = tmp_path / "own-cache"
    own_cache.mkdir()
    monkeypatch.setenv("NANOPIPE_CACHE", str(own_cache))
    record = tmp_path / "results.jsonl"
    assert run_command("bench", ["startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                                 "--cold", "1", "--warm", "1", "--record", str(record)]) == 0
    out = capsys.readouterr().out
    assert "cold: healthy in" in out and "warm: healthy in" in out
    assert "ready_s[warm]: " in out and "of the goal (5 s)" in out
    assert not left_behind()
    assert not any(own_cache.iterdir())  # cold caches are the bench's; warm reuse them
    raw = json.loads(record.read_text())
    assert raw["workload"] == "startup"
    figures = raw["figures"]
    for kind in ("cold", "warm"):
        ready, engine = figures[f"ready_s[{kind}]"], figures[f"engine_ready_s[{kind}]"]
        phases = [figures[f"phase_s[{kind} {p}]"] for p in PHASES]
        # The line keeps one decimal: seven phases round to within 0.35 s of its total.
        assert abs(sum(phases) - engine) <= 0.4, (kind, phases, engine)
        assert 0 < engine <= ready + 0.05 and figures[f"first_answer_ms[{kind}]"] > 0
        assert figures[f"phase_s[{kind} processes]"] > 0
    assert figures["ready_s[warm]/bound"] == pytest.approx(5.0 / figures["ready_s[warm]"],
                                                           rel=1e-3)

    # With no cold run, the warm one is the user's own start-up, on the user's caches.
    assert run_command("bench", ["startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                                 "--cold", "0", "--warm", "1"]) == 0
    assert any(own_cache.iterdir()) and not left_behind()


def test_a_server_that_fails_to_start_fails_the_run_and_records_nothing(tiny_qwen3_dir,
                                                                       tmp_path, capsys,
                                                                       left_behind):
    record = tmp_path / "results.jsonl"
    assert run_command("bench", ["startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                                 "--warm", "1", "--serve-args=--max-num-seqs 0",
                                 "--record", str(record)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: cold start-up: the server exited" in err and "max-num-seqs" in err
    assert not record.exists() and not left_behind()
