"""The one random-prompt generator of the tests: seeded token ids, deterministic per seed.

Ids start at 3, past the tiny models' special tokens (pad, EOS, chat markers), so a prompt
never carries a control token by chance. tests/ is on sys.path through tests/conftest.py.
"""

from __future__ import annotations

import torch


def random_prompts(seed: int, lengths: list[int], vocab: int = 600) -> list[list[int]]:
    """One prompt per entry of `lengths`, ids uniform in [3, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
