"""The model's Hugging Face tokenizer and the facts read beside it (EOS ids, vocab size).

Shared by the tokenizer, the detokenizer and the stdout printer, so every actor loads the
tokenizer the same way and agrees on which ids end a sequence.
"""

from __future__ import annotations

from typing import Any

from protocol import model_config as hf


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def eos_token_ids(model: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    ids = set(hf.eos_token_ids(hf.read_generation_config(model)))
    if hf.has_model_config(model):
        ids.update(hf.eos_token_ids(hf.read_model_config(model)))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def model_vocab_size(model: str, tokenizer: Any) -> int:
    size = hf.vocab_size(hf.read_model_config(model)) if hf.has_model_config(model) else None
    return size or len(tokenizer)
