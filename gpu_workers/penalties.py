"""Repetition, frequency and presence penalties: logits of tokens a request has already seen.

Semantics, applied to the raw logits before temperature and the filters (as vLLM does):
  1. repetition (transformers' CTRL penalty): every token in the prompt or the output has a
     positive logit divided by the penalty and a negative one multiplied by it;
  2. frequency (OpenAI): minus the penalty times the number of times the token was generated;
  3. presence (OpenAI): minus the penalty once if the token was generated at all.

The token histories come from the worker's mirror, gathered only for the rows that use a
penalty and only on steps that have one, so batches without penalties pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_workers.sequence_table import SequenceTable
from gpu_workers.transfer import to_device


@dataclass(slots=True)
class PenaltyBatch:
    rows: torch.Tensor
    """[P] int64: which rows of the sampling batch have a penalty."""
    prompt_tokens: torch.Tensor
    """[P, Lp] int64 prompt ids, -1 padded (zero width when no row uses repetition)."""
    output_tokens: torch.Tensor
    """[P, Lo] int64 generated ids, -1 padded."""
    presence: torch.Tensor
    """[P] float32."""
    frequency: torch.Tensor
    """[P] float32."""
    repetition: torch.Tensor
    """[P] float32."""


def _padded(table: SequenceTable, rows: np.ndarray, start: np.ndarray,
            end: np.ndarray) -> np.ndarray:
    """tokens[row, start:end] of each row, right-padded with -1."""
    width = int((end - start).max(initial=0))
    idx = start[:, None] + np.arange(width)[None, :]
    valid = idx < end[:, None]
    out = table.tokens[rows[:, None], np.minimum(idx, table.max_tokens - 1)].astype(np.int64)
    out[~valid] = -1
    return out


def gather_penalties(table: SequenceTable, sample_rows: np.ndarray,
                     device: torch.device) -> PenaltyBatch | None:
    """The histories of the sampling rows that use a penalty, or None when none does."""
    presence = table.presence[sample_rows]
    frequency = table.frequency[sample_rows]
    repetition = table.repetition[sample_rows]
    active = np.flatnonzero(table.uses_penalties(sample_rows))
    if len(active) == 0:
        return None
    rows = sample_rows[active]
    num_prompt, num_tokens = table.num_prompt[rows], table.num_tokens[rows]
    uses_repetition = bool(np.any(repetition[active] != 1))
    prompt_end = num_prompt if uses_repetition else np.zeros_like(num_prompt)
    prompt = _padded(table, rows, np.zeros_like(num_prompt), prompt_end)
    output = _padded(table, rows, num_prompt, num_tokens)

    return PenaltyBatch(
        rows=to_device(active.astype(np.int64), device), prompt_tokens=to_device(prompt, device),
        output_tokens=to_device(output, device), presence=to_device(presence[active], device),
        frequency=to_device(frequency[active], device),
        repetition=to_device(repetition[active], device))


def _counts(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[P, L] ids (-1 = padding) -> [P, vocab] occurrence counts."""
    idx = torch.where(tokens < 0, vocab, tokens)
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=dtype, device=tokens.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, p: PenaltyBatch) -> torch.Tensor:
    """[R, V] float logits -> a new tensor with the penalized rows changed."""
    vocab = logits.shape[1]
    x = logits.index_select(0, p.rows)
    generated = _counts(p.output_tokens, vocab, x.dtype)
    seen = (generated > 0) | (_counts(p.prompt_tokens, vocab, x.dtype) > 0)
    rep = p.repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - p.frequency[:, None] * generated - p.presence[:, None] * (generated > 0).to(x.dtype)
    return logits.index_copy(0, p.rows, x)
