"""Batched sampling on the device: penalties, greedy, temperature, top-k, top-p, min-p and
per-request seeds.

Random rows use the exponential race (argmax of p / E with E ~ Exp(1) is a sample from p), so
every row of a batch is drawn with one kernel chain and no host sync. A seeded request draws its
noise from a generator seeded with (seed, tokens generated so far): it reproduces exactly, also
when a preempted sequence recomputes. Which filters run is decided on the host from the
requests' parameters, so a batch that uses no top-k/top-p pays for no sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_workers.penalties import PenaltyBatch, apply_penalties

_MASK64 = (1 << 63) - 1


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


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of raw logits and their logprobs, best first."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids, values


class Sampler:
    def __init__(self, device: torch.device | str, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor,
                 b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [R, V] fp32 -> (token ids [R] int64, logprob of each sampled token or None).

        Logprobs are those of the model's raw distribution, before penalties and temperature."""
        raw = logits
        if b.penalties is not None:
            logits = apply_penalties(logits, b.penalties)
        greedy = logits.argmax(dim=-1) if b.any_greedy else None
        if b.all_greedy:
            tokens = greedy
        else:
            tokens = self._sample(logits, b)
            if greedy is not None:
                tokens = torch.where(b.temperature == 0, greedy, tokens)
        logprobs = None
        if b.logprobs:
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        x = logits / temp[:, None]
        vocab = x.shape[-1]
        if b.max_top_k > 0:
            k = torch.where(b.top_k > 0, b.top_k, vocab).clamp(max=min(b.max_top_k, vocab))
            top = x.topk(min(b.max_top_k, vocab), dim=-1).values
            kth = top.gather(1, (k.long() - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        if b.use_top_p:
            srt, idx = x.sort(dim=-1, descending=True)
            p = srt.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop = (p.cumsum(dim=-1) - p) >= b.top_p[:, None]
            x = x.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
        probs = x.softmax(dim=-1)
        if b.use_min_p:
            floor = probs.amax(dim=-1, keepdim=True) * b.min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in b.seeded:
            self.row_generator.manual_seed(seed)
            noise[row].exponential_(generator=self.row_generator)
        return (probs / noise).argmax(dim=-1)
