"""A launched step: what the runner keeps until its sampled tokens reach the host."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_workers.batch import StepBatch
from gpu_workers.sequence_table import SequenceTable
from protocol import StepResult


@dataclass(eq=False)
class PendingStep:
    """A launched step: its sampled ids on the device and, once copied, on the host."""

    step_id: int
    table: SequenceTable
    seq_ids: list[int]
    rows: np.ndarray
    positions: np.ndarray
    epochs: np.ndarray
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    """[R, k] ids and logprobs of the most likely tokens, when a row asked for them."""
    host_tokens: np.ndarray | None = None
    host_logprobs: np.ndarray | None = None
    host_top_ids: np.ndarray | None = None
    host_top_logprobs: np.ndarray | None = None
    event: torch.cuda.Event | None = None
    settled: bool = False
    failures: list[tuple[int, str]] = field(default_factory=list)
    """Sequences the mirror refused in this step, with why (reported, never run)."""
    counts: np.ndarray | None = None
    """Speculation: tokens each entry produced (host arrays then hold them flat)."""
    num_proposed: np.ndarray | None = None
    """Speculation: proposals each entry verified."""
    ended: list[tuple[int, str]] = field(default_factory=list)
    """(seq id, why) of the entries whose requests end here with an error: StepResult's."""

    @classmethod
    def empty(cls, step_id: int, table: SequenceTable,
              failures: list[tuple[int, str]] | None = None) -> PendingStep:
        none = np.zeros(0, np.int64)
        return cls(step_id, table, [], none, none, none, None, None, host_tokens=none,
                   settled=True, failures=failures or [])

    def result(self, gpu_busy_s: float) -> StepResult:
        """Rank 0's StepResult of this step, once its tokens are on the host."""
        return StepResult(
            self.step_id, self.seq_ids, listed(self.host_tokens) or [],
            listed(self.host_logprobs), listed(self.host_top_ids),
            listed(self.host_top_logprobs), failed_seq_ids=[sid for sid, _ in self.failures],
            failed_errors=[error for _, error in self.failures],
            ended_seq_ids=[sid for sid, _ in self.ended],
            ended_errors=[why for _, why in self.ended],
            num_tokens=listed(self.counts), num_proposed=listed(self.num_proposed),
            gpu_busy_s=gpu_busy_s)

    def copy_to_host(self, stream: torch.cuda.Stream | None) -> None:
        """Start the device-to-host copies on `stream`, where the step ran (pinned memory, so
        they do not block); None: the step ran on the CPU and its tensors are the host's."""

        def host(t: torch.Tensor | None) -> np.ndarray | None:
            if t is None:
                return None
            if stream is None:  # a copy as on CUDA: t may be a buffer the next step reuses
                return t.numpy().copy()
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out.numpy()

        self.host_tokens = host(self.tokens)
        self.host_logprobs = host(self.logprobs)
        if self.top is not None:
            self.host_top_ids, self.host_top_logprobs = host(self.top[0]), host(self.top[1])
        if stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def done(self) -> bool:
        """Whether the host copy has arrived (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def pending_patch(table: SequenceTable, rows: np.ndarray, start: np.ndarray,
                  num_new: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of a step whose value the step in flight is still sampling: where each goes in
    the step's input ids (entries start at `offsets`) and where it is in the step in flight's
    tokens (build_batch's `extra`; empty when there are none)."""
    pend = table.pending_pos[rows]
    k = ((pend >= start) & (pend < start + num_new)).nonzero()[0]
    if len(k) == 0:
        return {}
    return {"patch_to": offsets[k] + (pend[k] - start[k]),
            "patch_from": table.pending_slot[rows[k]]}


def patch_in_flight(batch: StepBatch, in_flight: PendingStep) -> None:
    """Copy the values of pending_patch on the device, behind the step in flight's sampling
    and before this step's forward (stream order): no host round trip between the two."""
    if batch.extra is None or "patch_to" not in batch.extra:
        return
    values = in_flight.tokens.index_select(0, batch.extra["patch_from"])
    batch.input_ids.index_put_((batch.extra["patch_to"],), values.to(batch.input_ids.dtype))


class Once:
    """Calls fn the first time it is called, never again (nothing when fn is None)."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def listed(a: np.ndarray | None) -> list | None:
    return None if a is None else a.tolist()
