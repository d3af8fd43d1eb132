"""The host timeline (protocol.profiling.host_timeline): a pipeline started with
NANOPIPE_HOST_TIMELINE in its environment leaves the scheduler's and each worker's stamps, in
the order a step passes them, and `nanopipe profile timeline` lines them up; without the
variable nothing is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from protocol import SamplingParams
from protocol.profile_settings import HOST_TIMELINE_ENV as ENV
from protocol.profile_settings import NO_TIMELINE, host_timeline
from protocol.profiling.host_timeline import HostTimeline

pytestmark = pytest.mark.slow  # profiles whole engines

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 12


def _stamps(path: Path) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for step, event, ns in json.loads(path.read_text())["events"]:
        out.setdefault(event, {})[step] = ns
    return out


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_pipeline_writes_every_step_in_order(tiny_qwen3_dir, tmp_path, monkeypatch,
                                               lookahead):
    out = tmp_path / "timeline"
    monkeypatch.setenv(ENV, str(out))  # the actor processes inherit it
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(**tiny_engine(tiny_qwen3_dir, tensor_parallel_size=2,
                           worker_lookahead=lookahead)) as llm:
        outputs = llm.generate(["one", "two three"], params, use_tqdm=False)
    assert all(len(o["token_ids"]) == TOKENS for o in outputs)
    assert sorted(p.name for p in out.iterdir()) == ["scheduler0.json", "worker0.json",
                                                     "worker1.json"]
    sched = _stamps(out / "scheduler0.json")
    plans = sorted(sched["plan_out"])
    assert len(plans) >= TOKENS  # a prefill and a step per further token, at least
    for rank in (0, 1):
        worker = _stamps(out / f"worker{rank}.json")
        for k in plans:  # every plan reached every rank, and was launched after it came
            assert sched["plan_out"][k] <= worker["plan_in"][k] <= worker["launched"][k]
            assert worker["launched"][k] <= worker["finish"][k]
    worker0 = _stamps(out / "worker0.json")
    assert "result_out" not in _stamps(out / "worker1.json")  # rank 0 alone reports
    for k in plans:  # each result went from rank 0 to the scheduler, then was applied
        assert worker0["result_out"][k] <= sched["result_in"][k] <= sched["result_done"][k]

    done = _nanopipe("profile", "timeline", str(out), "--skip", "0",
                     "--json", str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "t.json").read_text())
    for name in ("plan hop", "launch", "tokens", "result hop", "apply", "next plan", "period"):
        assert figures[name]["n"] >= TOKENS - 2, (name, figures[name])
        assert figures[name]["median_us"] >= 0
        assert name in done.stdout
    assert figures["plan late"]["of"] >= TOKENS - 2


def test_off_unless_asked(tmp_path):
    assert host_timeline("worker", 1, environ={}) is NO_TIMELINE
    NO_TIMELINE.mark(1, "plan_in")
    NO_TIMELINE.write()
    timeline = host_timeline("worker", 1, environ={ENV: str(tmp_path / "new")})
    timeline.mark(7, "plan_in")
    timeline.write()  # makes the directory
    data = json.loads((tmp_path / "new" / "worker1.json").read_text())
    assert data["actor"] == "worker1" and [e[:2] for e in data["events"]] == [[7, "plan_in"]]


def test_a_directory_it_cannot_write_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    timeline = HostTimeline(blocker / "scheduler0.json")  # its parent is a file
    timeline.mark(0, "plan_out")
    timeline.write()
    assert "could not write" in caplog.text


def test_the_profile_says_what_is_missing(tmp_path):
    done = _nanopipe("profile", "timeline", str(tmp_path))
    assert done.returncode != 0 and "NANOPIPE_HOST_TIMELINE" in done.stderr


def _nanopipe(*args: str) -> subprocess.CompletedProcess:
    """`nanopipe ARGS` from this checkout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", "import sys; from frontend.engine.cli import "
                           "main; sys.exit(main())", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path))
