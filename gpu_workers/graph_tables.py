"""The full-width block table a set of CUDA graphs reads, and how a step's compact one gets
into it.

A graph's kernels read their block tables at the row stride they were captured with, so the
table a graph reads is as wide as max_model_len allows. A step's inputs carry the table only
as wide as its longest context needs (its row stride in a "width" segment, the tables last so
the one host-to-device copy stops where they end: gpu_workers.static_inputs), and the graph's
first kernel widens it into this table (kernels.widen_tables). So the host's fill, the copy
and that kernel cost what the step's contexts are, and one graph per batch size still serves
every width: capturing a graph per width bucket would multiply the graphs and their capture
time by the number of buckets.
"""

from __future__ import annotations

import torch

from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.static_inputs import into_static
from gpu_workers.token_layout import layout_inputs
from kernels.widen_tables import widen_tables


class WideTables:
    """One [rows, max_width] int32 table shared by graphs that run one at a time (in stream
    order): each replay rewrites the columns its step reads before reading them."""

    def __init__(self, rows: int, max_width: int, device: torch.device) -> None:
        self.max_width = max_width
        self.table = torch.zeros(rows, max_width, dtype=torch.int32, device=device)
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, n: int) -> torch.Tensor:
        """The first n rows (kept once made: the graphs are captured on these views)."""
        view = self._rows.get(n)
        if view is None:
            view = self._rows[n] = self.table[:n]
        return view

    def widen(self, views: dict[str, torch.Tensor], n: int) -> None:
        """Inside a graph: the step's compact tables (views "tables", "width") into rows[:n]."""
        widen_tables(views["tables"], views["width"], self.rows(n))


def copy_in(views: dict[str, torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor,
            a: AttentionBatch) -> None:
    """A step built outside a graph's static inputs, copied into them: its tables (any width
    up to the graph's) fill the segment's start and the width segment says how wide."""
    into_static(views, layout_inputs(input_ids, positions, a))
    if a.block_tables.data_ptr() != views["tables"].data_ptr():
        views["width"].fill_(a.block_tables.shape[1])
