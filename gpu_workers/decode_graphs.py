"""CUDA graphs for pure-decode batches, one per bucketed batch size, sharing one memory pool.

A decode step of a small model is dominated by kernel launches; replaying a captured graph
turns ~10 launches per layer into one. Each size reads its inputs from static buffers of its
own (gpu_workers.static_inputs), which the step's batch is built into with one host copy;
the batch is padded up to the bucket (padding rows store nothing: slot -1), and the captured
output buffer is returned. Block tables travel as wide as the step needs and are widened
inside the graph (gpu_workers.graph_tables), so one graph per size serves every context.

With q_per_seq > 1 the graphs run steps that verify speculative proposals: every entry
computes q_per_seq tokens (its last known token and up to q_per_seq - 1 proposals, padded;
gpu_workers.batch lays them out), so a verify step replays one graph like a decode step.

Given a `sample` function, each decode size also gets a second graph that turns the first
one's hidden states into tokens: the LM head and the one-pass sampler, reading each row's
inverse temperature and noise seed from segments of the same static inputs. A step whose
rows need nothing more (no penalties, top-k/p, min-p or logprobs) replays both, so the host
launches two graphs instead of a dozen ops and two Triton kernels; any other step replays
the first only and samples as before.

Given also a `masked` function, a step with constrained rows replays a third graph of its
size: the same, with the token bitmask (gpu_workers.graph_bitmask) applied between the LM
head and the sampler. Unconstrained steps keep the graph without the apply, so they pay
nothing for it. The constrained graphs of every size are captured at the first constrained
step (into the same pool, from the same inputs; their kernels were compiled at start-up):
start-up captures nothing more, an engine that never sees a grammar never captures them, and
the first structured request pays once, as it pays for loading the tokenizer, rather than
each batch size's first constrained step in the middle of serving.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from gpu_workers.graph_bitmask import GraphBitmask, MaskedSampleFn
from gpu_workers.graph_tables import WideTables, copy_in
from gpu_workers.layers.attention import AttentionBatch
from gpu_workers.static_inputs import StaticInputs

SampleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(hidden [R, H], inverse temperatures [R] float32, seeds [R] int64) -> token ids [R]."""


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def record(fn: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture what fn launches into a graph (in `pool`, when given); fn's output tensor is
    where every replay writes."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def input_capacities(bs: int, q_per_seq: int, block_width: int) -> dict[str, int]:
    """The segments of one graph size's static inputs: what gpu_workers.batch sends (the
    token layout, logits rows and sampling parameters), the sampling graph's inputs, and
    the in-flight tokens to patch in (ModelRunner); last the compact block tables, sent only
    as far as a step fills them, and their width (gpu_workers.graph_tables)."""
    t = bs * q_per_seq
    return dict(ids=t, positions=t, slots=t, cu_q=bs + 1, seq_lens=bs, cu_k=bs + 1,
                logits=t, top_k=t, temperature=t, top_p=t, min_p=t, inv_temperature=bs,
                seeds=2 * bs, patch_to=t, patch_from=t, width=1, tables=bs * block_width)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_bs: int, block_width: int,
                 max_model_len: int, device: torch.device, q_per_seq: int = 1,
                 sample: SampleFn | None = None, masked: MaskedSampleFn | None = None,
                 vocab_size: int = 0) -> None:
        """masked (with sample): sampling under a bitmask of vocab_size tokens per row."""
        assert sample is None or q_per_seq == 1, "sampling graphs are for decode steps"
        self.model = model
        self.sample_fn = sample
        self.masked_fn = masked if sample is not None else None
        self.sizes = bucket_sizes(max_bs)
        self.block_width = block_width
        self.max_model_len = max_model_len
        self.q_per_seq = q_per_seq
        self.inputs = {bs: StaticInputs(input_capacities(bs, q_per_seq, block_width), device,
                                        tail="tables")
                       for bs in self.sizes}
        self.wide = WideTables(self.sizes[-1], block_width, device)
        """The full-width tables every size's graph reads (its compact ones widened)."""
        """Per size, the static inputs its graphs read."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.outputs: dict[int, torch.Tensor] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        self.bitmask = None if self.masked_fn is None else \
            GraphBitmask(self.sizes[-1], vocab_size, device)
        """The constrained graphs' token bitmask (rows filled by the grammar matchers)."""
        self.masked_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.masked_tokens: dict[int, torch.Tensor] = {}
        self.masked_steps = 0
        """Steps sampled under their bitmask in a graph (tests and profiles read it)."""

    @property
    def samples(self) -> bool:
        """Whether sizes have a sampling graph (sample_step)."""
        return bool(self.sample_graphs)

    @property
    def masks(self) -> bool:
        """Whether steps with constrained rows can sample in a graph (sample_step masked)."""
        return self.samples and self.bitmask is not None

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def layout(self, bs: int) -> dict:
        """How gpu_workers.batch lays a step out for the graph of size bs, and where."""
        return dict(pad_to=bs, q_per_seq=self.q_per_seq, into=self.inputs[bs])

    def _attn(self, bs: int) -> AttentionBatch:
        v, q = self.inputs[bs].views, self.q_per_seq
        return AttentionBatch(
            slot_mapping=v["slots"], block_tables=self.wide.rows(bs),
            cu_seqlens_q=v["cu_q"], seq_lens_k=v["seq_lens"], cu_seqlens_k=v["cu_k"],
            max_seqlen_q=q, max_seqlen_k=self.max_model_len, decode=True, q_per_seq=q,
        )

    def _idle_step(self, bs: int) -> None:
        """Fill a size's inputs with a step of padding entries (one token each, storing
        nothing): what its graph is warmed up and captured on."""
        q = self.q_per_seq
        staged = self.inputs[bs].stage()
        staged.put("slots", np.full(bs * q, -1, np.int32))
        staged.put("cu_q", np.arange(bs + 1, dtype=np.int32) * q)
        staged.put("seq_lens", np.full(bs, q, np.int32))
        staged.put("cu_k", np.arange(bs + 1, dtype=np.int32) * q)
        staged.put("width", np.zeros(1, np.int32))
        staged.send()

    def _forward(self, bs: int, attn: AttentionBatch) -> torch.Tensor:
        """What a size's graph runs: its tables widened, then the model."""
        v = self.inputs[bs].views
        self.wide.widen(v, bs)
        return self.model(v["ids"], v["positions"], attn)

    def warm_up(self, bs: int, sample: bool = False) -> AttentionBatch:
        """Fill a size's inputs with padding and run its forward once (and its sampling,
        with `sample`): what capture runs before recording it (autotune, lazy init), and
        what start-up's kernel recording launches (gpu_workers.startup_kernels)."""
        self._idle_step(bs)
        attn = self._attn(bs)
        hidden = self._forward(bs, attn)
        if sample and self.sample_fn is not None:
            v = self.inputs[bs].views
            self.sample_fn(hidden[:bs], v["inv_temperature"].view(torch.float32),
                           v["seeds"].view(torch.int64))
        return attn

    def capture(self, pool=None) -> None:
        """Capture every size (into `pool`, another set's memory pool, when given)."""
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            attn = self.warm_up(bs)
            torch.cuda.synchronize()
            graph, out = record(partial(self._forward, bs, attn), pool)
            pool = graph.pool() if pool is None else pool
            self.pool = pool
            self.graphs[bs] = graph
            self.outputs[bs] = out
            if self.sample_fn is not None:
                self._capture_sampling(bs, pool)
        torch.cuda.synchronize()

    def _capture_sampling(self, bs: int, pool, masked: bool = False) -> None:
        v = self.inputs[bs].views
        args = (self.outputs[bs][:bs], v["inv_temperature"].view(torch.float32),
                v["seeds"].view(torch.int64))
        fn = self.sample_fn
        if masked:
            fn, args = self.masked_fn, args + (self.bitmask.rows[:bs], self.bitmask.indices(bs))
        fn(*args)  # warm-up: compile the sampler for this size
        torch.cuda.synchronize()
        graphs, tokens = (self.masked_graphs, self.masked_tokens) if masked else \
            (self.sample_graphs, self.tokens)
        graphs[bs], tokens[bs] = record(partial(fn, *args), pool)

    def capture_masked(self) -> None:
        """Capture every size's constrained sampling graph, largest first (as capture)."""
        for bs in reversed(self.sizes):
            self._capture_sampling(bs, self.pool, masked=True)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, a: AttentionBatch,
            bs: int) -> torch.Tensor:
        """Replay the graph of size bs on inputs already padded to bs entries: built into
        its static inputs (layout(bs)), or anywhere else, then copied there."""
        views = self.inputs[bs].views
        if input_ids.data_ptr() != views["ids"].data_ptr():  # not built in place: copy
            copy_in(views, input_ids, positions, a)
        self.graphs[bs].replay()
        return self.outputs[bs]

    def sample_step(self, bs: int, n: int, masked: bool = False) -> torch.Tensor:
        """After run(bs) on a batch that also sent "inv_temperature" (float32 bits, 0:
        greedy) and "seeds" (int64) for its n rows: their tokens, drawn on the device.

        The tensor is the graph's output, which the next replay of size bs overwrites; not
        copied, since whatever reads it (the copy to the host, the next step's patch of its
        inputs) is queued before that replay, in stream order.

        masked: the step's bitmask rows were sent (self.bitmask) and its constrained graph
        draws under them; the first such step captures them (capture_masked)."""
        if not masked:
            self.sample_graphs[bs].replay()
            return self.tokens[bs][:n]
        if not self.masked_graphs:
            self.capture_masked()
        self.masked_graphs[bs].replay()
        self.masked_steps += 1
        return self.masked_tokens[bs][:n]
