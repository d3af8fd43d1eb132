"""Sampling inside the decode CUDA graphs: which steps may, and the function they capture.

A decode step of a small model costs the host more than the device (scripts/profile_host.py):
outside a graph, its sampling is a dozen torch ops and two Triton launches after the forward.
With one tensor-parallel rank and the one-pass sampler, each decode graph size also captures
the LM head and the sampler (gpu_workers.cuda_graphs); a step takes that path when every
entry samples and its rows need nothing but temperature and seeds (Sampler.host_inputs).
"""

from __future__ import annotations

import torch

from gpu_workers.batch import StepBatch
from gpu_workers.cuda_graphs import DecodeGraphs, SampleFn
from gpu_workers.mirror import SequenceTable
from gpu_workers.sampler import Sampler
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


def sample_in_graph(graphs: object, key: object, batch: StepBatch, table: SequenceTable,
                    sampler: Sampler) -> torch.Tensor | None:
    """The step's tokens from its size's sampling graph (after the forward graph ran), or
    None when this step samples outside: another kind of graph, an entry that does not
    sample (its rows would not be the first ones), or rows that need more than the kernel."""
    if (not isinstance(graphs, DecodeGraphs) or not graphs.samples or batch.sampling is None
            or len(batch.sample_entries) != batch.num_entries):
        return None
    inputs = sampler.host_inputs(batch.sampling, table.temperature[batch.sample_rows])
    return None if inputs is None else graphs.sample_step(key, *inputs)
