"""The profiling forward's memory figures, kept in nanopipe's cache so that a later start with
the same model shape, limits, GPU and code sizes its KV pool without running that forward.

On CUDA the KV pool gets what is left once the largest step the scheduler may send has run
(gpu_workers.warm_up.measure_peak_memory). That forward is the first of the process: it pays
every kernel's first launch, cuBLAS's set-up and the allocator's growth, seconds on every
start, for two numbers that only change with what the key below holds. An entry is used
only when its key matches and its figures are plausible (a corrupt, foreign or absurd entry
is measured again, never trusted into an out-of-memory), and it is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_workers.config import ModelConfig, WorkerConfig

log = logging.getLogger("nanopipe.worker")

CACHE_ENV = "NANOPIPE_CACHE"
FOLDER = "peak-memory"
FORMAT = 1
_CODE_PACKAGES = ("gpu_workers", "kernels")
"""The code whose changes may change a forward's memory: its source is part of the key."""
OVERHEAD_CEILING = 4 << 30
"""More than the first forward leaves in use (cuBLAS workspaces and kernel code are some
hundreds of MiB): a larger figure is another process's allocation seen through the
device-wide free memory while it ran, not this forward's, and is never stored or trusted."""
_RUN_SPECIFIC = frozenset({"model", "draft_model", "dist_init_method", "seed",
                           "gpu_memory_utilization", "kv_cache_bytes", "gpu_share",
                           "kv_offloading_size", "kv_pool_mappable", "precompile_kernels"})
"""WorkerConfig fields that change where a run is or how much of the GPU it may take, not
what its forward allocates (the model's shape is keyed from ModelConfig instead of its path)."""


@dataclass(frozen=True, slots=True)
class PeakMemory:
    """What the profiling forward found, in bytes."""

    transient: int
    """The step's peak allocation beyond what stays allocated after it."""
    overhead: int
    """Device memory the first forward left in use outside torch's live tensors as of before
    it (cuBLAS workspaces, kernel code, the allocator's kept segments)."""


def cache_root(environ: os._Environ | dict[str, str] = os.environ) -> Path:
    """nanopipe's per-user cache, as frontend.embedded_model.cache names it: `$NANOPIPE_CACHE`,
    else `~/.cache/nanopipe`."""
    root = environ.get(CACHE_ENV) or Path.home() / ".cache" / "nanopipe"
    return Path(root).expanduser()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of the workers' and kernels' Python source: a change there may change what a
    forward allocates, so it misses every entry made before it."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key_parts(config: WorkerConfig, model: ModelConfig, rank: int, world_size: int,
              device: dict[str, Any]) -> dict[str, Any]:
    """Everything the profiling forward's figures depend on: the model's shape and dtypes,
    the step limits, the parallel layout, the GPU and the software that runs the forward."""
    worker = {f.name: getattr(config, f.name) for f in fields(config)
              if f.name not in _RUN_SPECIFIC}
    return {"format": FORMAT, "model": {k: str(v) for k, v in asdict(model).items()},
            "worker": worker, "rank": rank, "world_size": world_size, "device": device,
            "code": code_digest()}


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def entry_path(key: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / FOLDER / f"{key[:32]}.json"


def floor_bytes(config: WorkerConfig, model: ModelConfig, element_size: int) -> int:
    """Less than the profiling forward allocates: its hidden states, in and out, of as many
    tokens as it runs (max_num_seqs sequences of at most max_model_len tokens may hold fewer
    than max_num_batched_tokens). An entry below it is not this configuration's."""
    seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    tokens = min(config.max_num_batched_tokens, seqs * config.max_model_len)
    return 2 * tokens * model.hidden_size * element_size


def load(path: Path, key: str, floor: int, total: int) -> PeakMemory | None:
    """The entry at `path` if it is this key's and plausible (at least `floor` transient
    bytes, less than the device's `total` in all); None otherwise, with why at debug level."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.debug("peak memory cache: unreadable %s: %s", path, exc)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or entry.get("format") != FORMAT:
        log.debug("peak memory cache: %s is another configuration's", path)
        return None
    transient, overhead = entry.get("transient"), entry.get("overhead")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (transient, overhead)):
        log.debug("peak memory cache: %s holds no byte counts", path)
        return None
    if transient < floor or transient + overhead >= total or overhead > OVERHEAD_CEILING:
        log.debug("peak memory cache: %s is implausible (%d, %d)", path, transient, overhead)
        return None
    return PeakMemory(transient, overhead)


def store(path: Path, key: str, peak: PeakMemory, parts: dict[str, Any]) -> None:
    """Write the entry atomically (a reader sees the old file or the whole new one); a cache
    that cannot be written only costs the next start its profiling forward. An overhead
    above OVERHEAD_CEILING is not written: the next start measures again."""
    if peak.overhead > OVERHEAD_CEILING:
        log.debug("peak memory cache: not storing an overhead of %d bytes", peak.overhead)
        return
    entry = {"format": FORMAT, "key": key, "transient": peak.transient,
             "overhead": peak.overhead, "parts": parts}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, sort_keys=True, default=str)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("peak memory cache: could not write %s: %s", path, exc)


def kv_budget(config: WorkerConfig, free: int, total: int, reserved: int,
              peak: PeakMemory) -> float:
    """Bytes the KV pool may take. `free`, `total` (mem_get_info) and `reserved` (torch's
    reserved memory) are read after the profiling forward when it ran, before it when its
    figures come from the cache: `peak.overhead` is then the memory it would have added."""
    used = total - free + peak.overhead
    budget = total * config.gpu_memory_utilization - used - peak.transient
    if config.gpu_share:  # the others' memory is theirs: count our own, within what is free
        own = reserved + peak.overhead
        budget = min(total * config.gpu_memory_utilization - own - peak.transient,
                     (free - peak.overhead) * 0.95)
    if config.kv_cache_bytes is not None:  # a cap: a small pool on a large GPU (tests, sharing)
        budget = min(budget, config.kv_cache_bytes)
    return max(0.0, budget)
