"""Sampling inside the decode CUDA graphs: which steps may, and the function they capture.

A decode step of a small model costs the host more than the device (`nanopipe profile host`):
outside a graph, its sampling is a dozen torch ops and two Triton launches after the forward.
With one tensor-parallel rank and the one-pass sampler, each decode graph size also captures
the LM head and the sampler (gpu_workers.decode_graphs); a step takes that path when every
entry samples and its rows need nothing but temperature and seeds. That is decided from the
mirror's columns before the batch is built, so the sampler's inputs travel in the batch's
one copy. A step with constrained rows (structured outputs) takes the same path when the
graphs can mask: its size's constrained variant also applies the token bitmask the matchers
filled (gpu_workers.graph_bitmask) between the LM head and the sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_workers.batch import seeded_draws
from gpu_workers.decode_graphs import DecodeGraphs, SampleFn
from gpu_workers.grammar_book import GrammarBook
from gpu_workers.graph_bitmask import MaskedSampleFn, apply_rows
from gpu_workers.sampler import Sampler
from gpu_workers.sequence_table import SequenceTable
from kernels.sampling import sample_from_logits


def graph_sample_fn(model: torch.nn.Module, sampler: Sampler, world_size: int
                    ) -> SampleFn | None:
    """What the decode graphs capture after the forward, or None where they cannot: several
    ranks (logits are assembled on rank 0 only), or no one-pass kernel (no Triton)."""
    if world_size > 1 or not sampler.one_pass:
        return None

    def sample(hidden: torch.Tensor, inv_temperature: torch.Tensor,
               seeds: torch.Tensor) -> torch.Tensor:
        return sample_from_logits(model.compute_logits(hidden), inv_temperature, seeds)

    return sample


def graph_masked_sample_fn(model: torch.nn.Module, sampler: Sampler, world_size: int,
                           vocab_size: int) -> MaskedSampleFn | None:
    """What a decode size's constrained sampling graph captures: graph_sample_fn's LM head
    and sampler with the token bitmask applied between them, as the eager path applies it
    (the same kernel, so the same logits and tokens); None where graph_sample_fn is."""
    if world_size > 1 or not sampler.one_pass:
        return None

    def sample(hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
               bitmask: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        logits = model.compute_logits(hidden)
        apply_rows(logits, bitmask, indices, vocab_size)
        return sample_from_logits(logits, inv_temperature, seeds)

    return sample


def graph_samplers(model: torch.nn.Module, sampler: Sampler, world_size: int,
                   masks: bool) -> dict[str, Any]:
    """StepGraphs' sampling arguments: graph_sample_fn's, and where grammars are held
    (masks: rank 0) graph_masked_sample_fn's for constrained steps."""
    vocab = model.config.vocab_size
    masked = graph_masked_sample_fn(model, sampler, world_size, vocab) if masks else None
    return dict(sample=graph_sample_fn(model, sampler, world_size), masked=masked,
                vocab_size=vocab)


def graph_sample_inputs(graphs: object, table: SequenceTable, rows: np.ndarray,
                        num_new: np.ndarray, sampler: Sampler) -> dict[str, np.ndarray] | None:
    """The sampling graph's inputs for a step the decode graphs run (build_batch's `extra`),
    or None when it samples outside: another kind of graph, an entry that does not sample
    (its rows would not be the first ones), rows that need more than the kernel, or
    constrained rows the graphs cannot mask."""
    if not isinstance(graphs, DecodeGraphs) or not graphs.samples:
        return None
    if not graphs.masks and table.constrained[rows].any():
        return None
    if not (table.num_computed[rows] + num_new == table.num_tokens[rows]).all():
        return None
    return sample_inputs(table, rows, sampler)


def sample_inputs(table: SequenceTable, rows: np.ndarray, sampler: Sampler
                  ) -> dict[str, np.ndarray] | None:
    """For rows the one-pass kernel draws alone (no penalties, filters or logprobs; a grammar's
    mask is applied before it, see graph_sample_inputs): each row's inverse temperature (0:
    greedy) and seed (a seeded row's own, as the sampler would draw it; fresh draws of the
    engine's generator for the others), as int32 views; None for any other rows."""
    if not sampler.one_pass or not table.plain_draw[rows].all():
        return None
    inv = table.inv_temperature[rows]
    random = inv > 0
    if random.any():
        seeds = sampler.draw_seeds(len(rows))
        for i, seed in seeded_draws(table, rows, random):
            seeds[i] = seed
    else:  # greedy rows read no seed (and the engine's generator is left as it is)
        seeds = np.zeros(len(rows), np.int64)
    return {"inv_temperature": inv.view(np.int32), "seeds": seeds.view(np.int32)}


def graph_tokens(graphs: DecodeGraphs, bs: int, rows: np.ndarray, table: SequenceTable,
                 grammars: GrammarBook | None, constrained: np.ndarray | None) -> torch.Tensor:
    """A decode step's tokens from its size's sampling graph (after DecodeGraphs.run); with
    constrained entries (their matchers up to date), the graph that applies their bitmask,
    filled here."""
    if constrained is None:
        return graphs.sample_step(bs, len(rows))
    grammars.fill_graph_rows(graphs.bitmask, bs, rows, table.epoch[rows], constrained)
    return graphs.sample_step(bs, len(rows), masked=True)
