"""The token bitmask's trip from the grammar matchers to the logits: host rows the matchers
fill, one copy of the rows filled, xgrammar's in-place apply kernel on the logits' device.

A plain step fills one compact row per constrained entry (rows 0..k-1), so a batch with few
constrained rows copies few rows; where those entries are not the logits' first k rows, the
rows are scattered on the device into a buffer laid out like the logits. The entries' row
numbers travel from a pinned buffer too (given a Python list, xgrammar would build a pageable
tensor and copy it every step). The host buffers are pinned on CUDA and reused: before the
host writes them again it waits for the event recorded after their last copy, which has
normally long passed (the step in flight is settled before a constrained step's masks).

On CUDA the row count is padded to a multiple of 16 by repeating the last row (masking a row
twice changes nothing): Triton specialises an integer argument on being 1 or a multiple of
16, so every step runs one kernel variant: the first constrained step compiles it (once per
Triton cache), as the first structured request loads the grammar compiler; start-up does not,
since importing xgrammar (and transformers with it) cost every start seconds. A benchmark
that times steady-state steps compiles it ahead with `TokenBitmask.warm_up`.
"""

from __future__ import annotations

import torch

PAD = 16
"""On CUDA the apply kernel always sees a multiple of this many rows."""


class TokenBitmask:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.width = -(-vocab_size // 32)
        """int32 words per row (xgrammar's get_bitmask_shape)."""
        self._host: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._scattered: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def rows(self, n: int, device: torch.device) -> torch.Tensor:
        """The host rows 0..n-1 to fill, once their last copy to the device is done."""
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host
        if host is None or host.shape[0] < n:
            host = torch.full((max(n, 64), self.width), -1, dtype=torch.int32,
                              pin_memory=device.type == "cuda")
            self._host = host
        return host[:n]

    def apply(self, logits: torch.Tensor, indices: list[int], compact: bool) -> None:
        """Mask logits row indices[i] by host row i (compact) or by host row indices[i]."""
        import xgrammar as xgr

        device, k = logits.device, len(indices)
        cuda = device.type == "cuda"
        rows = indices + [indices[-1]] * (-k % PAD) if cuda else indices
        index = self._index_rows(len(rows), cuda)
        index.numpy()[:] = rows
        index = index.to(device, non_blocking=True)
        source = self._host[:k if compact else logits.shape[0]].to(device, non_blocking=True)
        if cuda:
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
        mask = source
        if compact and indices != list(range(k)):
            mask = self._scatter_rows(logits.shape[0], device)
            mask.index_copy_(0, index[:k].long(), source)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=index)

    def warm_up(self, device: torch.device, dtype: torch.dtype, row_stride: int) -> None:
        """Compile the apply kernel for logits of `dtype` whose rows lie `row_stride` apart
        (CUDA; nothing to do on the CPU), and fill the buffers' first sizes."""
        if device.type != "cuda":
            return
        logits = torch.zeros(2, row_stride, dtype=dtype, device=device)[:, :self.vocab_size]
        self.rows(1, device).fill_(-1)
        self.apply(logits, [1], compact=True)
        torch.cuda.synchronize(device)

    def _index_rows(self, n: int, cuda: bool) -> torch.Tensor:
        index = self._index
        if index is None or index.shape[0] < n:
            index = torch.zeros(max(n, 64), dtype=torch.int32, pin_memory=cuda)
            self._index = index
        return index[:n]

    def _scatter_rows(self, n: int, device: torch.device) -> torch.Tensor:
        buf = self._scattered
        if buf is None or buf.shape[0] < n or buf.device != device:
            buf = torch.empty((max(n, 64), self.width), dtype=torch.int32, device=device)
            self._scattered = buf
        return buf[:n]
