"""CUDA graphs for pure-decode batches, one per bucketed batch size, sharing one memory pool.

A decode step of a small model is dominated by kernel launches; replaying a captured graph
turns ~10 launches per layer into one. Inputs are copied into static buffers, the batch is
padded up to the bucket (padding rows store nothing: slot -1), and the captured output
buffer is returned.

With q_per_seq > 1 the graphs run steps that verify speculative proposals: every entry
computes q_per_seq tokens (its last known token and up to q_per_seq - 1 proposals, padded;
gpu_workers.batch lays them out), so a verify step replays one graph like a decode step.
"""

from __future__ import annotations

import torch

from gpu_workers.layers.attention import AttentionBatch


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_bs: int, block_width: int,
                 max_model_len: int, device: torch.device, q_per_seq: int = 1) -> None:
        self.model = model
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
        self.pool = None
        self.outputs: dict[int, torch.Tensor] = {}

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
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, a: AttentionBatch,
            bs: int) -> torch.Tensor:
        """Replay the graph of size bs on inputs already padded to bs entries."""
        t = bs * self.q_per_seq
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(a.slot_mapping)
        self.seq_lens[:bs].copy_(a.seq_lens_k)
        self.cu_k[: bs + 1].copy_(a.cu_seqlens_k)
        self.tables[:bs].copy_(a.block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs]
