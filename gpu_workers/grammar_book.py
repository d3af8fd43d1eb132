"""Rank 0's grammar matchers: one xgrammar GrammarMatcher per constrained sequence, the
compiled grammars they come from, and the token bitmask applied to the logits.

Compiling a grammar (the token masks of a JSON schema over the whole vocabulary) takes
milliseconds to seconds, so it runs on a thread of its own and is cached by spec (bounded,
least recently used first out): a sequence's grammar is compiled from the step that brings
the sequence, while that step's forward runs, and a spec seen before costs nothing. Sampling
is the first thing that needs it; only then, and only for a new spec, the step waits.

Rows of the mirror change hands (a row's epoch counts owners), so a matcher is kept with the
epoch it belongs to and one left by an earlier owner is never used. A batch without a
constrained row never reaches this module (the runner asks the mirror's `constrained` column
first), so unconstrained requests pay nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from protocol import model_config as hf
from protocol.structured_outputs import StructuredOutputs, build_grammar

log = logging.getLogger("nanopipe.worker")

CACHE_SIZE = 128
"""Compiled grammars kept (by spec); the least recently used beyond this are dropped."""
COMPILE_THREADS = 4
"""xgrammar's own threads per compile (the token-mask precomputation is parallel)."""


@dataclass(slots=True)
class _Entry:
    epoch: int
    compiled: Future
    matcher: Any = None
    replay: list[int] = field(default_factory=list)
    """Tokens generated before the matcher existed (a sequence resumed after preemption)."""
    broken: bool = False


@dataclass(slots=True)
class MaskTimes:
    """Host time spent filling and applying bitmasks, for the step profile and benchmarks."""

    seconds: float = 0.0
    steps: int = 0
    rows: int = 0


def _tokenizer_info(model_dir: str, vocab_size: int) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = set(hf.eos_token_ids(hf.read_generation_config(model_dir)))
    if hf.has_model_config(model_dir):
        eos.update(hf.eos_token_ids(hf.read_model_config(model_dir)))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(eos))


class GrammarBook:
    def __init__(self, model_dir: str, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiler: Future | None = None
        """Made with the first compile: an engine that never sees a grammar never loads it."""
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._entries: dict[int, _Entry] = {}
        self._batch: Any = None
        self._host_mask: torch.Tensor | None = None
        self.times = MaskTimes()

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        info = _tokenizer_info(self.model_dir, self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)

    def _compile(self, spec: StructuredOutputs) -> Any:
        return self._compiler.result().compile_grammar(build_grammar(spec))

    def compiled(self, spec: StructuredOutputs) -> Future:
        """The compile of `spec`, started now or earlier (cached by spec)."""
        future = self._compiled.get(spec.key)
        if future is not None:
            self._compiled.move_to_end(spec.key)
            return future
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)
        future = self._pool.submit(self._compile, spec)
        self._compiled[spec.key] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    def add(self, row: int, epoch: int, spec: StructuredOutputs, generated: list[int]) -> None:
        """A constrained sequence now owns `row`; `generated`: its output tokens so far."""
        self._entries[row] = _Entry(epoch, self.compiled(spec), replay=list(generated))

    def _matcher(self, row: int, epoch: int) -> Any | None:
        entry = self._entries.get(row)
        if entry is None or entry.epoch != epoch or entry.broken:
            return None
        if entry.matcher is None:
            import xgrammar as xgr

            try:
                entry.matcher = xgr.GrammarMatcher(entry.compiled.result())
            except Exception as exc:  # refused upstream; never expected here
                log.error("grammar for row %d could not be compiled: %s", row, exc)
                entry.broken = True
                return None
            for token in entry.replay:
                if not entry.matcher.is_terminated():
                    entry.matcher.accept_token(token)
            entry.replay = []
        return entry.matcher

    def mask_logits(self, logits: torch.Tensor, rows: np.ndarray, epochs: np.ndarray,
                    constrained: np.ndarray) -> None:
        """Forbid, in logits [R, V] (row i belongs to mirror row rows[i]), every token the
        grammar of a constrained row does not allow next. On the logits' device."""
        import xgrammar as xgr

        start = time.perf_counter()
        matchers, indices = [], []
        for i in np.flatnonzero(constrained).tolist():
            m = self._matcher(int(rows[i]), int(epochs[i]))
            if m is not None and not m.is_terminated():
                matchers.append(m)
                indices.append(i)
        if matchers:
            n, width = logits.shape[0], xgr.get_bitmask_shape(1, self.vocab_size)[1]
            host = self._host_mask
            if host is None or host.shape[0] < n:
                host = torch.full((max(n, 64), width), -1, dtype=torch.int32,
                                  pin_memory=logits.device.type == "cuda")
                self._host_mask = host
            mask = host[:n]
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, mask, indices)
            device_mask = mask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=self.vocab_size,
                                            indices=indices)
        self.times.seconds += time.perf_counter() - start
        self.times.steps += 1
        self.times.rows += len(matchers)

    def accept(self, rows: np.ndarray, epochs: np.ndarray, tokens: np.ndarray) -> None:
        """Advance the matchers of constrained rows by their sampled tokens."""
        for row, epoch, token in zip(rows.tolist(), epochs.tolist(), tokens.tolist()):
            entry = self._entries.get(row)
            if entry is None or entry.epoch != epoch or entry.broken:
                continue
            if entry.matcher is None:  # not sampled under its mask yet (never expected)
                entry.replay.append(token)
                continue
            if entry.matcher.is_terminated():
                continue  # a token overlap computed past the end: the scheduler discards it
            if not entry.matcher.accept_token(token):
                log.error("row %d: token %d breaks its grammar", row, token)
                entry.broken = True
