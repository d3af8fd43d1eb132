"""N-gram proposals per second on the host: the batched proposer (prepare_proposals, one numpy
pass over the batch) against the per-sequence loop it replaced (propose_ngram once per row).

    python scripts/bench_ngram.py                     # 256 rows x 2048 tokens, K=4, n=3
    python scripts/bench_ngram.py --rows 64 --tokens 4096 --k 8

Rows are copy-like: a random phrase from a 32k vocabulary repeated with random edits, so most
rows find their n-gram (the costly case for the loop, which then slices a continuation). Both
sides write into the same kind of mirror (gpu_workers.mirror.SequenceTable) and must propose
the same tokens; the figure is the median over --repeats of one step's proposals.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from gpu_workers.mirror import SequenceTable
from gpu_workers.speculative import prepare_proposals, propose_ngram


def copy_like_table(rows: int, tokens: int, k: int, seed: int) -> SequenceTable:
    rng = np.random.default_rng(seed)
    table = SequenceTable(rows, tokens + k + 1, 1)
    for r in range(rows):
        phrase = rng.integers(0, 32_000, rng.integers(20, 200))
        row = np.resize(phrase, tokens)
        edits = rng.random(tokens) < 0.05
        row[edits] = rng.integers(0, 32_000, int(edits.sum()))
        table.tokens[r, :tokens] = row
    table.num_tokens[:] = tokens
    table.num_computed[:] = tokens - 1
    return table


def loop_proposals(table: SequenceTable, rows: np.ndarray, num_spec: np.ndarray,
                   n: int) -> np.ndarray:
    """The per-sequence loop that prepare_proposals ran before it was batched."""
    num_verify = np.zeros(len(rows), np.int64)
    for i in np.flatnonzero(num_spec > 0):
        row = int(rows[i])
        length = int(table.num_tokens[row])
        k = min(int(num_spec[i]), table.max_tokens - length)
        guess = propose_ngram(table.tokens[row, :length], n, k)
        table.tokens[row, length:length + len(guess)] = guess
        num_verify[i] = len(guess)
    return num_verify


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    table = copy_like_table(args.rows, args.tokens, args.k, seed=0)
    rows = np.arange(args.rows)
    num_new = np.ones(args.rows, np.int64)
    num_spec = np.full(args.rows, args.k, np.int64)
    loop_verify = loop_proposals(table, rows, num_spec, args.n)
    loop_tokens = table.tokens.copy()
    spec = prepare_proposals(table, rows, num_new, num_spec, args.n)
    assert (spec.num_verify == loop_verify).all() and (table.tokens == loop_tokens).all()
    loop_s = timed(lambda: loop_proposals(table, rows, num_spec, args.n), args.repeats)
    batch_s = timed(lambda: prepare_proposals(table, rows, num_new, num_spec, args.n),
                    args.repeats)
    found = int((spec.num_verify > 0).sum())
    print(f"{args.rows} rows x {args.tokens} tokens, K={args.k}, n={args.n}: {found} rows propose, "
          f"{int(spec.num_verify.sum())} tokens")
    for name, s in (("per-sequence loop", loop_s), ("batched", batch_s)):
        print(f"{name:>17}: {s * 1e3:7.2f} ms per step, {args.rows / s:10,.0f} rows/s, "
              f"{spec.num_verify.sum() / s:10,.0f} proposed tokens/s")
    print(f"batched / loop: {loop_s / batch_s:.1f}x faster")


if __name__ == "__main__":
    main()
