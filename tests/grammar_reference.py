"""The reference a grammar mask is checked against: one xgrammar matcher, one row, xgrammar's
own fill and apply."""

from __future__ import annotations

import torch


def allowed_after(compiled, token_ids: list[int], vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens the grammar `compiled` allows after `token_ids`."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    for t in token_ids:
        assert m.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(mask)
    row = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(row, mask, vocab_size=vocab)
    return row[0] == 0
