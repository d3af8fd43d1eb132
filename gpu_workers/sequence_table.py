"""SequenceTable: the worker's copy of the running sequences, numpy columns, one row each.

Rows are changed only by StepPlans (drop, new, cached deltas) and by the tokens this worker
samples, so a continuing sequence never needs its tokens or block table re-sent.

A sampled token takes its place in two moves, so that the next step can be prepared while the
device still computes it: `append_placeholders` reserves the position when the step is
launched (the token's value is still on the device; `pending_pos` / `pending_slot` say where),
and `fill_tokens` writes the value once it reached the host. A row's `epoch` changes whenever
it is given to another sequence, so a late value never lands in a row that moved on. Column storage
lets the batch builder gather positions, slots and block tables without Python loops.

One sequence's bad contents fail that sequence only: a NewSequence is checked in full (token
ids in the vocabulary, block ids in the pool, lengths that fit, parameters that fit their
columns) before any column is written, and one that does not pass, or whose new blocks do not
fit later, is left out of the step and remembered as failed until the scheduler drops it.
With tensor parallelism every rank applies the same plan to the same table and leaves out the
same sequences; rank 0 reports them in its StepResult.
"""

from __future__ import annotations

import numpy as np

from protocol import NewSequence, StepPlan

_INT32_LIMIT = 2**31
"""Token ids are stored as int32."""


class MirrorError(RuntimeError):
    """A plan contradicts the mirror (a scheduler/worker desync)."""


class SequenceRejected(ValueError):
    """One sequence's contents cannot run on this worker; only that sequence fails."""


