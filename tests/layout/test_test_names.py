"""Test files have names unique across tests/: the suite runs without packages (rootdir
imports), so two files of one name in two folders stop collection of the whole tier."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts:
            by_name[path.name].append(path.relative_to(TESTS).as_posix())
    shared = {name: paths for name, paths in by_name.items()
              if len(paths) > 1 and name not in ("conftest.py", "__init__.py")}
    assert not shared, f"rename one of each: {shared}"
