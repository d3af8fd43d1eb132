"""scripts/ keeps the few plain scripts a user runs by path (launch, quick start, model
builders, the GPU parity check); benchmarks live in `nanopipe bench`. No script imports
another script or anything under tests/, and none edits sys.path. Then the shared pieces as a
user meets them: the W1 workload is the documented one, and the parity check runs on a tiny
CPU model.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _edits_sys_path(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"
               for node in ast.walk(tree))


def test_scripts_import_neither_tests_nor_each_other():
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    script_modules = {p.stem for p in SCRIPTS.glob("*.py")}
    problems = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        imported = _imported(tree)
        if imported & test_modules:
            problems.append(f"{rel} imports from tests/: {sorted(imported & test_modules)}")
        if imported & script_modules:
            problems.append(f"{rel} imports a script: {sorted(imported & script_modules)}")
        if _edits_sys_path(tree):
            problems.append(f"{rel} touches sys.path")
    assert not problems, "\n".join(problems)


KEPT = {"launch.sh", "quickstart.py", "make_tiny_model.py", "convert_smollm2.py",
        "truncate_model.py", "check_gpu_parity.py", "figures"}


def test_scripts_holds_only_the_kept_scripts():
    assert {p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__"} <= KEPT


def test_w1_is_the_documented_workload():
    """docs/benchmarks.md: 256 sequences, 142,827 prompt tokens, 133,966 output tokens."""
    from frontend.bench.common import w1_workload

    work = w1_workload()
    assert len(work) == 256
    assert sum(len(p) for p, _ in work) == 142_827
    assert sum(m for _, m in work) == 133_966
    assert max(t for p, _ in work for t in p) <= 10_000
    folded = w1_workload(4, 128, 100, vocab_size=700)
    assert [m for _, m in folded] == [m for _, m in w1_workload(4, 128, 100)]
    assert all(0 <= t < 700 for p, _ in folded for t in p)


def _run_script(*args: str) -> str:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_check_gpu_parity_passes_in_float32_on_the_cpu(tiny_qwen3_dir):
    """The parity script's own engine path (the Scheduler driving a ModelRunner) agrees with
    transformers token for token in float32."""
    out = _run_script("scripts/check_gpu_parity.py", "--model", tiny_qwen3_dir, "--device",
                      "cpu", "--dtype", "float32", "--num-prompts", "3", "--max-tokens", "6",
                      "--prompt-len-range", "4", "40", "--kv-cache-bytes", str(4 << 20))
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["passed"] and summary["match_fraction"] == 1.0
    assert summary["num_prompts"] == 3 and summary["logits_within_tolerance"]
    assert "RESULT: PASS" in out


def test_every_script_imports_as_it_runs():
    """Each script's module loads with scripts/ first on sys.path, as `python scripts/x.py`
    puts it (every script keeps its work behind a main guard)."""
    names = sorted(p.stem for p in SCRIPTS.glob("*.py"))
    code = f"import sys; sys.path.insert(0, {str(SCRIPTS)!r})\n" + "\n".join(
        f"import {name}" for name in names) + "\nprint('ok')"
    assert _run_script("-c", code).strip().endswith("ok")