class SequenceTable:
    def __init__(self, capacity: int, max_tokens: int, max_blocks: int,
                 vocab_size: int | None = None, num_blocks: int | None = None,
                 block_size: int | None = None) -> None:
        """vocab_size, num_blocks and block_size (None: unchecked) bound what a sequence may
        hold: token ids, block ids, and how many tokens its block table covers."""
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        self.vocab_size = vocab_size
        self.num_blocks_total = num_blocks
        self.block_size = block_size
        self.failed: dict[int, str] = {}
        """Sequences left out of a step, and why, until a plan drops them."""
        self.new_failures: list[tuple[int, str]] = []
        """Failures of the last applied plan, for its StepResult."""
        self.step_spec = np.zeros(0, np.int64)
        """The last applied plan's speculation cap per entry (zeros when none speculates)."""
        self.rows: dict[int, int] = {}
        self.free: list[int] = []
        self.tokens = np.zeros((0, max_tokens), np.int32)
        self.block_tables = np.zeros((0, max_blocks), np.int32)
        self.num_tokens = np.zeros(0, np.int64)
        self.num_prompt = np.zeros(0, np.int64)
        self.num_computed = np.zeros(0, np.int64)
        self.num_blocks = np.zeros(0, np.int64)
        self.temperature = np.zeros(0, np.float32)
        self.top_p = np.zeros(0, np.float32)
        self.min_p = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int32)
        self.seed = np.zeros(0, np.int64)  # -1 = unseeded
        self.logprobs = np.zeros(0, bool)
        self.presence = np.zeros(0, np.float32)
        self.frequency = np.zeros(0, np.float32)
        self.repetition = np.zeros(0, np.float32)
        self.top_logprobs = np.zeros(0, np.int32)
        self.constrained = np.zeros(0, bool)  # a grammar holds the output: rank 0 masks it
        # Derived from the parameters above when a sequence is added, so that the per-step
        # questions about them are one lookup each (a step's host work paces small batches).
        self.penalized = np.zeros(0, bool)
        """Whether any penalty applies (the sampler then reads the token history)."""
        self.plain_draw = np.zeros(0, bool)
        """Temperature and seed suffice (a grammar's mask aside): no penalty, logprobs, filter."""
        self.inv_temperature = np.zeros(0, np.float32)
        """1 / temperature, 0 for greedy rows."""
        self.epoch = np.zeros(0, np.int64)
        self.pending_pos = np.zeros(0, np.int64)
        """Position of the row's newest token whose value is still on the device; -1 = none."""
        self.pending_slot = np.zeros(0, np.int64)
        """Where that value is in its step's sampled-token tensor."""
        self._grow(capacity)

    _COLUMNS = ("tokens", "block_tables", "num_tokens", "num_prompt", "num_computed",
                "num_blocks", "temperature", "top_p", "min_p", "top_k", "seed", "logprobs",
                "presence", "frequency", "repetition", "top_logprobs", "constrained", "penalized",
                "plain_draw", "inv_temperature", "epoch", "pending_pos", "pending_slot")

    def _grow(self, extra: int) -> None:
        old = len(self.num_tokens)
        for name in self._COLUMNS:  # np.zeros maps pages once written: rows cost what they hold
            col = getattr(self, name)
            setattr(self, name, np.zeros((old + extra, *col.shape[1:]), col.dtype))
            getattr(self, name)[:old] = col
        self.pending_pos[old:] = -1
        self.free.extend(range(old + extra - 1, old - 1, -1))

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, plan: StepPlan) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Apply a plan's changes; returns (seq ids, rows, num_new) of this step's entries.

        Sequences that fail their checks are left out; `new_failures` lists them."""
        self.new_failures = []
        for sid in plan.drop_seq_ids:
            self.failed.pop(sid, None)
            self._release(sid)
        if plan.trim_seq_ids:
            self._trim(plan)
        ids, rows, new = [], [], []
        for seq in plan.new_seqs:
            self.failed.pop(seq.seq_id, None)  # re-sent in full: judged afresh
            try:
                row = self._add(seq)
            except Exception as exc:  # any failure here is this sequence's alone
                self._fail(seq.seq_id, f"{type(exc).__name__}: {exc}")
                continue
            ids.append(seq.seq_id)
            rows.append(row)
            new.append(seq.num_new)
        self._continue(plan, ids, rows, new)
        rows_a = np.asarray(rows, np.int64)
        new_a = np.asarray(new, np.int64)
        self.step_spec = self._spec_caps(plan, ids)
        if len(rows_a):
            end = self.num_computed[rows_a] + new_a
            if (new_a < 1).any() or (end > self.num_tokens[rows_a]).any():
                raise MirrorError(f"plan {plan.step_id} computes tokens the worker does not know")
            if self.block_size is not None and (
                    end + self.step_spec > self.num_blocks[rows_a] * self.block_size).any():
                raise MirrorError(f"plan {plan.step_id} computes past a block table")
        return ids, rows_a, new_a

    def _continue(self, plan: StepPlan, ids: list[int], rows: list[int],
                  new: list[int]) -> None:
        """Append the plan's continuing sequences to the step's entries, their new blocks to
        their tables. Most decode steps name only rows the mirror holds and add a block to a
        few of them (those crossing a block boundary): the others take one lookup each, not
        a loop of checks."""
        cached = plan.cached
        found = [self.rows.get(sid) for sid in cached.seq_ids]
        if None in found or not (len(found) == len(cached.num_new)
                                 == len(cached.new_block_ids)):
            self._continue_each(plan, ids, rows, new)
            return
        refused = {i for i, blocks in enumerate(cached.new_block_ids)
                   if blocks and not self._add_blocks(cached.seq_ids[i], found[i], blocks)}
        kept = [i for i in range(len(found)) if i not in refused] if refused else None
        ids += cached.seq_ids if kept is None else [cached.seq_ids[i] for i in kept]
        rows += found if kept is None else [found[i] for i in kept]
        new += cached.num_new if kept is None else [cached.num_new[i] for i in kept]

    def _continue_each(self, plan: StepPlan, ids: list[int], rows: list[int],
                       new: list[int]) -> None:
        """_continue one sequence at a time: some are unknown to the mirror (failed ones the
        scheduler had planned before hearing of it, or a desync) or the lists disagree."""
        cached = plan.cached
        for sid, n, blocks in zip(cached.seq_ids, cached.num_new, cached.new_block_ids,
                                  strict=True):
            row = self.rows.get(sid)
            if row is None:
                if sid in self.failed:  # planned before the scheduler heard of its failure
                    continue
                raise MirrorError(f"plan {plan.step_id} continues unknown sequence {sid}")
            if blocks and not self._add_blocks(sid, row, blocks):
                continue
            ids.append(sid)
            rows.append(row)
            new.append(n)

    def _add_blocks(self, sid: int, row: int, blocks: list[int]) -> bool:
        """Append a continuing sequence's new blocks, or fail it (False) if they are not
        valid block ids or overflow its table."""
        try:
            checked = self._check_blocks(blocks, int(self.num_blocks[row]))
        except SequenceRejected as exc:
            self._fail(sid, str(exc))
            return False
        self._append_blocks(row, checked)
        return True

    def _trim(self, plan: StepPlan) -> None:
        """Cut block tables as the scheduler did after speculative results: the blocks past
        the new length held only rejected proposals, and no plan before this one writes them
        again. Applied before this plan's new blocks, as the scheduler's tables were."""
        for sid, keep in zip(plan.trim_seq_ids, plan.trim_num_blocks, strict=True):
            row = self.rows.get(sid)
            if row is None:
                if sid in self.failed:
                    continue
                raise MirrorError(f"plan {plan.step_id} trims unknown sequence {sid}")
            held = int(self.num_blocks[row])
            covered = keep * self.block_size if self.block_size is not None else None
            if not 0 <= keep <= held or (covered is not None
                                         and covered < self.num_computed[row]):
                raise MirrorError(f"plan {plan.step_id} trims sequence {sid} to {keep} of "
                                  f"{held} blocks, below its {self.num_computed[row]} "
                                  f"computed tokens or above its table")
            self.num_blocks[row] = keep

    @staticmethod
    def _spec_caps(plan: StepPlan, ids: list[int]) -> np.ndarray:
        """Per entry of this step, its num_spec (new sequences never speculate)."""
        caps = np.zeros(len(ids), np.int64)
        spec = plan.cached.num_spec
        if spec:
            by_id = dict(zip(plan.cached.seq_ids, spec, strict=True))
            for i, sid in enumerate(ids):
                caps[i] = by_id.get(sid, 0)
            caps = np.maximum(caps, 0)
        return caps

    def _release(self, sid: int) -> None:
        row = self.rows.pop(sid, None)
        if row is not None:
            self.free.append(row)

    def _fail(self, sid: int, error: str) -> None:
        self._release(sid)
        self.failed[sid] = error
        self.new_failures.append((sid, error))

    def _check_blocks(self, blocks: list[int], held: int) -> np.ndarray:
        if held + len(blocks) > self.max_blocks:
            raise SequenceRejected(
                f"its block table needs {held + len(blocks)} blocks, more than {self.max_blocks}")
        ids = np.asarray(blocks, np.int64)
        limit = self.num_blocks_total
        if len(ids) and (ids.min() < 0 or (limit is not None and ids.max() >= limit)):
            raise SequenceRejected(f"block ids outside the KV pool [0, {limit})")
        return ids

    def _add(self, seq: NewSequence) -> int:
        """Check everything first, then take a row: a refused sequence leaves no trace."""
        n = len(seq.token_ids)
        if n > self.max_tokens:
            raise SequenceRejected(f"it has {n} tokens, more than max_model_len")
        vocab = self.vocab_size
        limit = _INT32_LIMIT if vocab is None else min(vocab, _INT32_LIMIT)
        tokens = np.asarray(seq.token_ids, np.int64)  # int32 by construction (NewSequence)
        outside = (tokens < 0) | (tokens >= limit)
        if outside.any():
            bad = seq.token_ids[int(np.flatnonzero(outside)[0])]
            raise SequenceRejected(f"token id {bad} is outside the vocabulary [0, {limit})")
        if not 1 <= seq.num_prompt_tokens <= n:
            raise SequenceRejected(f"num_prompt_tokens {seq.num_prompt_tokens} of {n} tokens")
        if seq.num_computed < 0 or seq.num_new < 1 or seq.num_computed + seq.num_new > n:
            raise SequenceRejected(f"it computes tokens [{seq.num_computed}, "
                                   f"{seq.num_computed + seq.num_new}) of {n}")
        blocks = self._check_blocks(seq.block_table, 0)
        end = seq.num_computed + seq.num_new
        if self.block_size is not None and end > len(blocks) * self.block_size:
            raise SequenceRejected(f"its {len(blocks)} blocks do not hold its {end} tokens")
        p = seq.params
        values = {  # every parameter converted to its column's type before any is stored
            "temperature": p.temperature, "top_p": p.top_p, "min_p": p.min_p,
            "top_k": p.top_k if p.top_k > 0 else 0, "seed": -1 if p.seed is None else p.seed,
            "logprobs": p.logprobs, "presence": p.presence_penalty,
            "frequency": p.frequency_penalty, "repetition": p.repetition_penalty,
            "top_logprobs": p.top_logprobs, "constrained": p.structured_outputs is not None,
        }
        try:
            values = {k: np.array(v, getattr(self, k).dtype) for k, v in values.items()}
        except (OverflowError, ValueError, TypeError) as exc:
            raise SequenceRejected(f"a sampling parameter does not fit its column: {exc}") from None
        if not all(np.isfinite(v) for v in values.values() if v.dtype.kind == "f"):
            raise SequenceRejected("a sampling parameter is not a finite float32")
        if vocab is not None and p.top_logprobs > vocab:
            raise SequenceRejected(f"top_logprobs {p.top_logprobs} exceeds the vocabulary")
        self._release(seq.seq_id)  # re-sent in full after preemption without a drop
        if not self.free:
            self._grow(max(16, len(self.num_tokens)))
        row = self.free.pop()
        self.rows[seq.seq_id] = row
        self.epoch[row] += 1
        self.pending_pos[row] = -1
        self.tokens[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt[row] = seq.num_prompt_tokens
        self.num_computed[row] = seq.num_computed
        self.num_blocks[row] = 0
        self._append_blocks(row, blocks)
        for name, value in values.items():
            getattr(self, name)[row] = value
        self._derive_sampling(row)
        return row

    def _derive_sampling(self, row: int) -> None:
        penalized = (self.presence[row] != 0 or self.frequency[row] != 0
                     or self.repetition[row] != 1)
        random = self.temperature[row] > 0
        filtered = self.top_k[row] > 0 or self.top_p[row] < 1 or self.min_p[row] > 0
        self.penalized[row] = penalized
        self.plain_draw[row] = not (penalized or (random and filtered) or self.logprobs[row]
                                    or self.top_logprobs[row] > 0)
        self.inv_temperature[row] = np.float32(1) / self.temperature[row] if random else 0

    def _append_blocks(self, row: int, blocks: list[int] | np.ndarray) -> None:
        start = int(self.num_blocks[row])
        end = start + len(blocks)
        self.block_tables[row, start:end] = blocks
        self.num_blocks[row] = end

    def uses_penalties(self, rows: np.ndarray) -> np.ndarray:
        return self.penalized[rows]

    def append_verified(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """After a verification step: append each row's counts[i] tokens (flat in `tokens`)
        and count its accepted proposals as computed (their KV is written). Blocks reserved
        for rejected proposals stay until a later plan trims them (StepPlan.trim_seq_ids): the
        scheduler decides that, knowing which plans it has sent since."""
        offset = 0
        for i, row in enumerate(rows.tolist()):
            c = int(counts[i])
            length = int(self.num_tokens[row])
            if length + c > self.max_tokens:
                raise MirrorError("a sequence grew past max_model_len")
            self.tokens[row, length:length + c] = tokens[offset:offset + c]
            offset += c
            self.num_tokens[row] = length + c
            self.num_computed[row] += c - 1

    def append_placeholders(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reserve the next position of each row for the token being sampled; its value is
        slot i of the step's sampled tokens. Returns (positions, epochs) for fill_tokens."""
        pos = self.num_tokens[rows]
        if (pos >= self.max_tokens).any():
            raise MirrorError("a sequence grew past max_model_len")
        self.tokens[rows, pos] = 0
        self.num_tokens[rows] = pos + 1
        self.pending_pos[rows] = pos
        self.pending_slot[rows] = np.arange(len(rows))
        return pos, self.epoch[rows].copy()

    def fill_tokens(self, rows: np.ndarray, pos: np.ndarray, epochs: np.ndarray,
                    tokens: np.ndarray) -> None:
        """Write sampled values into their reserved positions, skipping rows that were given
        to another sequence since."""
        same = self.epoch[rows] == epochs
        rows, pos = rows[same], pos[same]
        self.tokens[rows, pos] = tokens[same]
        settled = rows[self.pending_pos[rows] == pos]
        self.pending_pos[settled] = -1
