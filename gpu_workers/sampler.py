"""Batched sampling on the device: penalties, greedy, temperature, top-k, top-p, min-p and
per-request seeds.

Random rows use the exponential race in log form (argmax of x/T - log E with E ~ Exp(1) is a
sample from softmax(x/T)), so no softmax over the vocabulary is needed and every row of a batch
is drawn with one kernel chain. A seeded request draws its noise from a generator seeded with
(seed, tokens generated so far): it reproduces exactly, also when a preempted sequence
recomputes. Which filters run is decided on the host from the requests' parameters, so an
all-greedy batch is one argmax over the logits as they come (bf16 on the GPU: no float32
copy), and a batch without filters pays for no top-k.

The filters become one threshold per row (keep x/T >= tau): top-k's k-th value, top-p's last
kept value and min-p's max + log(min_p), all read from a bounded torch.topk of each row
instead of a sort of the vocabulary. Top-p falls back to a sort for the rows whose top
TOP_P_CANDIDATES tokens hold less than top_p of the mass; deciding that costs the batch one
host sync, so only batches that use top-p pay it. gpu_workers.sampler_reference is the plain
version it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_workers.penalties import PenaltyBatch, apply_penalties
from kernels._common import HAS_TRITON
from kernels.sampling import sample_from_logits

_MASK64 = (1 << 63) - 1
TOP_P_CANDIDATES = 1024
"""How many of a row's best tokens top-p looks at before it falls back to a full sort."""
FALLBACK_ROWS = 16
"""Rows sorted at once by that fallback."""


