"""Draft-model proposer (`--speculative draft`): a smaller model with the target's vocabulary,
loaded in the same worker processes, proposes K tokens by running K steps of its own.

KV cache: the draft has its own paged pool with as many blocks as the target's, addressed by
the same block tables. The scheduler's tables then cover the draft too (one allocation, no
second block manager, prefix-cache hits are hits for the draft as well), and the pool size is
paid from one budget (kv_cache.cpu_num_blocks / cuda_sizing.cuda_kv_blocks with the draft's
bytes per block added). The draft's pool is written at the same slots the target writes, as follows.

Consistency: `computed[row]` counts the positions whose draft KV holds the sequence's accepted
tokens. Each step the draft first catches up, computing [min(computed, target computed),
target computed + num_new) of every entry (prefill chunks included, so a prompt is in the
draft's pool by the time it decodes); a speculating entry takes its first proposal from the
last of those logits, then runs one token per further proposal. After verification the target
has computed its last known token plus the accepted proposals; the draft's KV past that point
holds rejected proposals and is overwritten at the next catch-up, which starts at the
minimum of the two counts. When every proposal is accepted the draft lags the target by one
position (the last proposal was never fed to it), which the next catch-up computes.

Structured outputs: rank 0 masks each draft step of a constrained entry by its grammar after
the proposals drawn before it (GrammarBook.walk, then unwind before the target verifies), so
the draft proposes only what the grammar allows; its q is the masked one, which is the
distribution the proposal was drawn from, as rejection sampling requires. Unmasked, a draft
that agrees with the target would still lose most proposals of a constrained entry.

Sampling: greedy requests and seeded ones get the draft's argmax (for a seeded request the
target's seeded draw is compared with it as for an n-gram proposal, so its output is the same
as without speculation); other requests draw from the draft's distribution q (their own
temperature, top-k, top-p, min-p), which is kept for rejection sampling (rejection.py).

Tensor parallelism: the draft is sharded like the target and runs on every rank (its layers
all-reduce); rank 0, which holds the logits, samples the proposals and broadcasts them, so
every rank's mirror holds the same ones.

CUDA graphs: where the target has them, the draft's steps of at most two tokens per entry
(the catch-up of decoding entries, then one token per further proposal) replay graphs of
their own (capture_graphs); prefill chunks run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from gpu_workers.config import ModelConfig, WorkerConfig
from gpu_workers.decode_graphs import DecodeGraphs
from gpu_workers.grammar_book import GrammarBook
from gpu_workers.kv_cache import KVCache, bytes_per_block
from gpu_workers.layers.attention import resolve_backend
from gpu_workers.layers.cpu_linear import use_onednn_weights
from gpu_workers.layers.parallel import TPInfo
from gpu_workers.loader import load_weights
from gpu_workers.models import CausalLM
from gpu_workers.sampler import Sampler
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.speculative.rejection import (
    categorical,
    filtered_probs,
    rejection_draws,
    row_sampling,
)
from gpu_workers.speculative.verify import SpecStep
from gpu_workers.token_layout import bucket_width, lay_out, needed_width
from gpu_workers.transfer import to_device, upload


class DraftVocabMismatch(ValueError):
    """The draft's vocabulary is not the target's: its token ids would mean other tokens."""


class DraftProposer:
    def __init__(self, config: WorkerConfig, target: ModelConfig, tp: TPInfo,
                 device: torch.device) -> None:
        self.config, self.tp, self.device = config, tp, device
        self.model_config = mc = ModelConfig.from_dir(config.draft_model, config.dtype)
        if mc.vocab_size != target.vocab_size:
            raise DraftVocabMismatch(
                f"draft_model {config.draft_model!r} has vocab_size {mc.vocab_size} but the "
                f"model has {target.vocab_size}: a draft must share the target's vocabulary")
        backend = resolve_backend(config.attention_backend, config.device, mc.dtype,
                                  mc.head_dim, config.block_size)
        with torch.inference_mode():
            self.model = CausalLM(mc, tp, backend, device, config.max_seq_tokens)
            load_weights(self.model, config.draft_model)
            use_onednn_weights(self.model)
        self.kv_cache: KVCache | None = None
        self.graphs: list[DecodeGraphs] = []
        self.computed = np.zeros(0, np.int64)
        self.epoch = np.full(0, -1, np.int64)
        self.q: dict[int, list[torch.Tensor]] = {}
        """Rank 0, this step: per entry drawn from q, the q of each of its proposals."""

    def bytes_per_block(self, world_size: int) -> int:
        return bytes_per_block(self.model_config, self.config.block_size, world_size)

    def bind_cache(self, num_blocks: int, world_size: int) -> None:
        self.kv_cache = KVCache(self.model_config, num_blocks, self.config.block_size,
                                self.device)
        self.kv_cache.bind(self.model.attention_layers())

    # ----------------------------------------------------------------- proposing

    def propose(self, table: SequenceTable, rows: np.ndarray, num_new: np.ndarray,
                caps: np.ndarray, sampler: Sampler, grammars: GrammarBook | None = None
                ) -> SpecStep | None:
        """Catch the draft up on this step's tokens, then write each speculating entry's
        proposals into the mirror past its known tokens (num_tokens unchanged). Call before
        the target's batch is built; None when no entry may speculate. grammars: rank 0's
        matchers, which guide the proposals of constrained entries."""
        self._track(table, rows)
        self.q = {}
        done = table.num_computed[rows]
        start = np.minimum(self.computed[rows], done)
        end = done + num_new
        length = table.num_tokens[rows]
        k = np.where(end == length, np.minimum(caps, table.max_tokens - length), 0)
        k = np.maximum(k, 0)
        picked = np.flatnonzero(k > 0)
        guide = grammars if grammars is not None and table.constrained[rows[picked]].any() \
            else None
        hidden, last = self._forward(table, rows, start, end - start)
        self.computed[rows] = end
        drawn: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        if len(picked):
            tokens = self._sample(hidden, last[picked], table, rows, picked, sampler, guide)
            drawn.append((rows[picked], length[picked], tokens))
        for j in range(1, int(k.max(initial=0))):
            # The proposal drawn at step j - 1 goes in, straight from the device.
            prev_picked, picked = picked, np.flatnonzero(k > j)
            prev = tokens.index_select(0, to_device(np.searchsorted(prev_picked, picked),
                                                    self.device))
            pos = length[picked] + j - 1
            hidden, last = self._forward(table, rows[picked], pos,
                                         np.ones(len(picked), np.int64), ids=prev)
            self.computed[rows[picked]] = pos + 1
            tokens = self._sample(hidden, last, table, rows, picked, sampler, guide)
            drawn.append((rows[picked], length[picked] + j, tokens))
        if guide is not None:
            guide.unwind()
        if drawn:  # one wait for the host, after every draft step is queued
            values = torch.cat([t for _, _, t in drawn]).cpu().numpy()
            table.tokens[np.concatenate([r for r, _, _ in drawn]),
                         np.concatenate([a for _, a, _ in drawn])] = values
        return SpecStep(k, caps > 0) if caps.any() else None

    def _track(self, table: SequenceTable, rows: np.ndarray) -> None:
        """Rows given to another sequence since the last step start over at the target's
        count: its prefix-cache hit covers blocks the draft computed along with the target."""
        if len(self.computed) < len(table.epoch):
            extra = len(table.epoch) - len(self.computed)
            self.computed = np.concatenate([self.computed, np.zeros(extra, np.int64)])
            self.epoch = np.concatenate([self.epoch, np.full(extra, -1, np.int64)])
        moved = rows[self.epoch[rows] != table.epoch[rows]]
        self.computed[moved] = table.num_computed[moved]
        self.epoch[moved] = table.epoch[moved]

    def capture_graphs(self, pool=None) -> None:
        """CUDA graphs for the draft's steps that compute at most two tokens per entry: its
        one-token proposal steps, and the catch-up of a decoding entry (one token, or two
        when every proposal of the previous step was accepted)."""
        c = self.config
        for q in (1, 2):
            graphs = DecodeGraphs(self.model, c.max_num_seqs, c.max_blocks_per_seq,
                                  c.max_model_len, self.device, q_per_seq=q)
            graphs.capture(pool)
            pool = graphs.pool
            self.graphs.append(graphs)

    def _forward(self, table: SequenceTable, rows: np.ndarray, start: np.ndarray,
                 n: np.ndarray, ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, np.ndarray]:
        """The draft's hidden states for tokens [start, start + n) of each row, and the row
        of each entry's last token in them. `ids`: with one token per row, its value on the
        device (a proposal not yet copied to the mirror)."""
        longest = int(n.max())
        graphs = next((g for g in self.graphs
                       if longest <= g.q_per_seq and len(rows) <= g.max_bs), None)
        bs = None if graphs is None else graphs.bucket(len(rows))
        width = None  # a graph's step: as wide as needed (gpu_workers.graph_tables)
        if graphs is None and self.device.type == "cuda":
            width = bucket_width(needed_width(int((start + n).max()), self.config.block_size),
                                 self.config.max_blocks_per_seq)
        layout = lay_out(table, rows, start, n, self.config.block_size, width, pad_to=bs,
                         q_per_seq=1 if graphs is None else graphs.q_per_seq)
        input_ids, positions, attn = layout.attention(upload(layout.parts(), self.device))
        if ids is not None:
            input_ids[:len(rows)].copy_(ids)
        if graphs is not None:
            return graphs.run(input_ids, positions, attn, bs), layout.last
        return self.model(input_ids, positions, attn), layout.last

    def _sample(self, hidden: torch.Tensor, index: np.ndarray, table: SequenceTable,
                rows: np.ndarray, picked: np.ndarray, sampler: Sampler,
                guide: GrammarBook | None = None) -> torch.Tensor:
        """Draw one proposal per picked entry from hidden[index] (on the device, every rank);
        guide (rank 0): masks constrained entries by their grammar and walks it on."""
        logits = self.model.compute_logits(hidden.index_select(0, to_device(index, self.device)))
        prow = rows[picked]
        if guide is not None:
            guide.mask_logits(logits, prow, table.epoch[prow], table.constrained[prow])
        if self.tp.rank == 0:
            tokens = logits.argmax(dim=-1)
            drawn = np.flatnonzero((table.temperature[prow] > 0) & (table.seed[prow] < 0))
            if len(drawn):
                idx = to_device(drawn, self.device)
                q = filtered_probs(logits.index_select(0, idx),
                                   row_sampling(table, prow[drawn], self.device))
                tokens[idx] = categorical(q, sampler.generator)
                for i, entry in enumerate(picked[drawn].tolist()):
                    self.q.setdefault(entry, []).append(q[i])
        else:
            tokens = torch.empty(len(picked), dtype=torch.int64, device=self.device)
        if self.tp.size > 1:
            dist.broadcast(tokens, src=0)
        if guide is not None:  # the next step's masks need this proposal: one host copy
            guide.walk(prow, table.epoch[prow], tokens.cpu().numpy(), table.constrained[prow])
        return tokens

    # ----------------------------------------------------------------- verifying

    def resample(self, logits: torch.Tensor, table: SequenceTable, sample_entries: np.ndarray,
                 sample_rows: np.ndarray, num_verify: np.ndarray, tokens: torch.Tensor,
                 sampler: Sampler) -> bool:
        """Rank 0, after the sampler drew at every verified position: replace the draws at
        the positions of proposals drawn from q by rejection sampling's outcome (in place).
        num_verify is per sampling entry. Returns whether any draw was replaced."""
        if not self.q:
            return False
        counts = num_verify + 1
        first = np.cumsum(counts) - counts
        index, rows, steps, qs = [], [], [], []
        for i, entry in enumerate(sample_entries.tolist()):
            q = self.q.get(entry)
            v = int(num_verify[i])
            if not q or not v:
                continue
            index.extend(range(first[i], first[i] + v))  # the rows that predict proposal j
            rows.extend([sample_rows[i]] * v)
            steps.extend(range(v))
            qs.extend(q[:v])
        if not index:
            return False
        rows_a = np.asarray(rows, np.int64)
        at = table.num_tokens[rows_a] + np.asarray(steps, np.int64)
        proposals = to_device(table.tokens[rows_a, at].astype(np.int64), self.device)
        idx = to_device(np.asarray(index, np.int64), self.device)
        draws = rejection_draws(logits.index_select(0, idx),
                                row_sampling(table, rows_a, self.device), torch.stack(qs),
                                proposals, sampler.generator)
        tokens[idx] = draws
        return True
