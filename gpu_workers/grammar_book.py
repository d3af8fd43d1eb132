"""Rank 0's grammar matchers: one xgrammar GrammarMatcher per constrained sequence, the
compiled grammars they come from, and the token bitmask applied to the logits (after the
forward, or inside a decode graph: fill_graph_rows).

Compiling a grammar (the token masks of a JSON schema over the whole vocabulary) takes
milliseconds to seconds, so it runs on a thread of its own and is cached by spec
(gpu_workers.grammar_compiles): a sequence's grammar is compiled from the step that brings
the sequence, while that step's forward runs, and a spec seen before costs nothing. Sampling
is the first thing that needs it; only then, and only for a new spec, the step waits.

Rows of the mirror change hands (a row's epoch counts owners), so a matcher is kept with the
epoch it belongs to and one left by an earlier owner is never used. A batch without a
constrained row never reaches this module (the runner asks the mirror's `constrained` column
first), so unconstrained requests pay nothing.

A grammar can reach a state that allows no token at all (a pattern that matches nothing, or
nothing after the text so far): its mask is all zeros, and sampling would draw from nothing.
Such a row is noted when its mask is filled (`dead_ends`) and handed to the step being
launched (the next step's masks may be filled before this one's result is made). Its result
tells the scheduler, which ends the request with an error instead of keeping the token, and
the row is masked no more. A verify step's walk stops at the first position whose mask allows
nothing, and keeps that position: it follows proposals the verify may reject, so the verify's
result decides (accept, with its counts). An entry that accepted every proposal before the
dead position drew its token there and ends as above; one that did not goes on. A draft
step's mask past the first follows draft proposals the same way and is left to the verify.

Speculative decoding: a step that verifies proposals has one logits row per verified
position, and each must be masked by the grammar as it stands after the proposals before it.
mask_logits walks the proposals through the matcher (a mask per position), then rolls it
back: the verify alone decides which tokens are kept, and accept() then advances by exactly
those. xgrammar's rollback is unlimited from 0.2 (no max_rollback_tokens at creation).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_workers.grammar_compiles import CACHE_SIZE, GrammarCompiles
from gpu_workers.graph_bitmask import GraphBitmask
from gpu_workers.pending_step import PendingStep
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.token_bitmask import TokenBitmask
from protocol import StepPlan
from protocol.structured_outputs import StructuredOutputs

log = logging.getLogger("nanopipe.worker")

DEAD_END = ("the structured output cannot be completed: its grammar allows no token after "
            "the text generated so far (a pattern or schema that matches nothing there)")
FILL_THREADS = 4
"""At most this many threads fill one step's masks."""
FILL_ROWS_PER_THREAD = 64
"""Rows a fill thread must have to be worth starting (a row takes microseconds)."""
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


