"""Which package `import kernels` finds: nanopipe's, beside this one, or another of that name.

A PyPI distribution is also named `kernels` (transformers can pull it in); if it won the
import, every op would be missing or, worse, a different function. The check finds the
package without importing it (importing ours imports torch and Triton).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OURS = Path(__file__).resolve().parents[1] / "kernels"


def refuse_foreign_kernels() -> None:
    """Raise ImportError when `import kernels` would not import nanopipe's kernels."""
    loaded = sys.modules.get("kernels")
    if loaded is not None:
        if getattr(loaded, "NANOPIPE_KERNELS", False):
            return
        where = getattr(loaded, "__file__", None) or list(getattr(loaded, "__path__", []))
    else:
        spec = importlib.util.find_spec("kernels")
        places = [] if spec is None else list(spec.submodule_search_locations or [])
        if any(Path(p).resolve() == OURS for p in places):
            return
        where = places or (spec.origin if spec is not None else "nothing")
    raise ImportError(
        f"'import kernels' found {where}, not nanopipe's kernels package: another package "
        "named 'kernels' shadows it. Uninstall it (pip uninstall kernels) or put nanopipe's "
        "directory first on sys.path.")
