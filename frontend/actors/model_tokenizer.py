"""The model's Hugging Face tokenizer and the facts read beside it (EOS ids, vocab size).

Shared by the tokenizer, the detokenizer and the stdout printer, so every actor loads the
tokenizer the same way and agrees on which ids end a sequence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol import model_config as hf

TOKENIZER_JSON = "tokenizer.json"
SLOW_TOKENIZER_FILES = (("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
"""The other file sets a Hugging Face tokenizer loads from (sentencepiece, BPE, WordPiece)."""
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""JSON files read beside the tokenizer when present; each must hold an object."""


class TokenizerFilesError(ValueError):
    """A model directory whose tokenizer cannot load; one line naming the file."""


def check_tokenizer_files(model: str) -> None:
    """Refuse a directory without tokenizer files or with a tokenizer.json that does not
    parse, before any process starts: without this a pipeline reports ready and decodes every
    token to nothing, or each frontend actor dies with a traceback. The `tokenizers` library
    parses the file in a fraction of a second, without importing transformers."""
    root = Path(model)
    for side in (root / name for name in TOKENIZER_SIDE_FILES):
        if side.is_file():
            _check_json_object(side)
    path = root / TOKENIZER_JSON
    if not path.is_file():
        if any(all((root / f).is_file() for f in files) for files in SLOW_TOKENIZER_FILES):
            return
        raise TokenizerFilesError(
            f"model directory {model!r} has no tokenizer files ({TOKENIZER_JSON}, "
            "tokenizer.model, or vocab.json with merges.txt)")
    from tokenizers import Tokenizer

    try:
        text = path.read_text()
        Tokenizer.from_str(text)
        if not isinstance(json.loads(text).get("added_tokens"), list):
            raise ValueError("it lacks the 'added_tokens' list")
    except Exception as exc:  # noqa: BLE001 - the library's errors have no common type
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerFilesError(f"{path} is not a valid tokenizer: {reason}") from None


def _check_json_object(path: Path) -> None:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFilesError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerFilesError(f"{path} must hold a JSON object, got "
                                  f"{type(value).__name__}")


def load_tokenizer(model: str) -> Any:
    """AutoTokenizer's tokenizer, its class remembered between runs (tokenizer_cache.py)."""
    from frontend.actors import tokenizer_cache

    return tokenizer_cache.load_tokenizer(model)


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
