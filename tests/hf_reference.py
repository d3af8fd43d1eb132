"""The one transformers reference of the tests: greedy continuations computed by Hugging Face
transformers on the same weights, in float32 (on the CPU unless a test asks for a GPU).

Every test folder imports it (`from hf_reference import hf_greedy`): tests/ is on sys.path
through tests/conftest.py.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str, device: str = "cpu"):
    """The checkpoint in float32, loaded once per directory (recent ones stay cached).

    On a GPU, eager attention: its float32 matmuls are what the comparison is about."""
    extra = {} if device == "cpu" else {"attn_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                **extra).to(device).eval()


@torch.no_grad()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | None = None, device: str = "cpu",
              **generate_kwargs) -> list[int]:
    """transformers' greedy `generate` with its own KV cache.

    eos_token_id None: exactly max_new_tokens tokens, EOS included where it is the argmax, as
    nanopipe gives with ignore_eos. Otherwise it stops after that token and returns it last, as
    nanopipe does. Extra keyword arguments go to `generate` (repetition_penalty,
    logits_processor, ...).
    """
    ids = torch.tensor([prompt_ids], device=device)
    # An explicit mask: left to itself, generate() masks every prompt token equal to the pad id.
    out = hf_model(str(model_dir), device).generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=0 if eos_token_id is None else eos_token_id,
        **generate_kwargs)
    generated = out[0, len(prompt_ids):].tolist()
    assert eos_token_id is not None or len(generated) == max_new_tokens, "generate() stopped early"
    return generated


@torch.no_grad()
def hf_greedy_logprobs(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
                       device: str = "cpu") -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (EOS ignored) and the log-softmax of every step's logits [n, vocab]."""
    tokens = hf_greedy(model_dir, prompt_ids, max_new_tokens, device=device)
    full = torch.tensor([prompt_ids + tokens], device=device)
    logits = hf_model(str(model_dir), device)(full).logits[0, len(prompt_ids) - 1:-1]
    return tokens, logits.float().log_softmax(-1).cpu()
