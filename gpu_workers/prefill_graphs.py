"""CUDA graphs for small prefill steps: a few sequences, up to a couple of thousand tokens.

A 1,024-token prefill of a small model runs ~250 kernels whose Python launches take longer
than the GPU does (W4's time to first token is host-bound). These graphs, one per (entries,
tokens) bucket, sharing the decode graphs' memory pool, replay such a step in one launch.

Layout (gpu_workers.token_layout.pad_ragged): the step's entries keep their ragged layout;
empty entries fill the entry bucket, and one last entry holds the padding tokens (its own
prefill over block 0 of the cache: slot -1 stores nothing and its outputs are never read).
The Triton attention kernel finds each query tile's entry on the device (no host maximum),
so one captured graph serves every step of its bucket.
"""

from __future__ import annotations

import torch

from gpu_workers.layers.attention import AttentionBatch

ENTRY_BUCKETS = (1, 2, 4)
TOKEN_BUCKETS = (128, 256, 512, 1024, 2048)


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, max_entries: int, max_tokens: int,
                 block_width: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.entry_sizes = [s for s in ENTRY_BUCKETS if s <= max_entries]
        self.token_sizes = [t for t in TOKEN_BUCKETS if t <= max_tokens]
        self.max_model_len = max_model_len
        s, t = (max(self.entry_sizes, default=0) + 1, max(self.token_sizes, default=0))
        i32 = dict(dtype=torch.int32, device=device)
        self.ids = torch.zeros(t, **i32)
        self.positions = torch.zeros(t, **i32)
        self.slots = torch.full((t,), -1, **i32)
        self.cu_q = torch.zeros(s + 1, **i32)
        self.seq_lens = torch.zeros(s, **i32)
        self.cu_k = torch.zeros(s + 1, **i32)
        self.tables = torch.zeros(s, block_width, **i32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def bucket(self, entries: int, tokens: int) -> tuple[int, int] | None:
        """The smallest captured (entries, tokens) that holds a step, or None."""
        s = next((x for x in self.entry_sizes if x >= entries), None)
        t = next((x for x in self.token_sizes if x >= tokens), None)
        return None if s is None or t is None else (s, t)

    def layout(self, key: tuple[int, int]) -> dict:
        """How gpu_workers.batch lays a step out for the graph of `key`."""
        return dict(prefill_pad=key)

    def _attn(self, key: tuple[int, int]) -> AttentionBatch:
        s, t = key[0] + 1, key[1]  # + the padding entry
        return AttentionBatch(
            slot_mapping=self.slots[:t], block_tables=self.tables[:s],
            cu_seqlens_q=self.cu_q[:s + 1], seq_lens_k=self.seq_lens[:s],
            cu_seqlens_k=self.cu_k[:s + 1], max_seqlen_q=t, max_seqlen_k=self.max_model_len,
            decode=False)

    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first (into `pool` when given)."""
        for t in reversed(self.token_sizes):
            for s in reversed(self.entry_sizes):
                # A valid step to capture on: every token in the padding entry.
                for cu in (self.cu_q, self.cu_k):
                    cu[:s + 1].zero_()
                    cu[s + 1] = t
                self.seq_lens[:s].zero_()
                self.seq_lens[s] = t
                attn = self._attn((s, t))
                self.model(self.ids[:t], self.positions[:t], attn)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.ids[:t], self.positions[:t], attn)
                pool = graph.pool() if pool is None else pool
                self.graphs[(s, t)] = graph
                self.outputs[(s, t)] = out
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, a: AttentionBatch,
            key: tuple[int, int]) -> torch.Tensor:
        """Replay the graph of `key` on inputs laid out for it (token_layout.pad_ragged)."""
        s, t = key[0] + 1, key[1]
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(a.slot_mapping)
        self.cu_q[:s + 1].copy_(a.cu_seqlens_q)
        self.seq_lens[:s].copy_(a.seq_lens_k)
        self.cu_k[:s + 1].copy_(a.cu_seqlens_k)
        self.tables[:s].copy_(a.block_tables)
        self.graphs[key].replay()
        return self.outputs[key]
