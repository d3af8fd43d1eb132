"""Greedy continuations computed by Hugging Face transformers on the same weights."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Argmax decoding with transformers' own KV cache, never stopping at EOS."""
    model = _model(model_dir)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@torch.no_grad()
def hf_generate(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
                **generate_kwargs) -> list[int]:
    """transformers' own greedy `generate` (for its logits processors), never stopping at EOS."""
    model = _model(model_dir)
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, eos_token_id=None,
                         min_new_tokens=max_new_tokens, max_new_tokens=max_new_tokens,
                         pad_token_id=0, **generate_kwargs)
    return out[0, len(prompt_ids):].tolist()
