"""CUDA graphs for steps that prefill up to a couple of thousand tokens, alone or beside
decoding sequences.

A 1,024-token prefill of a small model runs ~250 kernels whose Python launches take longer
than the GPU does (W4's time to first token is host-bound). Under load a new prompt joins a
step of running sequences, and that whole step would be launched op by op: every running
sequence waits for it (the tail of the inter-token latency) and so does the new prompt's
first token. These graphs, one per (entries, tokens) bucket, sharing the decode graphs'
memory pool, replay such a step in one launch.

Layout (gpu_workers.token_layout.pad_ragged): the step's entries keep their ragged layout;
empty entries fill the entry bucket, and one last entry holds the padding tokens (its own
prefill over block 0 of the cache: slot -1 stores nothing and its outputs are never read).
The Triton attention kernel finds each query tile's entry on the device (no host maximum),
so one captured graph serves every step of its bucket. Each bucket reads static inputs of its
own (gpu_workers.static_inputs), which the step's batch is built into with one host copy;
its block tables travel compact and are widened inside the graph (gpu_workers.graph_tables).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from gpu_workers.decode_graphs import record
from gpu_workers.graph_tables import WideTables, copy_in
from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.static_inputs import StaticInputs

TOKEN_BUCKETS = (128, 256, 512, 768, 1024, 1536, 2048)
MAX_ENTRIES = 64
"""Steps of more entries run eagerly. On an H200 (Qwen3-0.6B shape, W2 from 64 to 512
requests/s, three pairs of runs) graphs for up to 64 entries beat 16 at light load and at
saturation in every pair (TTFT p50 10 against 32-40 ms at 64 requests/s, 8% more throughput
at 512): under load a prompt joins more than 16 running sequences. A first try with up to
256 lost 12% of the throughput at 512 requests/s against up to 4."""


def entry_buckets(max_entries: int) -> list[int]:
    """Powers of four up to max_entries, and max_entries itself: an empty entry costs one
    attention program that exits at once, so the entry buckets can be coarse (the token
    buckets are what pays for padding)."""
    sizes = [4**i for i in range(max_entries.bit_length()) if 4**i < max_entries]
    return sizes + [max_entries]


def prefill_capacities(entries: int, tokens: int, block_width: int) -> dict[str, int]:
    """The segments of one bucket's static inputs: its entries plus the padding entry, its
    tokens, the logits rows and sampling parameters (one per token at most, when entries
    verify proposals), the in-flight tokens to patch in, and last the compact block tables
    with their width (gpu_workers.graph_tables)."""
    s = entries + 1
    return dict(ids=tokens, positions=tokens, slots=tokens, cu_q=s + 1, seq_lens=s, cu_k=s + 1,
                logits=tokens, top_k=tokens, temperature=tokens, top_p=tokens, min_p=tokens,
                patch_to=tokens, patch_from=tokens, width=1, tables=s * block_width)


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, max_entries: int, max_tokens: int,
                 block_width: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.entry_sizes = entry_buckets(min(max_entries, MAX_ENTRIES))
        self.token_sizes = [t for t in TOKEN_BUCKETS if t < max_tokens]
        if max_tokens <= TOKEN_BUCKETS[-1]:  # a step as large as the limits allow fits too
            self.token_sizes.append(max_tokens)
        self.max_model_len = max_model_len
        self.block_width = block_width
        self.inputs = {(s, t): StaticInputs(prefill_capacities(s, t, block_width), device,
                                            tail="tables")
                       for t in self.token_sizes for s in self.entry_sizes if s <= t}
        self.wide = WideTables(self.entry_sizes[-1] + 1, block_width, device)
        """The full-width tables every bucket's graph reads (its compact ones widened)."""
        """Per bucket, the static inputs its graph reads (every entry holds a token)."""
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def bucket(self, entries: int, tokens: int) -> tuple[int, int] | None:
        """The smallest captured (entries, tokens) that holds a step, or None."""
        s = next((x for x in self.entry_sizes if x >= entries), None)
        if s is None:
            return None
        t = next((x for x in self.token_sizes if x >= max(tokens, s)), None)  # s <= t
        return None if t is None else (s, t)

    def layout(self, key: tuple[int, int]) -> dict:
        """How gpu_workers.batch lays a step out for the graph of `key`, and where."""
        return dict(prefill_pad=key, into=self.inputs[key])

    def _attn(self, key: tuple[int, int]) -> AttentionBatch:
        v, s, t = self.inputs[key].views, key[0] + 1, key[1]  # + the padding entry
        return AttentionBatch(
            slot_mapping=v["slots"], block_tables=self.wide.rows(s),
            cu_seqlens_q=v["cu_q"], seq_lens_k=v["seq_lens"], cu_seqlens_k=v["cu_k"],
            max_seqlen_q=t, max_seqlen_k=self.max_model_len, decode=False)

    def _padding_step(self, key: tuple[int, int]) -> None:
        """Fill a bucket's inputs with a valid step to capture on: every token in the
        padding entry, storing nothing."""
        s, t = key
        staged = self.inputs[key].stage()
        bounds = np.array([0] * (s + 1) + [t], np.int32)
        staged.put("slots", np.full(t, -1, np.int32))
        staged.put("cu_q", bounds)
        staged.put("cu_k", bounds)
        staged.put("seq_lens", np.array([0] * s + [t], np.int32))
        staged.put("width", np.zeros(1, np.int32))
        staged.send()

    def _forward(self, key: tuple[int, int], attn: AttentionBatch) -> torch.Tensor:
        """What a bucket's graph runs: its tables widened, then the model."""
        v = self.inputs[key].views
        self.wide.widen(v, key[0] + 1)
        return self.model(v["ids"], v["positions"], attn)

    def warm_up(self, key: tuple[int, int]) -> AttentionBatch:
        """Fill a bucket's inputs with padding and run its forward once: what capture runs
        before recording it, and what start-up's kernel recording launches."""
        self._padding_step(key)
        attn = self._attn(key)
        self._forward(key, attn)
        return attn

    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first (into `pool` when given)."""
        for key in sorted(self.inputs, key=lambda k: (k[1], k[0]), reverse=True):
            attn = self.warm_up(key)
            torch.cuda.synchronize()
            graph, out = record(partial(self._forward, key, attn), pool)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
            self.outputs[key] = out
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, a: AttentionBatch,
            key: tuple[int, int]) -> torch.Tensor:
        """Replay the graph of `key` on inputs laid out for it (token_layout.pad_ragged):
        built into its static inputs (layout(key)), or copied there."""
        copy_in(self.inputs[key].views, input_ids, positions, a)
        self.graphs[key].replay()
        return self.outputs[key]
