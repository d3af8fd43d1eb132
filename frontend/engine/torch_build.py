"""Whether a GPU can be visible, answered without importing torch where its build says so.

Importing torch takes the launcher one to two seconds, before the first process can start.
A build of torch for CPUs only (torch/version.py names neither a CUDA nor a ROCm version)
never sees a GPU, so on such a build `--device` auto is cpu at once; any other build asks
torch itself.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def built_for_gpus() -> bool:
    """False when the installed torch's version.py says it was built for CPUs only; True
    otherwise, also when that file cannot be read (then torch decides)."""
    spec = importlib.util.find_spec("torch")
    folders = [] if spec is None else list(spec.submodule_search_locations or [])
    try:
        tree = ast.parse((Path(folders[0]) / "version.py").read_text())
    except (IndexError, OSError, SyntaxError, ValueError):
        return True
    versions: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                    versions[target.id] = node.value.value
    if "cuda" not in versions or "hip" not in versions:
        return True
    return versions["cuda"] is not None or versions["hip"] is not None


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a CPU-only build."""
    if not built_for_gpus():
        return False
    import torch

    return torch.cuda.is_available()
