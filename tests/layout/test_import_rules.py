"""The import rules of the architecture: who may import whom.

protocol imports nothing of ours; scheduler_proc imports protocol only (and never torch);
gpu_workers imports protocol and kernels; kernels imports torch and triton only; frontend
imports protocol and may import the other actors only to start them (the launcher, and the
config that builds their configs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"protocol", "scheduler_proc", "gpu_workers", "kernels", "frontend"}
ALLOWED = {
    "protocol": set(),
    "scheduler_proc": {"protocol"},
    "gpu_workers": {"protocol", "kernels"},
    "kernels": set(),
    "frontend": {"protocol"},
}
# Modules of the frontend that start or configure the other actors.
STARTERS = {
    "frontend/engine/pipeline.py", "frontend/engine/config.py", "frontend/engine/preflight.py",
}
# The benchmark tool measures every actor, some in this process (the runtime without its
# processes); nothing on the serving path imports it.
MEASURES_ALL = "frontend/bench/"
FORBIDDEN_THIRD_PARTY = {"scheduler_proc": {"torch", "triton"}, "protocol": {"torch", "triton"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(OURS))
def test_packages_import_only_what_the_architecture_allows(package):
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        imported = _imports(path)
        ours = (imported & OURS) - {package}
        starts = rel in STARTERS or rel.startswith(MEASURES_ALL)
        allowed = ALLOWED[package] | (OURS if starts else set())
        if ours - allowed:
            problems.append(f"{rel} imports {sorted(ours - allowed)}")
        banned = imported & FORBIDDEN_THIRD_PARTY.get(package, set())
        if banned:
            problems.append(f"{rel} imports {sorted(banned)}")
    assert not problems, "\n".join(problems)


def test_nothing_outside_the_bench_tool_imports_it():
    """The serving path never loads the benchmark tool; the CLI hands off to it lazily."""
    problems = []
    for package in sorted(OURS):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(MEASURES_ALL):
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            for node in tree.body:  # module level only: a lazy import inside a function is fine
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "frontend.bench"):
                    problems.append(rel)
                if isinstance(node, ast.Import) and any(
                        a.name.startswith("frontend.bench") for a in node.names):
                    problems.append(rel)
    assert not problems, f"imports the benchmark tool at module level: {problems}"


def test_no_pickle_on_any_wire():
    for package in OURS:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert "pickle.loads" not in text and "recv_pyobj" not in text, path

