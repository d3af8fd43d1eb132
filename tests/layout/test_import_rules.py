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
        allowed = ALLOWED[package] | (OURS if rel in STARTERS else set())
        if ours - allowed:
            problems.append(f"{rel} imports {sorted(ours - allowed)}")
        banned = imported & FORBIDDEN_THIRD_PARTY.get(package, set())
        if banned:
            problems.append(f"{rel} imports {sorted(banned)}")
    assert not problems, "\n".join(problems)


def test_no_pickle_on_any_wire():
    for package in OURS:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert "pickle.loads" not in text and "recv_pyobj" not in text, path
