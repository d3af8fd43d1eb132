"""Turn one step's entries into device inputs: its tokens (gpu_workers.token_layout), the
rows whose logits are needed and their sampling parameters.

Everything is gathered with numpy from the mirror's columns, packed into a single int32
buffer and copied to the device with one non-blocking copy from pinned memory (the caching
host allocator keeps that memory alive until the copy has finished, so the next step cannot
overwrite it): into fresh memory, or, for a step a CUDA graph runs, straight into the
graph's static inputs (gpu_workers.static_inputs), so the replay needs no copies of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.penalties import gather_penalties
from gpu_workers.sampler import SamplingBatch, row_seed
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.static_inputs import StaticInputs, send_named
from gpu_workers.token_layout import PART_NAMES, lay_out, needed_width, pad_ragged


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionBatch
    logits_indices: torch.Tensor
    """[R] rows of the hidden states whose logits are needed (entries that sample)."""
    sample_entries: np.ndarray
    """Indices (into this step's entries) of the entries that sample, in logits order."""
    sample_rows: np.ndarray
    """Their mirror rows."""
    sampling: SamplingBatch | None
    num_entries: int
    """Real entries; the batch may be padded beyond this to a CUDA-graph size."""
    token_offsets: np.ndarray | None = None
    """[entries] where each entry's tokens start in input_ids."""
    logit_counts: np.ndarray | None = None
    """Speculation: logits rows per sampling entry (1 + its proposals); None: one each."""
    extra: dict[str, torch.Tensor] | None = None
    """The caller's own arrays (build_batch's `extra`), on the device."""


def build_batch(table: SequenceTable, rows: np.ndarray, num_new: np.ndarray, block_size: int,
                device: torch.device, pad_to: int | None = None,
                block_width: int | None = None,
                num_verify: np.ndarray | None = None, q_per_seq: int = 1,
                prefill_pad: tuple[int, int] | None = None,
                into: StaticInputs | None = None,
                extra: dict[str, np.ndarray] | None = None, sample: bool = True) -> StepBatch:
    """num_verify: per entry, how many of its num_new tokens are proposals to verify (they
    sit in the mirror past its known tokens); such an entry needs logits at each of its last
    1 + num_verify positions, each sampled with the entry's parameters.

    pad_to (CUDA graphs, every entry computing at most q_per_seq tokens): every entry is laid
    out as q_per_seq tokens, its own then padding, and the batch is padded to pad_to entries.
    Padding stores nothing (slot -1) and its outputs are never read. prefill_pad (entries,
    tokens): the ragged layout padded for a prefill graph (token_layout.pad_ragged).
    block_width: the block tables' columns; None: as many as the step's contexts need.
    into: the static inputs of the graph that runs the step. extra: more int32 arrays
    (other 4-byte values viewed as int32) that travel in the same copy (StepBatch.extra).
    sample=False: the step's tokens are drawn inside its graph (gpu_workers.graph_sampling),
    so no sampling parameters travel and StepBatch.sampling stays None."""
    n = len(rows)
    start = table.num_computed[rows]
    end = start + num_new
    staged = None if into is None else into.stage()
    if prefill_pad is not None and block_width is None:  # the padding entry's keys too
        pad = prefill_pad[1] - int(num_new.sum())
        block_width = min(table.max_blocks, needed_width(max(int(end.max()), pad), block_size))
    layout = lay_out(table, rows, start, num_new, block_size, block_width, pad_to, q_per_seq,
                     staged)
    if prefill_pad is not None:
        layout = pad_ragged(layout, *prefill_pad)

    known_end = end if num_verify is None else end - num_verify
    samples = known_end == table.num_tokens[rows]
    sample_entries = samples.nonzero()[0]
    logits_idx = layout.last[samples]
    sample_rows = rows[samples]
    counts = steps = None
    logit_rows = sample_rows
    if num_verify is not None:
        counts = num_verify[samples] + 1
        steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_idx = np.repeat(logits_idx - counts + 1, counts) + steps
        logit_rows = np.repeat(sample_rows, counts)
    written = staged is not None and PART_NAMES[0] in staged.lengths  # laid out in place
    arrays = {} if written else layout.named_parts()
    arrays["logits"] = logits_idx
    if sample:
        arrays |= dict(top_k=table.top_k[logit_rows],
                       temperature=table.temperature[logit_rows].view(np.int32),
                       top_p=table.top_p[logit_rows].view(np.int32),
                       min_p=table.min_p[logit_rows].view(np.int32))
    if staged is not None and "width" in into.offsets:  # the compact tables' row stride
        arrays["width"] = np.array([layout.tables.shape[1]], np.int32)
    views = send_named(arrays | (extra or {}), device, staged)
    d_ids, d_pos, attn = layout.attention([views[name] for name in PART_NAMES])
    d_logits = views["logits"]
    sampling = None
    if sample and len(sample_rows):
        sampling = _sampling_batch(table, logit_rows, sample_rows, steps, views, device)
    return StepBatch(d_ids, d_pos, attn, d_logits, sample_entries, sample_rows, sampling, n,
                     token_offsets=layout.offsets, logit_counts=counts,
                     extra={name: views[name] for name in extra} if extra else None)


def seeded_draws(table: SequenceTable, rows: np.ndarray, random: np.ndarray,
                 steps: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(index into rows, seed) for each random row of a seeded request: the seed of the token
    it draws now, so a seeded request draws the same tokens however it is batched, sampled
    inside a graph or not. steps: verified positions draw as their tokens would unspeculated."""
    seeded = []
    for i in (random & (table.seed[rows] >= 0)).nonzero()[0]:
        r = rows[i]
        generated = int(table.num_tokens[r] - table.num_prompt[r])
        if steps is not None:
            generated += int(steps[i])
        seeded.append((int(i), row_seed(int(table.seed[r]), generated)))
    return seeded


def _sampling_batch(table: SequenceTable, logit_rows: np.ndarray, sample_rows: np.ndarray,
                    steps: np.ndarray | None, views: dict[str, torch.Tensor],
                    device: torch.device) -> SamplingBatch:
    """What the sampler needs for the logits rows: their parameters on the device (views)
    and, decided on the host, which of its paths the batch takes."""
    temp, top_k = table.temperature[logit_rows], table.top_k[logit_rows]
    greedy = temp == 0
    random_rows = ~greedy
    seeded = seeded_draws(table, logit_rows, random_rows, steps)
    return SamplingBatch(
        temperature=views["temperature"].view(torch.float32), top_k=views["top_k"],
        top_p=views["top_p"].view(torch.float32), min_p=views["min_p"].view(torch.float32),
        all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
        max_top_k=int(top_k[random_rows].max(initial=0)),
        use_top_p=bool(np.any(table.top_p[logit_rows][random_rows] < 1.0)),
        use_min_p=bool(np.any(table.min_p[logit_rows][random_rows] > 0.0)),
        seeded=seeded, logprobs=bool(table.logprobs[sample_rows].any()),
        # Speculation refuses penalties (admission): logit_rows is sample_rows here.
        penalties=gather_penalties(table, logit_rows, device),
        top_logprobs=int(table.top_logprobs[sample_rows].max(initial=0)),
    )
