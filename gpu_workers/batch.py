"""Turn one step's entries into device inputs for a unified extend batch.

Every entry computes tokens [num_computed, num_computed + num_new) of its sequence, so prefill,
chunked prefill, prefix-cache hits and decode share one layout. Everything is gathered with
numpy from the mirror's columns, packed into a single int32 buffer and copied to the device
with one non-blocking copy from pinned memory (the caching host allocator keeps that memory
alive until the copy has finished, so the next step cannot overwrite it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.mirror import SequenceTable
from gpu_workers.penalties import gather_penalties
from gpu_workers.sampler import SamplingBatch, row_seed
from gpu_workers.transfer import to_device


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


def build_batch(table: SequenceTable, rows: np.ndarray, num_new: np.ndarray, block_size: int,
                device: torch.device, pad_to: int | None = None,
                block_width: int | None = None,
                num_verify: np.ndarray | None = None, q_per_seq: int = 1) -> StepBatch:
    """num_verify: per entry, how many of its num_new tokens are proposals to verify (they
    sit in the mirror past its known tokens); such an entry needs logits at each of its last
    1 + num_verify positions, each sampled with the entry's parameters.

    pad_to (CUDA graphs, every entry computing at most q_per_seq tokens): every entry is laid
    out as q_per_seq tokens, its own then padding, and the batch is padded to pad_to entries.
    Padding stores nothing (slot -1) and its outputs are never read."""
    n = len(rows)
    start = table.num_computed[rows]
    end = start + num_new
    width = block_width or max(1, int((end.max() + block_size - 1) // block_size))
    tables = table.block_tables[rows, :width]
    if pad_to is None:
        cu_q = np.zeros(n + 1, np.int64)
        np.cumsum(num_new, out=cu_q[1:])
        positions = np.arange(int(cu_q[-1]), dtype=np.int64) - np.repeat(cu_q[:-1] - start,
                                                                          num_new)
        row_rep, real, seq_lens = np.repeat(rows, num_new), None, end
    else:
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
    last = offsets + num_new - 1  # each entry's last real token
    decode = pad_to is not None or bool(np.all(num_new == 1))
    max_q, max_k = int(num_new.max()), int(end.max())
    if pad_to is not None:
        assert int(num_new.max()) <= q_per_seq
        slots = np.where(real, slots, -1)
        extra = (pad_to - n) * q_per_seq
        ids = np.concatenate([ids, np.zeros(extra, ids.dtype)])
        positions = np.concatenate([positions, np.zeros(extra, np.int64)])
        slots = np.concatenate([slots, np.full(extra, -1, slots.dtype)])
        cu_q = np.arange(pad_to + 1, dtype=np.int64) * q_per_seq
        seq_lens = np.concatenate([seq_lens, np.full(pad_to - n, q_per_seq, np.int64)])
        tables = np.concatenate([tables, np.zeros((pad_to - n, width), np.int32)])
        max_q = q_per_seq
    cu_k = np.zeros(len(seq_lens) + 1, np.int64)
    np.cumsum(seq_lens, out=cu_k[1:])

    known_end = end if num_verify is None else end - num_verify
    samples = known_end == table.num_tokens[rows]
    sample_entries = np.flatnonzero(samples)
    logits_idx = last[samples]
    sample_rows = rows[samples]
    counts = steps = None
    logit_rows = sample_rows
    if num_verify is not None:
        counts = num_verify[samples] + 1
        steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_idx = np.repeat(logits_idx - counts + 1, counts) + steps
        logit_rows = np.repeat(sample_rows, counts)
    temp = table.temperature[logit_rows]
    top_k = table.top_k[logit_rows]
    top_p = table.top_p[logit_rows]
    min_p = table.min_p[logit_rows]

    parts = [ids, positions, slots, cu_q, seq_lens, cu_k, tables.reshape(-1), logits_idx,
             top_k, temp.view(np.int32), top_p.view(np.int32), min_p.view(np.int32)]
    # Every segment starts 16-byte aligned: Triton specialises kernels on pointer alignment,
    # and a varying alignment would compile new kernel variants in the middle of serving.
    sizes = [len(p) for p in parts]
    padded = [-(-n // 4) * 4 for n in sizes]
    flat = np.zeros(sum(padded), np.int32)
    offset = 0
    for p, n, pn in zip(parts, sizes, padded, strict=True):
        flat[offset:offset + n] = p
        offset += pn
    dev = to_device(flat, device)
    views = [v[:n] for v, n in zip(dev.split(padded), sizes, strict=True)]
    (d_ids, d_pos, d_slots, d_cu_q, d_lens, d_cu_k, d_tables, d_logits,
     d_top_k, d_temp, d_top_p, d_min_p) = views
    attn = AttentionBatch(
        slot_mapping=d_slots, block_tables=d_tables.view(len(seq_lens), width),
        cu_seqlens_q=d_cu_q, seq_lens_k=d_lens, cu_seqlens_k=d_cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, decode=decode,
        q_per_seq=q_per_seq if pad_to is not None else 1,
    )
    sampling = None
    if len(sample_rows):
        greedy = temp == 0
        random_rows = ~greedy
        seeded = []
        for i in np.flatnonzero(random_rows & (table.seed[logit_rows] >= 0)):
            r = logit_rows[i]
            generated = int(table.num_tokens[r] - table.num_prompt[r])
            if steps is not None:  # a verified position draws as its token would unspeculated
                generated += int(steps[i])
            seeded.append((int(i), row_seed(int(table.seed[r]), generated)))
        sampling = SamplingBatch(
            temperature=d_temp.view(torch.float32), top_k=d_top_k,
            top_p=d_top_p.view(torch.float32), min_p=d_min_p.view(torch.float32),
            all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            max_top_k=int(top_k[random_rows].max(initial=0)),
            use_top_p=bool(np.any(top_p[random_rows] < 1.0)),
            use_min_p=bool(np.any(min_p[random_rows] > 0.0)),
            seeded=seeded, logprobs=bool(table.logprobs[sample_rows].any()),
            # Speculation refuses penalties (admission): logit_rows is sample_rows here.
            penalties=gather_penalties(table, logit_rows, device),
            top_logprobs=int(table.top_logprobs[sample_rows].max(initial=0)),
        )
    return StepBatch(d_ids, d_pos, attn, d_logits, sample_entries, sample_rows, sampling, n,
                     token_offsets=offsets, logit_counts=counts)
