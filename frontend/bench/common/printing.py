"""How the benchmarks print results: human lines, and one JSON line per result."""

from __future__ import annotations

import json


def emit(**result) -> None:
    """One JSON line, flushed at once (the runs are long; a reader follows them live)."""
    print(json.dumps(result), flush=True)


def sig(x: float) -> float:
    """Four significant digits, so that tiny CPU bounds do not round to zero."""
    return float(f"{x:.4g}")


def leading_match(a: list[int], b: list[int]) -> int:
    """How many tokens two continuations share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
