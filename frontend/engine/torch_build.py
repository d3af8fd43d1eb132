"""Whether a GPU can be visible, and how many, answered without importing torch where the
build and the NVIDIA driver say so.

Importing torch (a CUDA build: two to three seconds) and asking it for the GPUs (the CUDA
driver's initialisation) made most of the launcher's time before its first process started;
the workers import torch and set CUDA up anyway. A build of torch for CPUs only
(torch/version.py names neither a CUDA nor a ROCm version) never sees a GPU. On a CUDA build
the driver lists its GPUs in /proc/driver/nvidia/gpus and makes a /dev/nvidiaN node for
each; where both agree, CUDA_VISIBLE_DEVICES picks from them as CUDA does. Anything else
(ROCm, UUIDs or MIG devices in CUDA_VISIBLE_DEVICES, a container that shows more GPUs in
one place than the other) asks torch itself.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path

_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
_DEV = Path("/dev")


def _build_versions() -> dict[str, object] | None:
    """torch/version.py's constants, or None when it cannot be read."""
    spec = importlib.util.find_spec("torch")
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    try:
        tree = ast.parse((Path(folders[0]) / "version.py").read_text())
    except (IndexError, OSError, SyntaxError, ValueError):
        return None
    versions: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                    versions[target.id] = node.value.value
    return versions


def built_for_gpus() -> bool:
    """False when the installed torch's version.py says it was built for CPUs only; True
    otherwise, also when that file cannot be read (then torch decides)."""
    versions = _build_versions()
    if versions is None or "cuda" not in versions or "hip" not in versions:
        return True
    return versions["cuda"] is not None or versions["hip"] is not None


def driver_visible_gpus(environ: Mapping[str, str] = os.environ, proc: Path = _PROC_GPUS,
                        dev: Path = _DEV) -> int | None:
    """The NVIDIA GPUs CUDA will show this process, from the driver's listing and
    CUDA_VISIBLE_DEVICES; None when that cannot be told for sure (torch must say)."""
    try:
        listed = sum(1 for _ in proc.iterdir())
        nodes = sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return None
    if listed == 0 or nodes != listed:
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    seen: set[int] = set()
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            return None
        if not entry.isdigit() or int(entry) >= listed:
            break  # CUDA ignores an invalid entry ("", "-1", out of range) and all after it
        if int(entry) in seen:
            return None
        seen.add(int(entry))
    return len(seen)


def _driver_count() -> int | None:
    versions = _build_versions() or {}
    return None if versions.get("cuda") is None else driver_visible_gpus()


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a CPU-only build or where the
    driver says how many GPUs are visible."""
    return gpu_count() > 0


def gpu_count() -> int:
    """torch.cuda.device_count() where CUDA is available (0 where it is not), without
    importing torch on a CPU-only build or where the driver says."""
    if not built_for_gpus():
        return 0
    if (count := _driver_count()) is not None:
        return count
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpus() -> list[str]:
    """The launcher's GPUs as CUDA_VISIBLE_DEVICES names them (all, without it: gpu_count,
    so the launcher imports no torch where the driver can say)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(gpu_count())]
