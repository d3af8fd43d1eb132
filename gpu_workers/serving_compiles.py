"""Triton kernel variants a worker first meets while it serves.

Start-up's scratch steps and graph captures run every shape the kernels specialise on, so
that serving meets none: a variant met later costs the step that meets it a compile (a
second or more, on an empty Triton cache) or a load from the cache, while the device waits
and every sequence in the step stalls with it. Such a stall looks like idle GPU time in a
throughput run and nothing else says where it came from, so once the worker is ready it
watches Triton's hooks (the one before a variant is compiled or loaded, the one after) and
logs each variant with its time and specialisation: the warm-up's shapes then say what they
missed. Some are met there by design: the structured-output kernels at the first
constrained step (gpu_workers.warm_up says why). A steady worker launches known variants
only, which never reach the hooks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("nanopipe.worker")

LOGGED = 20
"""Variants logged one by one; later ones are counted, and the count logged every 20."""


@dataclass
class ServingCompiles:
    """Counts (and logs) the kernel variants met after start-up, from watch() on."""

    rank: int = 0
    count: int = 0
    seconds: float = 0.0
    _began: dict[Any, float] = field(default_factory=dict)
    _previous: tuple[Any, Any] = (None, None)

    def watch(self) -> None:
        """Install the hooks (Triton's own, any earlier ones still called)."""
        from triton import knobs

        self._previous = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook = self.before
        knobs.runtime.jit_post_compile_hook = self.after

    def stop(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous

    def before(self, *, key: Any, **kwargs: Any) -> bool:
        """Triton asks whether to skip the variant: never; its clock starts."""
        self._began[key] = time.perf_counter()
        earlier = self._previous[0]
        return bool(earlier(key=key, **kwargs)) if earlier is not None else False

    def after(self, *, key: Any, repr: str, fn: Any, **kwargs: Any) -> None:
        seconds = time.perf_counter() - self._began.pop(key, time.perf_counter())
        self.count += 1
        self.seconds += seconds
        if self.count <= LOGGED:
            log.warning("worker %d: Triton kernel %s met a new variant while serving: %.0f ms "
                        "to compile or load it (a step waited; start-up had not run it): %s",
                        self.rank, fn.name, seconds * 1e3,
                        specialisation(kwargs.get("compile", {}), fn) or repr)
        elif self.count % LOGGED == 0:
            log.warning("worker %d: %d kernel variants met while serving, %.1f s in all",
                        self.rank, self.count, self.seconds)
        later = self._previous[1]
        if later is not None:
            later(key=key, repr=repr, fn=fn, **kwargs)


def specialisation(compile: dict, fn: Any) -> str:
    """What sets a variant apart, by argument name: its constants (constexprs, and integers
    Triton fixed at 1) and the integers it takes as multiples of 16; "" where this Triton
    describes them otherwise."""
    try:
        names = fn.jit_function.arg_names
        consts = [f"{names[k[0]]}={v}" for k, v in compile["constants"].items()]
        ints = {n for n, ty in compile["signature"].items() if str(ty).startswith(("i", "u"))}
        attrs = compile["configs"][0]
        aligned = [names[k[0]] for k, a in attrs.items()
                   if names[k[0]] in ints and any(x[0] == "tt.divisibility" for x in a)]
    except (AttributeError, IndexError, KeyError, TypeError):
        return ""
    return "; ".join(filter(None, [", ".join(consts),
                                   aligned and "multiples of 16: " + ", ".join(aligned)]))
