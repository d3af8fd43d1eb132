"""The layout docs/README.md describes is the tree's, and library files stay small.

A file over MAX_LINES must be named in LONGER_FILES with the reason it is one piece.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "scheduler_proc", "gpu_workers", "kernels", "frontend")
MAX_LINES = 350
LONGER_FILES: dict[str, str] = {
    "frontend/engine/config.py": "EngineConfig is one dataclass: every engine option, each a "
    "described field, with its resolution and the per-process configs derived from it",
}


def _readme_folders() -> set[str]:
    section = (ROOT / "docs/README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    return {m.group(1).rstrip("/") for m in re.finditer(r"^\| `([\w/]+)/` \|", section, re.M)}


def _library_folders() -> set[str]:
    """Every folder that holds library modules (more than an __init__.py)."""
    folders = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                folders.add(path.parent.relative_to(ROOT).as_posix())
    return folders


def test_every_readme_folder_exists():
    missing = [f for f in _readme_folders() if not (ROOT / f).is_dir()]
    assert not missing, f"docs/README.md layout names folders that do not exist: {missing}"


def test_every_library_folder_has_a_readme_row():
    rows = _readme_folders()
    unlisted = sorted(f for f in _library_folders() if f not in rows)
    assert not unlisted, f"docs/README.md layout has no row for: {unlisted}"


def test_library_files_stay_small_or_say_why():
    long = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            rel = path.relative_to(ROOT).as_posix()
            if lines > MAX_LINES and rel not in LONGER_FILES:
                long[rel] = lines
    assert not long, f"over {MAX_LINES} lines without a stated reason: {long}"
    stale = [f for f in LONGER_FILES if not (ROOT / f).is_file()]
    assert not stale, f"LONGER_FILES names files that are gone: {stale}"
