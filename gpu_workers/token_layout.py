"""Where each token of a step goes: ids, positions, cache slots and attention metadata.

Every entry computes tokens [start, start + num_new) of its mirror row, so prefill, chunked
prefill, prefix-cache hits, decode and verification share one layout. CUDA graphs need a
fixed one: with pad_to, every entry takes q_per_seq tokens (its own, then padding that stores
nothing, slot -1, and whose outputs are never read) and the batch is padded to pad_to
entries; prefill graphs keep the ragged layout and add empty entries and one entry holding
the padding tokens (pad_ragged). The target's steps (gpu_workers.batch) and the draft model's
(gpu_workers.speculative.draft) are both laid out here.

Block tables are laid out as wide as the step's longest context needs, not as wide as
max_model_len allows (a 128k-token limit is 512 columns of 256-token blocks, a short chat
needs a few): filling and copying them costs what the step's contexts are. A CUDA graph
reads a table of the full width; its inputs carry the compact one and the graph widens it
on the device (gpu_workers.graph_tables). Steps run without a graph on CUDA take a width
rounded up to a bucket (bucket_width), so the Triton kernels, which specialise on the
table's row stride and size their split-K grid from its width, see few distinct shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.sequence_table import SequenceTable

if TYPE_CHECKING:
    from gpu_workers.static_inputs import Staged

PART_NAMES = ("ids", "positions", "slots", "cu_q", "seq_lens", "cu_k", "tables")
"""TokenLayout.parts() in order: the names of a graph's static input segments."""


def layout_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                  attn: AttentionBatch) -> dict[str, torch.Tensor]:
    """A step's device inputs by the names of TokenLayout's parts (PART_NAMES)."""
    return dict(ids=input_ids, positions=positions, slots=attn.slot_mapping,
                cu_q=attn.cu_seqlens_q, seq_lens=attn.seq_lens_k, cu_k=attn.cu_seqlens_k,
                tables=attn.block_tables.reshape(-1))


def bucket_width(needed: int, max_width: int) -> int:
    """The block-table width of a step run without a CUDA graph on the GPU: `needed` columns
    rounded up to a power of two from 16 (few distinct widths, so few decode split counts),
    capped at the table's full width."""
    width = 16
    while width < needed:
        width *= 2
    return min(width, max_width)


