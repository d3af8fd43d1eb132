"""The one transformers reference of the tests: greedy continuations computed by Hugging Face
transformers on the same weights, in float32 on the CPU.

Every test folder imports it (`from hf_reference import hf_greedy`): tests/ is on sys.path
through tests/conftest.py.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    """The checkpoint in float32, loaded once per directory (recent ones stay cached)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | None = None, **generate_kwargs) -> list[int]:
    """transformers' greedy `generate` with its own KV cache.

    eos_token_id None: exactly max_new_tokens tokens, EOS included where it is the argmax, as
    nanopipe gives with ignore_eos. Otherwise it stops after that token and returns it last, as
    nanopipe does. Extra keyword arguments go to `generate` (repetition_penalty,
    logits_processor, ...).
    """
    ids = torch.tensor([prompt_ids])
    # An explicit mask: left to itself, generate() masks every prompt token equal to the pad id.
    out = hf_model(str(model_dir)).generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=0 if eos_token_id is None else eos_token_id,
        **generate_kwargs)
    generated = out[0, len(prompt_ids):].tolist()
    assert eos_token_id is not None or len(generated) == max_new_tokens, "generate() stopped early"
    return generated
