"""The engine reads no NANOPIPE_* environment variable except its documented settings.

A switch read from the environment changes what the engine runs without showing up in any
config, flag or record, so an A/B comparison belongs in a config field or a bench flag. The
settings allowed here are the user's: where the embedded model is cached, and the profiling
outputs (a directory to write to, which no config of a process carries). Each must be
described under docs/.

The scan takes every string literal of the library packages that is a whole NANOPIPE_ name
(an environment variable's name is written once, as such a constant, then read through it),
leaving out attribute names: those a module exports (`__all__`) and those given to getattr,
hasattr or setattr (kernels/ marks itself with a NANOPIPE_KERNELS attribute).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("frontend", "scheduler_proc", "gpu_workers", "kernels", "protocol")
NAME = re.compile(r"NANOPIPE_[A-Z0-9_]+")
ALLOWED = {
    "NANOPIPE_CACHE": "nanopipe's cache directory (the embedded model, detokenizer tokenizers)",
    "NANOPIPE_HOST_TIMELINE": "the host timeline's directory (profiling)",
    "NANOPIPE_PROFILE_DIR": "the workers' profiling window's directory (profiling)",
    "NANOPIPE_PROFILE_STEPS": "the plans the profiling window covers",
    "NANOPIPE_PROFILE_TRACE": "whether the profiling window writes a Chrome trace",
}


ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr"}


def _attribute_names(tree: ast.Module) -> set[int]:
    """ids of the string nodes that name attributes, not environment variables."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            ids.update(id(n) for n in ast.walk(node.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTRIBUTE_CALLS and len(node.args) > 1):
            ids.add(id(node.args[1]))
    return ids


def env_names() -> dict[str, list[str]]:
    """Every NANOPIPE_ name written as a string in the library, with where it is."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            attributes = _attribute_names(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and NAME.fullmatch(node.value) and id(node) not in attributes):
                    found.setdefault(node.value, []).append(f"{rel}:{node.lineno}")
    return found


def test_the_library_reads_only_documented_settings():
    unknown = {name: where for name, where in env_names().items() if name not in ALLOWED}
    assert not unknown, (
        "environment variables the engine may not read (make them a config field or a bench "
        f"flag, or document them and add them to ALLOWED): {unknown}")


def test_the_scan_sees_the_settings_it_allows():
    """Each allowed setting is still read somewhere: a stale entry would hide nothing, but
    the scan finding them all shows it finds names where the library keeps them."""
    assert set(env_names()) == set(ALLOWED)


def test_every_allowed_setting_is_documented():
    docs = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    missing = sorted(name for name in ALLOWED if name not in docs)
    assert not missing, f"settings not described under docs/: {missing}"
