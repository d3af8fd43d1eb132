"""The worker's mirror of running sequences, kept as numpy columns (one row per sequence).

Rows are changed only by StepPlans (drop, new, cached deltas) and by the tokens this worker
samples, so a continuing sequence never needs its tokens or block table re-sent.

A sampled token takes its place in two moves, so that the next step can be prepared while the
device still computes it: `append_placeholders` reserves the position when the step is
launched (the token's value is still on the device; `pending_pos` / `pending_slot` say where),
and `fill_tokens` writes the value once it reached the host. A row's `epoch` changes whenever
it is given to another sequence, so a late value never lands in a row that moved on. Column storage
lets the batch builder gather positions, slots and block tables without Python loops.
"""

from __future__ import annotations

import numpy as np

from protocol import SamplingParams, StepPlan


class MirrorError(RuntimeError):
    """A plan contradicts the mirror (a scheduler/worker desync)."""


class SequenceTable:
    def __init__(self, capacity: int, max_tokens: int, max_blocks: int) -> None:
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        self.rows: dict[int, int] = {}
        self.free: list[int] = []
        self.params: list[SamplingParams | None] = []
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
        self.epoch = np.zeros(0, np.int64)
        self.pending_pos = np.zeros(0, np.int64)
        """Position of the row's newest token whose value is still on the device; -1 = none."""
        self.pending_slot = np.zeros(0, np.int64)
        """Where that value is in its step's sampled-token tensor."""
        self._grow(capacity)

    _COLUMNS = ("tokens", "block_tables", "num_tokens", "num_prompt", "num_computed",
                "num_blocks", "temperature", "top_p", "min_p", "top_k", "seed", "logprobs",
                "presence", "frequency", "repetition", "top_logprobs", "epoch", "pending_pos",
                "pending_slot")

    def _grow(self, extra: int) -> None:
        old = len(self.num_tokens)
        for name in self._COLUMNS:
            col = getattr(self, name)
            setattr(self, name, np.concatenate([col, np.zeros((extra, *col.shape[1:]), col.dtype)]))
        self.pending_pos[old:] = -1
        self.params.extend([None] * extra)
        self.free.extend(range(old + extra - 1, old - 1, -1))

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, plan: StepPlan) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Apply a plan's changes; returns (seq ids, rows, num_new) of this step's entries."""
        for sid in plan.drop_seq_ids:
            row = self.rows.pop(sid, None)
            if row is not None:
                self.params[row] = None
                self.free.append(row)
        ids, rows, new = [], [], []
        for seq in plan.new_seqs:
            ids.append(seq.seq_id)
            rows.append(self._add(seq))
            new.append(seq.num_new)
        cached = plan.cached
        for sid, n, blocks in zip(cached.seq_ids, cached.num_new, cached.new_block_ids,
                                  strict=True):
            row = self.rows.get(sid)
            if row is None:
                raise MirrorError(f"plan {plan.step_id} continues unknown sequence {sid}")
            if blocks:
                self._append_blocks(row, blocks)
            ids.append(sid)
            rows.append(row)
            new.append(n)
        rows_a = np.asarray(rows, np.int64)
        new_a = np.asarray(new, np.int64)
        if len(rows_a) and np.any(self.num_computed[rows_a] + new_a > self.num_tokens[rows_a]):
            raise MirrorError(f"plan {plan.step_id} computes tokens the worker does not know")
        return ids, rows_a, new_a

    def _add(self, seq) -> int:
        if seq.seq_id in self.rows:  # re-sent in full after preemption without a drop
            self.free.append(self.rows.pop(seq.seq_id))
        n = len(seq.token_ids)
        if n > self.max_tokens:
            raise MirrorError(f"sequence {seq.seq_id} has {n} tokens, more than max_model_len")
        if not self.free:
            self._grow(max(16, len(self.num_tokens)))
        row = self.free.pop()
        self.rows[seq.seq_id] = row
        self.epoch[row] += 1
        self.pending_pos[row] = -1
        self.tokens[row, :n] = seq.token_ids
        self.num_tokens[row] = n
        self.num_prompt[row] = seq.num_prompt_tokens
        self.num_computed[row] = seq.num_computed
        self.num_blocks[row] = 0
        self._append_blocks(row, seq.block_table)
        p = seq.params
        self.params[row] = p
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.top_k[row] = p.top_k if p.top_k > 0 else 0
        self.seed[row] = -1 if p.seed is None else p.seed
        self.logprobs[row] = p.logprobs
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.top_logprobs[row] = p.top_logprobs
        return row

    def _append_blocks(self, row: int, blocks: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(blocks)
        if end > self.max_blocks:
            raise MirrorError(f"block table of row {row} exceeds {self.max_blocks} blocks")
        self.block_tables[row, start:end] = blocks
        self.num_blocks[row] = end

    def uses_penalties(self, rows: np.ndarray) -> np.ndarray:
        return (self.presence[rows] != 0) | (self.frequency[rows] != 0) | (
            self.repetition[rows] != 1)

    def append_placeholders(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reserve the next position of each row for the token being sampled; its value is
        slot i of the step's sampled tokens. Returns (positions, epochs) for fill_tokens."""
        pos = self.num_tokens[rows]
        if np.any(pos >= self.max_tokens):
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
