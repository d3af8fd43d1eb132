"""CUDA graphs for pure-decode batches, one per bucketed batch size, sharing one memory pool.

A decode step of a small model is dominated by kernel launches; replaying a captured graph
turns ~10 launches per layer into one. Inputs are copied into static buffers, the batch is
padded up to the bucket (padding rows store nothing: slot -1), and the captured output
buffer is returned.

With q_per_seq > 1 the graphs run steps that verify speculative proposals: every entry
computes q_per_seq tokens (its last known token and up to q_per_seq - 1 proposals, padded;
gpu_workers.batch lays them out), so a verify step replays one graph like a decode step.

Given a `sample` function, each decode size also gets a second graph that turns the first
one's hidden states into tokens: the LM head and the one-pass sampler, reading each row's
inverse temperature and noise seed from static buffers that one host copy fills. A step
whose rows need nothing more (no penalties, top-k/p, min-p or logprobs) replays both, so
the host launches two graphs instead of a dozen ops and two Triton kernels; any other step
replays the first only and samples as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gpu_workers.layers.attention import AttentionBatch

SampleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(hidden [R, H], inverse temperatures [R] float32, seeds [R] int64) -> token ids [R]."""


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_bs: int, block_width: int,
                 max_model_len: int, device: torch.device, q_per_seq: int = 1,
                 sample: SampleFn | None = None) -> None:
        assert sample is None or q_per_seq == 1, "sampling graphs are for decode steps"
        self.model = model
        self.sample_fn = sample
        self.sizes = bucket_sizes(max_bs)
        self.block_width = block_width
        self.max_model_len = max_model_len
        self.q_per_seq = q = q_per_seq
        i32 = dict(dtype=torch.int32, device=device)
        self.ids = torch.zeros(max_bs * q, **i32)
        self.positions = torch.zeros(max_bs * q, **i32)
        self.slots = torch.full((max_bs * q,), -1, **i32)
        self.seq_lens = torch.full((max_bs,), q, **i32)
        self.cu_q = torch.arange(max_bs + 1, **i32) * q
        self.cu_k = torch.arange(max_bs + 1, **i32)
        self.tables = torch.zeros(max_bs, block_width, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        """Per size, the slices of the input buffers its graph reads (cut once, not per step)."""
        self.pool = None
        self.outputs: dict[int, torch.Tensor] = {}
        # Sampling inputs, one int32 buffer: inverse temperatures (float32 bits), then seeds
        # (int64, 8-byte aligned), so one copy fills both.
        self._seeds_at = -(-max_bs // 2) * 2
        self.sample_in = torch.zeros(self._seeds_at + 2 * max_bs, **i32)
        self.inv_temp = self.sample_in[:max_bs].view(torch.float32)
        self.seeds = self.sample_in[self._seeds_at:].view(torch.int64)
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[int, torch.Tensor] = {}

    @property
    def samples(self) -> bool:
        """Whether sizes have a sampling graph (sample_step)."""
        return bool(self.sample_graphs)

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def layout(self, bs: int) -> dict:
        """How gpu_workers.batch lays a step out for the graph of size bs."""
        return dict(pad_to=bs, q_per_seq=self.q_per_seq)

    def _attn(self, bs: int) -> AttentionBatch:
        return AttentionBatch(
            slot_mapping=self.slots[:bs * self.q_per_seq], block_tables=self.tables[:bs],
            cu_seqlens_q=self.cu_q[: bs + 1], seq_lens_k=self.seq_lens[:bs],
            cu_seqlens_k=self.cu_k[: bs + 1], max_seqlen_q=self.q_per_seq,
            max_seqlen_k=self.max_model_len, decode=True, q_per_seq=self.q_per_seq,
        )

    def capture(self, pool=None) -> None:
        """Capture every size (into `pool`, another set's memory pool, when given)."""
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            attn, t = self._attn(bs), bs * self.q_per_seq
            self.model(self.ids[:t], self.positions[:t], attn)  # warm-up (autotune, lazy init)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:t], self.positions[:t], attn)
            pool = graph.pool() if pool is None else pool
            self.pool = pool
            self.graphs[bs] = graph
            self.outputs[bs] = out
            self.static_inputs[bs] = (self.ids[:t], self.positions[:t], self.slots[:t],
                                      self.seq_lens[:bs], self.cu_k[:bs + 1], self.tables[:bs])
            if self.sample_fn is not None:
                self._capture_sampling(bs, pool)
        torch.cuda.synchronize()

    def _capture_sampling(self, bs: int, pool) -> None:
        args = (self.outputs[bs][:bs], self.inv_temp[:bs], self.seeds[:bs])
        self.sample_fn(*args)  # warm-up: compile the sampler for this size
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.tokens[bs] = self.sample_fn(*args)
        self.sample_graphs[bs] = graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, a: AttentionBatch,
            bs: int) -> torch.Tensor:
        """Replay the graph of size bs on inputs already padded to bs entries."""
        ids, pos, slots, seq_lens, cu_k, tables = self.static_inputs[bs]
        ids.copy_(input_ids)
        pos.copy_(positions)
        slots.copy_(a.slot_mapping)
        seq_lens.copy_(a.seq_lens_k)
        cu_k.copy_(a.cu_seqlens_k)
        tables.copy_(a.block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs]

    def sample_step(self, bs: int, inv_temperature: np.ndarray, seeds: np.ndarray
                    ) -> torch.Tensor:
        """After run(bs): the tokens of the first len(seeds) rows, drawn on the device with
        these inverse temperatures (0: greedy) and seeds, in a tensor of their own."""
        n = len(seeds)
        host = np.zeros(self.sample_in.shape[0], np.int32)
        host[:n] = inv_temperature.astype(np.float32).view(np.int32)
        host[self._seeds_at:self._seeds_at + 2 * n] = seeds.astype(np.int64).view(np.int32)
        self.sample_in.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        self.sample_graphs[bs].replay()
        return self.tokens[bs][:n].clone()
