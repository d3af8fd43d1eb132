"""A step's device inputs written in place: one host-to-device copy into buffers that stay put.

A CUDA graph reads its inputs at the addresses it was captured with. Uploading a step's
arrays to fresh device memory and then copying each into the graph's buffers costs a launch
per array, and at batch 1 the host's launch work, not the device, sets a step's pace. Here
every input of a graph size has a fixed segment of one device buffer; a step's arrays are
written into pinned host memory laid out the same way and sent with a single copy, which
the stream orders after the previous step's replay (that step still reads the old values).

A segment sized for the worst case but mostly unused (block tables, as wide as max_model_len
allows) is the `tail`: the last segment, written only as far as the step needs and sent only
that far, so neither the host's fill nor the copy grows with the capacity.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_workers.transfer import staging, upload

ALIGN = 4
"""Segments start on 16-byte boundaries (4 int32): Triton specialises kernels on pointer
alignment, and int64 segments (seeds) need 8."""


WHOLE_COPY_SLACK = 64 << 10
"""Bytes of unwritten tail that are sent anyway: below this, cutting the host and device
buffers to the written end costs more host time than copying the rest (batch 1 pays it)."""


class StaticInputs:
    """Named int32 segments of one device buffer, each with a fixed capacity."""

    def __init__(self, capacities: dict[str, int], device: torch.device,
                 tail: str | None = None) -> None:
        """tail: a segment sent only as far as each step writes it (it must come last)."""
        assert tail is None or list(capacities)[-1] == tail, "the tail segment comes last"
        self.device = device
        self.tail = tail
        self.offsets: dict[str, int] = {}
        self.capacities = dict(capacities)
        end = 0
        for name, capacity in capacities.items():
            self.offsets[name] = end
            end += -(-capacity // ALIGN) * ALIGN
        self.size = end
        self.buffer = torch.zeros(end, dtype=torch.int32, device=device)
        self.views = {name: self.buffer[off:off + capacities[name]]
                      for name, off in self.offsets.items()}
        """Each segment at full capacity: what a graph is captured on (cut as it needs)."""
        self._cuts: dict[tuple[str, int], torch.Tensor] = {}
        self._prefixes: dict[int, torch.Tensor] = {}

    def prefix(self, end: int) -> torch.Tensor:
        """buffer[:end], kept once made (as cut)."""
        view = self._prefixes.get(end)
        if view is None:
            view = self._prefixes[end] = self.buffer[:end]
        return view

    def cut(self, name: str, n: int) -> torch.Tensor:
        """The first n elements of a segment's device view. Kept once made: slicing a
        tensor costs host time on every step, and a segment has at most `capacity` cuts."""
        view = self._cuts.get((name, n))
        if view is None:
            view = self._cuts[(name, n)] = self.views[name][:n]
        return view

    def stage(self) -> Staged:
        """Host memory laid out like the device buffer, for one step's values."""
        return Staged(self, staging((self.size,), torch.int32, self.device))


class Staged:
    """One step's values on the host, written segment by segment, then sent at once."""

    def __init__(self, inputs: StaticInputs, host: torch.Tensor) -> None:
        self.inputs = inputs
        self.host = host
        self.array = host.numpy()
        self.lengths: dict[str, int] = {}

    def segment(self, name: str) -> np.ndarray:
        """The whole segment, to be written in place (int32)."""
        off = self.inputs.offsets[name]
        return self.array[off:off + self.inputs.capacities[name]]

    def whole(self, name: str) -> np.ndarray:
        """The whole segment, for the caller to write in full in place (it is sent whole)."""
        self.lengths[name] = self.inputs.capacities[name]
        return self.segment(name)

    def part(self, name: str, n: int) -> np.ndarray:
        """The tail segment's first n elements, for the caller to write in full in place;
        only they are sent."""
        assert name == self.inputs.tail
        if n > self.inputs.capacities[name]:
            raise ValueError(f"{n} values do not fit segment {name!r}")
        self.lengths[name] = n
        return self.segment(name)[:n]

    def put(self, name: str, values: np.ndarray) -> None:
        """Write a segment's first len(values) elements, converted to int32 (other 4-byte
        values come viewed as int32, int64 ones as pairs), and zero the rest, so readers of the
        full segment (a graph's padding rows) see zeros, not an earlier step's values. The
        tail's rest is left alone: it is not sent."""
        flat = values if values.ndim == 1 else values.reshape(-1)
        off, capacity = self.inputs.offsets[name], self.inputs.capacities[name]
        n = len(flat)
        if n > capacity:
            raise ValueError(f"{n} values do not fit segment {name!r} of {capacity}")
        self.array[off:off + n] = flat
        if n < capacity and name != self.inputs.tail:
            self.array[off + n:off + capacity] = 0
        self.lengths[name] = n

    def send(self) -> dict[str, torch.Tensor]:
        """Copy every segment to the device in one copy (segments not put are zeros; the tail
        only as far as written); the device views of what was put, cut to the lengths written."""
        inputs = self.inputs
        for name in inputs.offsets.keys() - self.lengths.keys() - {inputs.tail}:
            self.segment(name)[:] = 0
        end = inputs.size
        if inputs.tail is not None:
            end = inputs.offsets[inputs.tail] + self.lengths.get(inputs.tail, 0)
        if (inputs.size - end) * 4 <= WHOLE_COPY_SLACK:
            inputs.buffer.copy_(self.host, non_blocking=True)
        else:
            inputs.prefix(end).copy_(self.host[:end], non_blocking=True)
        return {name: inputs.cut(name, n) for name, n in self.lengths.items()}


def send_named(arrays: dict[str, np.ndarray], device: torch.device,
               into: StaticInputs | Staged | None = None) -> dict[str, torch.Tensor]:
    """Arrays to the device as int32 (Staged.put), in one copy: into a graph's static inputs
    when given (staged already, with segments written in place, or not yet), else into fresh
    memory (gpu_workers.transfer.upload)."""
    if into is None:
        views = upload([np.asarray(a).reshape(-1) for a in arrays.values()], device)
        return dict(zip(arrays, views, strict=True))
    staged = into if isinstance(into, Staged) else into.stage()
    for name, values in arrays.items():
        staged.put(name, values)
    return staged.send()


def into_static(views: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
    """Copy each given input into the static segment of its name, unless it is that segment
    already (a batch built into the static inputs needs no copy). A given input shorter than
    its segment (compact block tables) fills the segment's start."""
    for name, src in given.items():
        dst = views[name]
        if src.data_ptr() != dst.data_ptr():
            (dst if src.numel() == dst.numel() else dst[:src.numel()]).copy_(src)