def needed_width(longest: int, block_size: int) -> int:
    """Columns that cover a context of `longest` tokens (at least one)."""
    return max(1, -(-longest // block_size))


def entry_offsets(num_new: np.ndarray, q_per_seq: int | None = None) -> np.ndarray:
    """Where each entry's tokens start in a step's input ids: packed, or q_per_seq apart in
    a CUDA graph's layout (lay_out's `offsets`, known before the layout is made)."""
    if q_per_seq is not None:
        return np.arange(len(num_new), dtype=np.int64) * q_per_seq
    offsets = np.zeros(len(num_new), np.int64)
    np.cumsum(num_new[:-1], out=offsets[1:])
    return offsets


@dataclass(slots=True)
class TokenLayout:
    """Host arrays of one step's tokens (int64 unless said otherwise)."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    cu_q: np.ndarray
    seq_lens: np.ndarray
    cu_k: np.ndarray
    tables: np.ndarray
    """[entries (padded), width] int32 block tables."""
    offsets: np.ndarray
    """[real entries] where each entry's tokens start."""
    last: np.ndarray
    """[real entries] each entry's last real token."""
    max_q: int
    max_k: int
    decode: bool
    q_per_seq: int

    def parts(self) -> list[np.ndarray]:
        return [self.ids, self.positions, self.slots, self.cu_q, self.seq_lens, self.cu_k,
                self.tables.reshape(-1)]

    def named_parts(self) -> dict[str, np.ndarray]:
        return dict(zip(PART_NAMES, self.parts(), strict=True))

    def attention(self, views: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                            AttentionBatch]:
        """(input ids, positions, AttentionBatch) from the device views of parts()."""
        ids, pos, slots, cu_q, lens, cu_k, tables = views
        return ids, pos, AttentionBatch(
            slot_mapping=slots, block_tables=tables.view(len(self.seq_lens), -1),
            cu_seqlens_q=cu_q, seq_lens_k=lens, cu_seqlens_k=cu_k, max_seqlen_q=self.max_q,
            max_seqlen_k=self.max_k, decode=self.decode, q_per_seq=self.q_per_seq)


def lay_out(table: SequenceTable, rows: np.ndarray, start: np.ndarray, num_new: np.ndarray,
            block_size: int, width: int | None = None, pad_to: int | None = None,
            q_per_seq: int = 1, staged: Staged | None = None) -> TokenLayout:
    """staged: a decode graph's step is written straight into these segments of its static
    inputs (PART_NAMES; staged.lengths then names them); other layouts leave it alone."""
    if pad_to is not None and q_per_seq == 1 and (num_new == 1).all():
        assert pad_to >= len(rows)
        width = width or needed_width(int(start.max()) + 1, block_size)
        return _lay_out_decode(table, rows, start, block_size, width, pad_to, staged)
    n = len(rows)
    end = start + num_new
    # A padded entry attends over start + q_per_seq keys (its padding queries included).
    longest = int(end.max()) if pad_to is None else int(start.max()) + q_per_seq
    width = width or min(needed_width(longest, block_size), table.max_blocks)
    tables = table.block_tables[rows, :width]
    if pad_to is None:
        cu_q = np.zeros(n + 1, np.int64)
        np.cumsum(num_new, out=cu_q[1:])
        positions = np.arange(int(cu_q[-1]), dtype=np.int64) - np.repeat(cu_q[:-1] - start,
                                                                          num_new)
        row_rep, seq_lens = np.repeat(rows, num_new), end
    else:
        assert int(num_new.max()) <= q_per_seq and pad_to >= n
        cu_q = np.arange(n + 1, dtype=np.int64) * q_per_seq
        step = np.tile(np.arange(q_per_seq), n)
        real = step < np.repeat(num_new, q_per_seq)
        # Padding repeats the entry's last real position (a valid one for every lookup).
        positions = np.repeat(start, q_per_seq) + np.minimum(step, np.repeat(num_new - 1,
                                                                             q_per_seq))
        row_rep = np.repeat(rows, q_per_seq)
        seq_lens = start + q_per_seq  # the queries are the last q_per_seq positions
    ids = table.tokens[row_rep, positions]
    slots = table.block_tables[row_rep, positions // block_size] * block_size + (
        positions % block_size)
    offsets = cu_q[:n].copy()
    decode, max_q = bool((num_new == 1).all()), int(num_new.max())
    if pad_to is not None:
        extra = (pad_to - n) * q_per_seq
        ids = np.concatenate([ids, np.zeros(extra, ids.dtype)])
        positions = np.concatenate([positions, np.zeros(extra, np.int64)])
        slots = np.concatenate([np.where(real, slots, -1), np.full(extra, -1, slots.dtype)])
        cu_q = np.arange(pad_to + 1, dtype=np.int64) * q_per_seq
        seq_lens = np.concatenate([seq_lens, np.full(pad_to - n, q_per_seq, np.int64)])
        tables = np.concatenate([tables, np.zeros((pad_to - n, width), np.int32)])
        decode, max_q = True, q_per_seq
    cu_k = np.zeros(len(seq_lens) + 1, np.int64)
    np.cumsum(seq_lens, out=cu_k[1:])
    return TokenLayout(ids, positions, slots, cu_q, seq_lens, cu_k, tables, offsets,
                       offsets + num_new - 1, max_q, int(end.max()), decode,
                       q_per_seq if pad_to is not None else 1)


def _lay_out_decode(table: SequenceTable, rows: np.ndarray, start: np.ndarray,
                    block_size: int, width: int, pad_to: int,
                    staged: Staged | None = None) -> TokenLayout:
    """lay_out of a decode graph's step (one token per entry), written straight into arrays
    of the padded size, or into the graph's staged inputs (int32): at batch 1 the general
    path's few dozen numpy calls, and copying its arrays into the segments, are a visible
    part of a step's host work."""
    n = len(rows)
    if staged is None:
        ids, positions, slots = (np.empty(pad_to, np.int64) for _ in range(3))
        cu_q, seq_lens, cu_k = (np.empty(size, np.int64) for size in (pad_to + 1, pad_to,
                                                                       pad_to + 1))
        tables = np.empty((pad_to, width), np.int32)
    else:
        ids, positions, slots, cu_q, seq_lens, cu_k = (
            staged.whole(name) for name in PART_NAMES[:-1])
        tables = (staged.part("tables", pad_to * width) if staged.inputs.tail == "tables"
                  else staged.whole("tables")).reshape(pad_to, width)
    ids[:n] = table.tokens[rows, start]
    ids[n:] = 0
    positions[:n] = start
    positions[n:] = 0
    slots[:n] = table.block_tables[rows, start // block_size] * block_size + start % block_size
    slots[n:] = -1
    cu_q[:] = np.arange(pad_to + 1)
    seq_lens[:n] = start + 1
    seq_lens[n:] = 1
    cu_k[0] = 0
    np.cumsum(seq_lens, out=cu_k[1:])
    tables[:n] = table.block_tables[rows, :width]
    tables[n:] = 0
    offsets = np.arange(n, dtype=np.int64)
    return TokenLayout(ids, positions, slots, cu_q, seq_lens, cu_k, tables, offsets, offsets,
                       1, int(start.max()) + 1, True, 1)


def pad_ragged(layout: TokenLayout, entries: int, tokens: int) -> TokenLayout:
    """The ragged layout grown to `entries` entries (empty ones added) plus one entry that
    holds the padding up to `tokens` tokens: a prefill of its own from position 0 over block
    0 of the cache, storing nothing. Real entries keep their tokens' places."""
    n, real = len(layout.offsets), len(layout.ids)
    pad, empty = tokens - real, entries - n
    assert pad >= 0 and empty >= 0
    seq_lens = np.concatenate([layout.seq_lens, np.zeros(empty, np.int64), [pad]])
    cu_k = np.zeros(len(seq_lens) + 1, np.int64)
    np.cumsum(seq_lens, out=cu_k[1:])
    width = layout.tables.shape[1]
    return TokenLayout(
        ids=np.concatenate([layout.ids, np.zeros(pad, layout.ids.dtype)]),
        positions=np.concatenate([layout.positions, np.zeros(pad, np.int64)]),
        slots=np.concatenate([layout.slots, np.full(pad, -1, layout.slots.dtype)]),
        cu_q=np.concatenate([layout.cu_q, np.full(empty, real, np.int64), [tokens]]),
        seq_lens=seq_lens, cu_k=cu_k,
        tables=np.concatenate([layout.tables, np.zeros((empty + 1, width), np.int32)]),
        offsets=layout.offsets, last=layout.last, max_q=max(layout.max_q, pad),
        max_k=max(layout.max_k, pad), decode=False, q_per_seq=1)

