"""The README stays short, and what it shows works: every command it shows exists, every flag
it names is accepted by the command that takes it, and every relative link resolves.

Commands are read from its shell blocks (indented or fenced, not ```python or ```text) and
inline code.
Each distinct command's `--help` is run once, as a user would run it; a flag shown in a
command must be in that command's help, and a flag named in prose in the help of one of the
commands the README shows.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 300
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"^scripts/[\w./-]+\.(py|sh)$")
SUBCOMMAND = re.compile(r"^[a-z][a-z0-9_-]*$")
FOREIGN = {"pip", "curl", "bash", "git", "cd", "export"}
"""Programs the README may show whose flags are not ours to check."""


def _console_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project.get("scripts", {}))


def _shell_lines(text: str) -> list[str]:
    """Lines of indented and fenced blocks (not python or text ones), joined at `\\`."""
    lines, fence = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else (line[3:].strip() or "text")
        elif fence is not None:
            if fence not in ("python", "text"):  # text: what a command prints
                lines.append(line.strip())
        elif line.startswith("    "):
            lines.append(line.strip())
    joined, cur = [], ""
    for line in lines:
        if line.endswith("\\"):
            cur += line[:-1] + " "
        else:
            joined.append(cur + line)
            cur = ""
    return joined


def _prose(text: str) -> str:
    """The README outside its code blocks."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and not line.startswith("    "):
            out.append(line)
    return "\n".join(out)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _split(line: str) -> list[list[str]]:
    """One shell line as commands (split at && and ;), comments dropped, [optional] unwrapped."""
    line = line.split(" #", 1)[0]
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    commands, cur = [], []
    for w in words:
        if w in ("&&", ";", "|"):
            commands.append(cur)
            cur = []
        else:
            cur.append(w.strip("[]"))
    commands.append(cur)
    return [c for c in commands if c and c[0]]


def _program(words: list[str]) -> tuple[str, ...] | None:
    """The words that name the program (with its subcommands), or None when not ours."""
    first = words[0]
    scripts = _console_scripts()
    if first in scripts:
        subs = []
        for w in words[1:]:
            if not SUBCOMMAND.match(w):
                break
            subs.append(w)
        return (first, *subs)
    if SCRIPT.match(first):
        return (first,)
    if first in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return ("python", "-m", words[2])
        if SCRIPT.match(words[1]):
            return ("python", words[1])
    return None


def _commands(text: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """(program, its words) for every command of ours the README shows."""
    found = []
    for line in _shell_lines(text) + _inline_code(text):
        for words in _split(line):
            program = _program(words)
            if program is not None:
                found.append((program, words))
    return found


@functools.cache
def _help(program: tuple[str, ...]) -> str:
    """The program's --help output, run from the repository root; fails the test if it fails."""
    scripts = _console_scripts()
    if program[0] in scripts:
        module, func = scripts[program[0]].split(":")
        code = (f"import sys; sys.argv = {[program[0]]!r} + sys.argv[1:]; "
                f"from {module} import {func}; sys.exit({func}())")
        argv = [sys.executable, "-c", code, *program[1:], "--help"]
    elif program[0].startswith("scripts/") and program[0].endswith(".sh"):
        argv = ["bash", program[0], "--help"]
    elif program[:2] == ("python", "-m"):
        argv = [sys.executable, "-m", program[2], "--help"]
    else:
        argv = [sys.executable, program[-1], "--help"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"`{' '.join(program)} --help` failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


def _flags_of(program: tuple[str, ...]) -> set[str]:
    return set(FLAG.findall(_help(program)))


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES})"


def test_readme_shows_the_essentials():
    text = README.read_text()
    for needed in ('python -m pytest -m "not gpu and not slow"', "nanopipe serve",
                   "scripts/launch.sh --tp 2", "Client", "/v1/chat/completions",
                   "llm.generate", "stdout_detokenizer", "/metrics", "nanopipe-top"):
        assert needed in text, f"README.md no longer shows {needed!r}"


def test_every_command_shown_exists():
    commands = _commands(README.read_text())
    assert len(commands) >= 5, "the README's commands were not found: the parser is broken"
    for program, _ in commands:
        if program[0].startswith("scripts/") or (program[0] == "python"
                                                 and program[1].startswith("scripts/")):
            path = ROOT / program[-1]
            assert path.is_file(), f"README shows {program[-1]}, which does not exist"
        _help(program)


def test_every_flag_in_a_command_is_accepted():
    bad = []
    for program, words in _commands(README.read_text()):
        known = _flags_of(program)
        for word in words[1:]:
            flag = word.split("=", 1)[0]
            if FLAG.fullmatch(flag) and flag not in known:
                bad.append(f"{' '.join(program)} {flag}")
    assert not bad, f"README shows flags their command does not accept: {sorted(set(bad))}"


def test_every_flag_in_prose_is_accepted_by_a_command_shown():
    text = README.read_text()
    known = set().union(*(_flags_of(p) for p, _ in _commands(text)))
    foreign = set()
    for line in _shell_lines(text) + _inline_code(text):
        for words in _split(line):
            if words[0] in FOREIGN:
                foreign.update(FLAG.findall(" ".join(words)))
    ours = set(FLAG.findall(_prose(text))) - foreign
    unknown = sorted(ours - known)
    assert not unknown, f"README names flags no command it shows accepts: {unknown}"


@pytest.mark.parametrize("page", ["README.md", "docs/README.md"])
def test_every_relative_link_resolves(page):
    path = ROOT / page
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"{page} links to paths that do not exist: {missing}"
