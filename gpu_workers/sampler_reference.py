"""The plain torch sampler the fast one in gpu_workers.sampler is tested against.

It does every step the obvious way: a float32 copy of the logits, a full-vocabulary sort for
top-p, a softmax, then the exponential race. Given the same generator state it draws the same
noise as Sampler, so the two agree token for token up to float rounding at a filter's edge.
"""

from __future__ import annotations

import torch

from gpu_workers.penalties import apply_penalties
from gpu_workers.sampler import SamplingBatch


class ReferenceSampler:
    def __init__(self, device: torch.device | str, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor,
                 b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        raw = logits.float()
        logits = raw if b.penalties is None else apply_penalties(raw, b.penalties)
        greedy = logits.argmax(dim=-1)
        tokens = greedy if b.all_greedy else torch.where(
            b.temperature == 0, greedy, self.sample(logits, b))
        logprobs = None
        if b.logprobs:
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    def sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        return self.race(self.probs(logits, b), b)

    def probs(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """[R, V] probabilities after temperature, top-k, top-p and min-p (unnormalised after
        min-p, which only zeroes entries)."""
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        x = logits / temp[:, None]
        vocab = x.shape[-1]
        k = torch.where(b.top_k > 0, b.top_k, vocab).clamp(max=vocab).long()
        srt = x.sort(dim=-1, descending=True).values
        x = x.masked_fill(x < srt.gather(1, (k - 1)[:, None]), float("-inf"))
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = ((p.cumsum(dim=-1) - p) >= b.top_p[:, None]) & (b.top_p[:, None] < 1)
        x = x.scatter(1, idx, srt.masked_fill(drop, float("-inf")))
        probs = x.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * b.min_p[:, None]
        return probs.masked_fill(probs < floor, 0.0)

    def race(self, probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in b.seeded:
            self.row_generator.manual_seed(seed)
            noise[row].exponential_(generator=self.row_generator)
        return (probs / noise).argmax(dim=-1)
