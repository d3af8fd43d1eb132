"""Compile a start-up's Triton kernels in parallel processes before its steps need them.

With an empty Triton cache, the first start of a model spends most of its time compiling:
each kernel variant (a kernel with its dtypes, constants and the divisibility of its integer
arguments) compiles the first time a step launches it, one after another on the worker's
thread. Compiling is CPU work that holds the GIL, so threads do not help, but the variants
are independent, so processes do.

The variants a start-up needs are found without compiling anything: `SpecRecorder` installs
Triton's `jit_cache_hook`, which Triton calls before compiling a variant it has not
compiled in this process, and answers "skip" after writing down the variant's
specialization (Triton's own serialized form, the one `JITFunction.preload` takes); the
kernel then neither compiles nor launches. gpu_workers.warm_up runs the start-up's scratch
steps that way inside a throwaway CUDA graph capture, so the device executes nothing and the
outputs the skipped kernels never wrote are never read. `precompile` then hands the
variants to a pool of processes, each calling `preload` with a driver that knows only the
GPU's target; the compiled kernels land in Triton's cache, where the steps that follow find
them as on a warm start.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

from protocol.parent_watch import die_with_parent

log = logging.getLogger("nanopipe.worker")
MAX_PROCESSES = 8


@dataclass(frozen=True)
class KernelSpec:
    """One kernel variant: the kernel's module and name, Triton's serialized
    specialization, and the GPU target it is compiled for."""

    module: str
    name: str
    specialization: str
    target: tuple[str, Any, int]
    """(backend, arch, warp size), as triton.backends.compiler.GPUTarget holds them."""


@dataclass
class PrecompileReport:
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


class SpecRecorder:
    """While active, every Triton kernel variant not yet compiled in this process is written
    down and skipped: not compiled, not launched. Kernels already compiled launch as usual."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str, str], KernelSpec] = {}
        self._previous: Any = None

    def __enter__(self) -> SpecRecorder:
        from triton import knobs

        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous

    def _hook(self, *, key: Any, fn: Any, compile: dict, **_: Any) -> bool:
        from triton.runtime import driver

        target = driver.active.get_current_target()
        spec = KernelSpec(fn.module, fn.name, compile["specialization_data"],
                          (target.backend, target.arch, target.warp_size))
        self.specs.setdefault((spec.module, spec.name, spec.specialization), spec)
        return True  # skip: Triton neither compiles nor launches this variant


def process_count(local_ranks: int = 1, cpus: int | None = None) -> int:
    """Processes for one rank's pool: the CPUs this process may use, shared by the ranks
    of this host, at most MAX_PROCESSES (compiles beyond that wait on the slowest anyway)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    return max(1, min(MAX_PROCESSES, cpus // max(1, local_ranks)))


class CompilePool:
    """Processes that compile kernel variants into Triton's cache. They start at once and
    import Triton, torch and the kernels while the variants are being recorded. Spawned,
    they inherit the environment: the same Triton cache folder and every setting that keys
    it; each dies with the process that made it."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._executor = ProcessPoolExecutor(processes, mp_context=get_context("spawn"),
                                             initializer=die_with_parent,
                                             initargs=(signal.SIGKILL,))
        for _ in range(processes):
            self._executor.submit(_prepare)

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        # Not waiting: after a timeout a stuck compile must not hold the start-up; the
        # processes end once their current compile does (or with this process).
        self._executor.shutdown(wait=False, cancel_futures=True)

    def compile(self, specs: Iterable[KernelSpec], timeout_s: float = 300.0
                ) -> PrecompileReport:
        """Compile every spec; a spec that fails is reported and compiles when first used."""
        start = time.perf_counter()
        report = PrecompileReport()
        futures = {self._executor.submit(compile_spec, spec): spec for spec in specs}
        for future in as_completed(futures, timeout=timeout_s):
            spec = futures[future]
            error = future.exception()
            if error is None:
                report.compiled += 1
            else:
                report.failed.append(f"{spec.module}.{spec.name}: {error}")
        report.seconds = time.perf_counter() - start
        for line in report.failed:
            log.warning("precompiling a kernel failed (it compiles when first used): %s", line)
        return report


def precompile(specs: Iterable[KernelSpec], processes: int) -> PrecompileReport:
    """Compile every spec into Triton's cache on a pool of `processes`."""
    specs = list(specs)
    if not specs:
        return PrecompileReport()
    with CompilePool(min(processes, len(specs))) as pool:
        return pool.compile(specs)


def _prepare() -> None:
    """In a pool process: the imports every compile needs, done before the first one."""
    importlib.import_module("triton.compiler")
    importlib.import_module("kernels._common")


def compile_spec(spec: KernelSpec) -> None:
    """In a pool process: compile one variant into Triton's cache."""
    _use_target(spec.target)
    kernel = importlib.import_module(spec.module)
    for part in spec.name.split("."):
        kernel = getattr(kernel, part)
    while not hasattr(kernel, "preload") and hasattr(kernel, "fn"):  # an autotuner's kernel
        kernel = kernel.fn
    _build_launcher(kernel.preload(spec.specialization))


def _build_launcher(compiled: Any) -> None:
    """Build the variant's launcher too, where Triton builds one per signature (a C module
    compiled on first launch, kept in the same cache: Triton 3.6 on CUDA). Versions with one
    shared launcher need a live driver here, which this process lacks, and need nothing."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(compiled.src, compiled.metadata)
    except Exception as exc:  # noqa: BLE001 - the launcher is then built at first launch
        log.debug("precompile: no launcher built for %s: %s", compiled, exc)


_TARGET: tuple | None = None


def _use_target(target: tuple[str, Any, int]) -> None:
    """Make Triton compile for `target` in this process, with no GPU and no driver call:
    a driver of the target's backend that answers only what compiling asks."""
    global _TARGET
    if _TARGET == target:
        return
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    gpu = GPUTarget(*target)
    base = next(b.driver for b in backends.values() if b.compiler.supports_target(gpu))

    class TargetOnly(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:  # the real driver's set-up loads the GPU's library
            pass

        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return gpu

    driver.set_active(TargetOnly())
    _TARGET = target


def describe(specs: Iterable[KernelSpec]) -> str:
    """The variants as JSON lines (kept beside the cache entries; read when a start is slow)."""
    return "\n".join(json.dumps({"module": s.module, "name": s.name, "target": s.target,
                                 "specialization": json.loads(s.specialization)})
                     for s in specs)
