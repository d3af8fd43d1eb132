"""The decode graphs' token bitmask: a fixed device buffer the constrained sampling graph reads.

A decode step with constrained rows samples in a graph of its own size (the LM head, the
mask apply and the one-pass sampler; gpu_workers.decode_graphs), which reads the mask at the
address it was captured with. This buffer is that address: xgrammar's packed int32 words, one
row per entry of the step (row i belongs to entry i, not compact as the eager path's rows),
sized for the largest batch. The matchers fill host rows in place; every other row of the
step (an unconstrained entry, a finished grammar, padding) is all ones, which masks nothing.
Only the rows filled by the previous step are reset, so a step writes what changed, then
one copy sends its size's rows.

The apply is xgrammar's kernel, as in the eager path, with fixed row indices per size padded
to a multiple of 16 by repeating the last row (gpu_workers.token_bitmask): the variant that
start-up's warm-up compiled, so capturing a size compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gpu_workers.token_bitmask import PAD

MaskedSampleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor], torch.Tensor]
"""(hidden [R, H], inverse temperatures [R] float32, seeds [R] int64, bitmask [R, W] int32,
row indices [P] int32) -> token ids [R]: sampling under the mask."""


def apply_rows(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor,
               vocab_size: int) -> None:
    """Set logits[i, t] = -inf where bit t of bitmask[i] is 0, for the rows i in indices."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices)


def padded_rows(bs: int) -> np.ndarray:
    """Rows 0..bs-1, the last repeated up to a multiple of PAD (masking twice changes nothing)."""
    rows = np.arange(-(-bs // PAD) * PAD, dtype=np.int32)
    return np.minimum(rows, bs - 1)


class GraphBitmask:
    def __init__(self, max_bs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.width = -(-vocab_size // 32)
        """int32 words per row (xgrammar's get_bitmask_shape)."""
        self.rows = torch.full((max_bs, self.width), -1, dtype=torch.int32, device=device)
        """The device rows the graphs read: rows[:bs] for the graph of size bs."""
        self._host = torch.full((max_bs, self.width), -1, dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self._filled = np.zeros(max_bs, bool)
        """Host rows that hold a mask (the others are all ones)."""
        self._copied: torch.cuda.Event | None = None
        self._indices: dict[int, torch.Tensor] = {}

    def host(self) -> torch.Tensor:
        """The host rows, for the matchers to fill row i for entry i, once their last copy
        to the device is done."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def send(self, bs: int, filled: list[int]) -> None:
        """Reset the rows that held a mask but were not filled now (`filled`: this step's),
        then copy the first bs rows to the device (queued on the current stream)."""
        stale = self._filled.copy()
        stale[filled] = False
        if stale.any():
            self._host.numpy()[stale] = -1
        self._filled[:] = False
        self._filled[filled] = True
        self.rows[:bs].copy_(self._host[:bs], non_blocking=True)
        if self.rows.device.type == "cuda":
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()

    def indices(self, bs: int) -> torch.Tensor:
        """The row indices the graph of size bs applies (made once, on the device)."""
        index = self._indices.get(bs)
        if index is None:
            index = torch.from_numpy(padded_rows(bs)).to(self.rows.device)
            self._indices[bs] = index
        return index