def row_seed(seed: int, num_generated: int) -> int:
    return (seed * 6364136223846793005 + num_generated * 1442695040888963407 + 1) & _MASK64


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor
    """[R] float32; 0 = greedy."""
    top_k: torch.Tensor
    """[R] int32; <= 0 = off."""
    top_p: torch.Tensor
    """[R] float32."""
    min_p: torch.Tensor
    """[R] float32."""
    all_greedy: bool
    any_greedy: bool
    max_top_k: int
    """Largest top-k in the batch; 0 when no row uses top-k."""
    use_top_p: bool
    use_min_p: bool
    seeded: list[tuple[int, int]]
    """(row, generator seed) for each seeded random row."""
    logprobs: bool
    penalties: PenaltyBatch | None = None
    """Token histories of the rows that use a penalty; None when no row does."""
    top_logprobs: int = 0
    """The most alternatives any row asked for (0: none)."""


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logprob of each row's token [R] under raw logits [R, V]."""
    raw = logits.float()
    return raw.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of raw logits and their logprobs, best first.
    Computed as `sampled_logprobs` computes them, so a sampled token among them has the same
    logprob in both lists, to the bit."""
    raw = logits.float()
    values, ids = raw.topk(k, dim=-1)
    return ids, values - torch.logsumexp(raw, dim=-1, keepdim=True)


class Sampler:
    """On CUDA, random rows are drawn by one Triton kernel that reads the logits once
    (kernels.sampling: the exponential race with noise hashed from a per-row seed); elsewhere,
    or with one_pass=False, by the torch ops below with noise from torch generators. Both draw
    from the same distribution; their draws for one seed differ."""

    def __init__(self, device: torch.device | str, seed: int,
                 one_pass: bool | None = None) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.host_generator = np.random.default_rng(seed)
        self.row_generator = torch.Generator(device=device)
        self.one_pass = HAS_TRITON and torch.device(device).type == "cuda" \
            if one_pass is None else one_pass

    def __call__(self, logits: torch.Tensor,
                 b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [R, V] (any float dtype) -> (token ids [R] int64, logprob of each sampled
        token or None).

        Logprobs are those of the model's raw distribution, before penalties and temperature."""
        raw = logits
        if b.penalties is not None:
            logits = apply_penalties(logits.float(), b.penalties)
        if b.all_greedy:
            tokens = logits.argmax(dim=-1)
        elif self.one_pass:
            tokens = self._sample_one_pass(logits, b)  # greedy rows included
        else:
            tokens = self._sample(logits, b)
            if b.any_greedy:
                tokens = torch.where(b.temperature == 0, logits.argmax(dim=-1), tokens)
        logprobs = sampled_logprobs(raw, tokens) if b.logprobs else None
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        scores = logits.float() / temp[:, None]
        tau = _thresholds(scores, b)
        if tau is not None:
            scores.masked_fill_(scores < tau[:, None], float("-inf"))
        noise = torch.empty_like(scores).exponential_(generator=self.generator)
        for row, seed in b.seeded:
            self.row_generator.manual_seed(seed)
            noise[row].exponential_(generator=self.row_generator)
        return scores.sub_(noise.log_()).argmax(dim=-1)


    def _sample_one_pass(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        inv = torch.where(b.temperature > 0, b.temperature.reciprocal(),
                          torch.zeros_like(b.temperature))
        # The kernel compares logit * inv with the threshold: scale the same way here.
        tau = None
        if b.max_top_k > 0 or b.use_top_p or b.use_min_p:
            tau = _thresholds(logits.float() * inv[:, None], b)
        return sample_from_logits(logits, inv, self.row_seeds(b, logits.device), tau)

    def row_seeds(self, b: SamplingBatch, device: torch.device) -> torch.Tensor:
        """[R] int64: a seeded row's own seed, fresh draws of the engine's generator for the
        others (on the device: no host sync)."""
        rows = b.temperature.shape[0]
        seeds = torch.randint(0, 1 << 62, (rows,), generator=self.generator, device=device)
        if b.seeded:
            at = torch.tensor([r for r, _ in b.seeded], dtype=torch.int64)
            values = torch.tensor([v for _, v in b.seeded], dtype=torch.int64)
            seeds[at.to(device)] = values.to(device)
        return seeds

    def draw_seeds(self, n: int) -> np.ndarray:
        """[n] int64 noise seeds drawn on the host, for a sampler captured in a CUDA graph
        (gpu_workers.graph_sampling), which reads them from a static buffer."""
        return self.host_generator.integers(0, 1 << 62, n, dtype=np.int64)


def _thresholds(scores: torch.Tensor, b: SamplingBatch) -> torch.Tensor | None:
    """[R] float32: the lowest temperature-scaled logit each row keeps (None: keep all)."""
    if b.max_top_k <= 0 and not b.use_top_p and not b.use_min_p:
        return None
    rows, vocab = scores.shape
    width = max(b.max_top_k, TOP_P_CANDIDATES if b.use_top_p else 1)
    top = scores.topk(min(width, vocab), dim=-1).values  # [R, K] best first
    tau = torch.full((rows,), float("-inf"), device=scores.device)
    if b.max_top_k > 0:
        k = b.top_k.long().clamp(1, top.shape[1])
        tau = torch.where(b.top_k > 0, top.gather(1, (k - 1)[:, None]).squeeze(1), tau)
    if b.use_top_p:  # greedy rows' top_p is moot: never let them cost a sort
        top_p = b.top_p.masked_fill(b.temperature == 0, 1.0)
        tau = torch.maximum(tau, _top_p_threshold(scores, top, tau, top_p))
    if b.use_min_p:
        floor = top[:, 0] + b.min_p.log()
        tau = torch.where(b.min_p > 0, torch.maximum(tau, floor), tau)
    return tau


def _top_p_threshold(scores: torch.Tensor, top: torch.Tensor, tau_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """Top-p's threshold per row, after top-k (tau_k), from the best candidates `top`; rows
    whose candidates do not hold top_p of the mass are sorted whole."""
    survivors = scores.masked_fill(scores < tau_k[:, None], float("-inf"))
    lse = torch.logsumexp(survivors, dim=-1)
    cand = top.masked_fill(top < tau_k[:, None], float("-inf"))
    tau, complete = _prefix_threshold(cand, lse, top_p)
    # Also complete: every survivor of top-k is a candidate, the candidates are the vocab,
    # or the row does not use top-p.
    complete |= (top[:, -1] < tau_k) | (top.shape[1] == scores.shape[1]) | (top_p >= 1)
    if not bool(complete.all()):  # host sync: only batches that use top-p get here
        # A few rows at a time, so the sort's transient memory stays small whatever the batch
        # (the start-up memory profile need not have met this path).
        for rows in torch.nonzero(~complete).squeeze(1).split(FALLBACK_ROWS):
            srt = survivors.index_select(0, rows).sort(dim=-1, descending=True).values
            tau[rows] = _prefix_threshold(srt, lse[rows], top_p[rows])[0]
    return torch.where(top_p < 1, tau, torch.full_like(tau, float("-inf")))


def _prefix_threshold(srt: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """From values sorted best first and each row's log-normaliser: the last value top-p
    keeps (a token is dropped once the mass before it reaches top_p; the first always stays),
    and whether the kept prefix ends inside `srt`."""
    p = (srt - lse[:, None]).exp()
    keep = (p.cumsum(dim=-1) - p) < top_p[:, None]
    n = keep.sum(dim=-1).clamp(min=1)
    return srt.gather(1, (n - 1)[:, None]).squeeze(1), n < srt.shape[1]
