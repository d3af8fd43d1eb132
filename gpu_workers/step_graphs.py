"""Every CUDA graph of the target model, and which one (if any) runs a step.

- decode: every entry computes one token (gpu_workers.decode_graphs, bucketed entry counts);
- verify: every entry decodes and verifies up to K speculative proposals, laid out as 1 + K
  tokens each (the same class with q_per_seq = 1 + K; only with speculation on);
- prefill: a few entries and up to a couple of thousand tokens in all
  (gpu_workers.prefill_graphs), which a single request's prompt usually is.
All share one memory pool: they run one at a time, in stream order.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from gpu_workers.config import WorkerConfig
from gpu_workers.decode_graphs import DecodeGraphs, SampleFn
from gpu_workers.graph_bitmask import MaskedSampleFn
from gpu_workers.prefill_graphs import PrefillGraphs

GraphKey = int | tuple[int, int]


class StepGraphs:
    def __init__(self, model: torch.nn.Module, config: WorkerConfig, device: torch.device,
                 progress: Callable[[str], None], sample: SampleFn | None = None,
                 masked: MaskedSampleFn | None = None, vocab_size: int = 0,
                 capture: bool = True) -> None:
        """sample: how decode steps' rows become tokens, captured after each decode graph
        (gpu_workers.decode_graphs); None keeps sampling out of the graphs. masked: the
        same under a token bitmask of vocab_size tokens (steps with constrained rows).
        capture=False: the graphs' inputs only, for warm_ups."""
        c = config
        progress("capturing CUDA graphs for decode")
        self.decode = DecodeGraphs(model, c.max_num_seqs, c.max_blocks_per_seq,
                                   c.max_model_len, device, sample=sample, masked=masked,
                                   vocab_size=vocab_size)
        if capture:
            self.decode.capture()
        self.pool = self.decode.pool
        self.verify: DecodeGraphs | None = None
        if c.speculative and c.num_speculative_tokens:
            progress("capturing CUDA graphs for verifying proposals")
            self.verify = DecodeGraphs(model, c.max_num_seqs, c.max_blocks_per_seq,
                                       c.max_model_len, device,
                                       q_per_seq=c.num_speculative_tokens + 1)
            if capture:
                self.verify.capture(self.pool)
        progress("capturing CUDA graphs for small prefills")
        self.prefill = PrefillGraphs(model, c.max_num_seqs,
                                     min(c.max_num_batched_tokens, c.max_model_len),
                                     c.max_blocks_per_seq, c.max_model_len, device)
        if capture:
            self.prefill.capture(self.pool)

    def warm_ups(self) -> list[Callable[[], object]]:
        """Each graph's forward (and decode sampling) once, as its capture runs it first,
        one callable per graph: start-up's kernel recording launches them."""
        runs: list[Callable[[], object]] = [partial(self.decode.warm_up, bs, sample=True)
                                            for bs in self.decode.sizes]
        if self.verify is not None:
            runs += [partial(self.verify.warm_up, bs) for bs in self.verify.sizes]
        return runs + [partial(self.prefill.warm_up, key) for key in self.prefill.inputs]

    def select(self, num_new: np.ndarray, run_new: np.ndarray
               ) -> tuple[DecodeGraphs | PrefillGraphs | None, GraphKey | None]:
        """The graphs that can run a step whose entries compute run_new tokens (num_new of
        them known, the rest proposals), and the captured size to pad it to."""
        n = len(num_new)
        if n == 0:
            return None, None
        if (run_new == 1).all():
            graphs = self.decode
        elif (self.verify is not None and (num_new == 1).all()
              and int(run_new.max()) <= self.verify.q_per_seq):
            graphs = self.verify
        else:
            key = self.prefill.bucket(n, int(run_new.sum()))
            return (None, None) if key is None else (self.prefill, key)
        key = graphs.bucket(n)
        return (None, None) if key is None else (graphs, key)
