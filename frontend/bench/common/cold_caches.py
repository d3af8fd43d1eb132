"""Empty caches for one measured start-up: the compile caches and nanopipe's own, pointed at
fresh directories in the measured server's environment only.

The engine never moves these caches (tests/layout/test_compile_caches.py); this module is the
one place that does, for `nanopipe bench startup`'s cold runs, and it never reads, clears or
writes the user's own.
"""

from __future__ import annotations

from pathlib import Path

CACHE_SETTINGS = {
    "TRITON_CACHE_DIR": "triton",         # Triton's compiled kernels (~/.triton/cache)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # torch.compile's, should anything use it
    "NANOPIPE_CACHE": "nanopipe",         # the embedded model's conversion, tokenizers
}
"""Each cache's environment variable, and the folder a fresh set of them uses for it."""


def empty_caches(root: Path) -> dict[str, str]:
    """The environment entries that point every cache at a new empty folder under `root`."""
    env = {}
    for name, folder in CACHE_SETTINGS.items():
        path = root / folder
        path.mkdir(parents=True, exist_ok=False)
        env[name] = str(path)
    return env