class GrammarBook:
    def __init__(self, model_dir: str, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiles = GrammarCompiles(model_dir, vocab_size, cache_size)
        self._entries: dict[int, _Entry] = {}
        self._batches: dict[int, Any] = {}
        """xgrammar batch fillers by thread count."""
        self.bitmask = TokenBitmask(vocab_size)
        self._walked: dict[int, int] = {}
        """Per row, the draft proposals its matcher accepted this step (walk, unwind)."""
        self._stuck: set[int] = set()
        self.dead_ends: set[tuple[int, int]] = set()
        """(row, epoch) of the rows whose grammar allowed no token in the step being
        launched (take_dead_ends hands them to that step)."""
        self._dead_at: dict[tuple[int, int], int] = {}
        """(row, epoch) -> the verified position whose mask allowed nothing, in the verify
        being launched; its accept decides whether the entry reached it."""
        self.times = MaskTimes()

    def compiled(self, spec: StructuredOutputs) -> Future:
        """The compile of `spec`, started now or earlier (cached by spec)."""
        return self._compiles.compiled(spec)

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

    def track(self, plan: StepPlan, table: SequenceTable) -> None:
        """Give each constrained sequence this plan brings a matcher (its compile starts
        now, while the step runs); a resumed one replays the tokens it had generated."""
        for seq in plan.new_seqs:
            spec = seq.params.structured_outputs
            row = table.rows.get(seq.seq_id)
            if spec is not None and row is not None:
                self.add(row, int(table.epoch[row]), spec,
                         list(seq.token_ids[seq.num_prompt_tokens:]))

    def mask_logits(self, logits: torch.Tensor, rows: np.ndarray, epochs: np.ndarray,
                    constrained: np.ndarray, proposals: list[np.ndarray] | None = None) -> None:
        """Forbid, in logits (entry i belongs to mirror row rows[i]), every token the grammar
        of a constrained entry does not allow next. On the logits' device.

        Without proposals an entry owns one row of logits; with them (a speculative step)
        entry i owns 1 + len(proposals[i]) consecutive rows, row j predicting the token after
        proposals[i][:j], each masked by the grammar after those proposals (_fill_verify)."""
        start = time.perf_counter()
        if proposals is None:
            matchers, indices = self._live(rows, epochs, constrained)
            if matchers:  # one compact row per matcher (gpu_workers.token_bitmask)
                mask = self.bitmask.rows(len(matchers), logits.device)
                self._fill(matchers, mask)
                self._note_dead_ends(mask, slice(0, len(indices)), rows[indices], epochs[indices])
        else:
            mask = self.bitmask.rows(logits.shape[0], logits.device)
            indices = self._fill_verify(mask, rows, epochs, constrained, proposals)
        if indices:
            self.bitmask.apply(logits, indices, compact=proposals is None)
        self.times.seconds += time.perf_counter() - start
        self.times.steps += 1
        self.times.rows += len(indices)

    def fill_graph_rows(self, bitmask: GraphBitmask, bs: int, rows: np.ndarray,
                        epochs: np.ndarray, constrained: np.ndarray) -> None:
        """Fill the decode graphs' bitmask for a step of entries rows (mirror rows) padded
        to bs: row i from entry i's matcher where it holds one, all ones elsewhere; then send
        its first bs rows. The graph applies them (gpu_workers.graph_bitmask)."""
        start = time.perf_counter()
        matchers, indices = self._live(rows, epochs, constrained)
        host = bitmask.host()
        if matchers:
            self._fill(matchers, host, indices)
            self._note_dead_ends(host, indices, rows[indices], epochs[indices])
        bitmask.send(bs, indices)
        self.times.seconds += time.perf_counter() - start
        self.times.steps += 1
        self.times.rows += len(indices)

    def _live(self, rows: np.ndarray, epochs: np.ndarray, constrained: np.ndarray
              ) -> tuple[list[Any], list[int]]:
        """The matchers of the constrained entries whose grammar has not ended, and those
        entries' indices."""
        matchers, indices = [], []
        row_list, epoch_list = rows.tolist(), epochs.tolist()  # item by item
        for i in np.flatnonzero(constrained).tolist():
            m = self._matcher(row_list[i], epoch_list[i])
            if m is not None and not m.is_terminated():
                matchers.append(m)
                indices.append(i)
        return matchers, indices

    def _fill(self, matchers: list[Any], mask: torch.Tensor,
              indices: list[int] | None = None) -> None:
        """Fill mask[i] from matchers[i] (mask[indices[i]], given indices). xgrammar's batch
        fill starts a thread pool of its own at every call (hundreds of microseconds on a
        many-core host, for any batch), and a row costs microseconds: threads only for many
        rows, a few of them."""
        import xgrammar as xgr

        threads = max(1, min(FILL_THREADS, _CORES // 2, len(matchers) // FILL_ROWS_PER_THREAD))
        batch = self._batches.get(threads)
        if batch is None:
            batch = self._batches[threads] = xgr.BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, mask, indices)

    def _fill_verify(self, mask: torch.Tensor, rows: np.ndarray, epochs: np.ndarray,
                     constrained: np.ndarray, proposals: list[np.ndarray]) -> list[int]:
        """Fill the masks of a speculative step's constrained entries; returns the rows filled.

        Each entry's proposals are accepted one by one, a mask filled before each and after
        the last, then rolled back. A proposal the grammar refuses ends the walk and the
        positions after it repeat the mask that refused it: there the proposal has target
        probability 0, so the verify rejects it (greedy, sampled or against a draft's q) and
        no draw past it is ever kept. Cutting the proposal instead would change the batch
        already laid out. Once a proposed stop token ends the grammar, later positions stay
        unmasked: the sequence finishes at that token and their draws are discarded. A mask
        that allows nothing ends the walk too, its position kept for the verify's result
        (_end_reached_dead_ends); positions past it stay unmasked: reaching them means
        reaching it, which ends the request."""
        indices: list[int] = []
        self._dead_at.clear()
        host = mask.numpy()
        first = 0
        for i, props in enumerate(proposals):
            key = (int(rows[i]), int(epochs[i]))
            m = self._matcher(*key) if constrained[i] else None
            walked = 0
            while m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(mask, first + walked)
                indices.append(first + walked)
                if not host[first + walked].any():
                    self._dead_at[key] = walked
                    break
                if walked == len(props):
                    break
                if not m.accept_token(int(props[walked])):
                    refused = first + walked
                    later = range(refused + 1, first + len(props) + 1)
                    mask[later.start:later.stop] = mask[refused]
                    indices.extend(later)
                    break
                walked += 1
            if walked:
                m.rollback(walked)
            first += len(props) + 1
        return indices

    def _end_reached_dead_ends(self, rows: list[int], epochs: list[int],
                               counts: list[int]) -> None:
        """A verify's result: an entry whose mask allowed nothing after j proposals drew
        its token there when it accepted j or more (counts[i] = accepted + 1); that one
        ends. One stopped before goes on, its matcher advanced by what it kept."""
        for row, epoch, count in zip(rows, epochs, counts, strict=True):
            dead_at = self._dead_at.get((row, epoch))
            if dead_at is not None and count > dead_at:
                self._end(row, epoch)
        self._dead_at.clear()

    def _note_dead_ends(self, mask: torch.Tensor, filled: slice | list[int], rows: np.ndarray,
                        epochs: np.ndarray) -> None:
        """Note the rows (mask rows `filled`, mirror rows `rows`) whose mask allows nothing.
        A row that walked draft proposals is left to the verify (_fill_verify)."""
        for j in np.flatnonzero(~mask.numpy()[filled].any(axis=1)).tolist():
            row = int(rows[j])
            if row not in self._walked:
                self._end(row, int(epochs[j]))

    def _end(self, row: int, epoch: int) -> None:
        """The grammar of `row` allowed no token where the step drew one: its request ends
        (take_dead_ends) and its matcher is not advanced again."""
        self._entries[row].broken = True
        self.dead_ends.add((row, epoch))

    def take_dead_ends(self, step: PendingStep) -> list[tuple[int, str]]:
        """(seq id, why) for the entries of the step just launched whose grammar allowed no
        token; the next step's masks start a new list."""
        if not self.dead_ends:
            return []
        ended = [(sid, DEAD_END) for sid, row, epoch in
                 zip(step.seq_ids, step.rows.tolist(), step.epochs.tolist())
                 if (row, epoch) in self.dead_ends]
        self.dead_ends.clear()
        return ended

    def walk(self, rows: np.ndarray, epochs: np.ndarray, tokens: np.ndarray,
             on: np.ndarray) -> None:
        """Accept one draft proposal per entry `on` selects, so that the draft's next step is
        masked by the grammar after it; unwind() takes every walked token back before the
        target verifies. A refused proposal (never expected: the draft drew it under the
        mask) stops that row's walk."""
        for i in np.flatnonzero(on).tolist():
            row = int(rows[i])
            m = self._matcher(row, int(epochs[i]))
            if m is None or m.is_terminated() or row in self._stuck:
                continue
            if m.accept_token(int(tokens[i])):
                self._walked[row] = self._walked.get(row, 0) + 1
            else:
                self._stuck.add(row)

    def unwind(self) -> None:
        for row, n in self._walked.items():
            self._entries[row].matcher.rollback(n)
        self._walked.clear()
        self._stuck.clear()

    def accept(self, rows: np.ndarray, epochs: np.ndarray, tokens: np.ndarray,
               on: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Advance the matchers of the entries `on` selects (constrained rows) by their
        tokens: one per entry, or counts[i] for entry i (a verify's accepted proposals and
        the draw after them), in order."""
        verified = counts is not None
        if not verified:
            counts = np.ones(len(rows), np.int64)
        ends, counts = np.cumsum(counts).tolist(), counts.tolist()
        rows, epochs, tokens = rows.tolist(), epochs.tolist(), tokens.tolist()  # item by item
        if verified and self._dead_at:
            self._end_reached_dead_ends(rows, epochs, counts)
        for i in np.flatnonzero(on).tolist():
            entry = self._entries.get(rows[i])
            if entry is None or entry.epoch != epochs[i] or entry.broken:
                continue
            for token in tokens[ends[i] - counts[i]:ends[i]]:
                if entry.matcher is None:  # not sampled under its mask yet (never expected)
                    entry.replay.append(token)
                    continue
                if entry.matcher.is_terminated():
                    break  # tokens computed past the end: the scheduler discards them
                if not entry.matcher.accept_token(token):
                    log.error("row %d: token %d breaks its grammar", rows[i], token)
                    entry.broken = True
                    break
