"""What a test needs to know about processes: alive (zombies count as gone) and descendants."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(entry)[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def run_dir_of(pid: int) -> str | None:
    """The run directory the launcher's control socket is bound in, once it is."""
    import psutil

    try:
        paths = [c.laddr for c in psutil.Process(pid).net_connections("unix")]
    except psutil.Error:
        return None
    return next((os.path.dirname(p) for p in paths if p and "/nanopipe-" in p), None)
