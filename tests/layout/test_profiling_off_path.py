"""The runtime loads no profiling code unless a profiling setting asks for it.

Profiling lives in packages of its own (protocol.profiling: the host timeline;
gpu_workers.profiling: the workers' window and its summaries; frontend.bench: the `nanopipe
profile` views), and the runtime reads the settings in protocol.profile_settings, which holds
none of it. A fresh interpreter imports every actor's entry module and the LLM class, asks the
runtime's two switches what to serve with under an empty environment, and must find none of
those packages loaded; then, with the settings given, it must find them (so the check sees
what it looks for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_MODULES = (
    "gpu_workers.worker_proc",
    "gpu_workers.model_runner",
    "scheduler_proc.scheduler_loop",
    "frontend.actors.tokenizer",
    "frontend.actors.detokenizer",
    "frontend.actors.stdout_detokenizer",
    "frontend.engine.llm",
    "frontend.engine.cli",
    "frontend.openai_server.server",
)
PROFILING = ("protocol.profiling", "gpu_workers.profiling", "frontend.bench")

PROBE = """
import json, sys
for name in {modules!r}:
    __import__(name)
from frontend import LLM  # noqa: F401
from gpu_workers.worker_proc import served_by
from protocol.profile_settings import NO_TIMELINE, host_timeline

def loaded():
    return sorted(m for m in sys.modules
                  if any(m == p or m.startswith(p + ".") for p in {profiling!r}))

runner = object()
assert served_by(runner, {{}}) is runner
assert host_timeline("scheduler", 0, {{}}) is NO_TIMELINE
off = loaded()
out = sys.argv[1]
served = served_by(runner, {{"NANOPIPE_PROFILE_DIR": out}})
timeline = host_timeline("worker", 1, {{"NANOPIPE_HOST_TIMELINE": out}})
assert served is not runner and served.runner is runner and timeline is not NO_TIMELINE
print(json.dumps({{"off": off, "on": loaded()}}))
"""


def test_the_runtime_imports_profiling_only_when_asked(tmp_path):
    code = PROBE.format(modules=ENTRY_MODULES, profiling=PROFILING)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOPIPE_")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=180, env=dict(env, PYTHONPATH=path))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["off"] == [], f"loaded without any profiling setting: {found['off']}"
    assert {"protocol.profiling.host_timeline",
            "gpu_workers.profiling.step_profiler"} <= set(found["on"])
