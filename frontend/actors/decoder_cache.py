"""The detokenizer's tokenizer without transformers, once it has been built once.

The detokenizer decodes ids, spells tokens and reads the added tokens: with a fast
tokenizer all of that is its Rust backend's (transformers' TokenizersBackend forwards those
calls to it). Building the tokenizer through transformers costs seconds of start-up (it
imports torch); the backend, serialized, loads in a tenth of a second. So the first load
builds it as every actor does (AutoTokenizer) and stores the backend's JSON in nanopipe's
cache, named by a digest of the model's tokenizer files and of the library versions; a later
load with the same files and versions reads that instead. A tokenizer whose class changes
any of those calls is not stored, and a stored file that does not load is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from frontend.actors.model_tokenizer import load_tokenizer
from frontend.embedded_model.cache import cache_root
from protocol import model_config as hf

log = logging.getLogger("nanopipe.detokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", hf.CONFIG_FILE, "tokenizer.model", "vocab.json",
                   "merges.txt", "vocab.txt")
"""What AutoTokenizer reads to build a tokenizer (the model's config too, for its type): a
change in any of them makes a new entry. Hashed, not parsed."""
FOLDER = "decoders"


@dataclass(frozen=True)
class BackendTokenizer:
    """What the detokenizer uses of a fast tokenizer, answered by its Rust backend alone (as
    transformers' TokenizersBackend answers it)."""

    backend_tokenizer: Any
    """A tokenizers.Tokenizer."""

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)


def load_decoder(model: str, cache_dir: str | None = None) -> Any:
    """The model's tokenizer for decoding: the stored backend when there is one, else the
    transformers tokenizer (whose backend is then stored, when it can stand for it)."""
    path = _entry(model, cache_dir)
    if path is not None and path.is_file():
        from tokenizers import Tokenizer

        try:
            return BackendTokenizer(Tokenizer.from_str(path.read_text()))
        except Exception as exc:  # noqa: BLE001 - the library's errors have no common type
            log.debug("detokenizer: rebuilding the stored tokenizer %s: %s", path, exc)
    tokenizer = load_tokenizer(model)
    if path is not None and _backend_stands_for(tokenizer):
        _store(path, tokenizer.backend_tokenizer.to_str())
    return tokenizer


def _entry(model: str, cache_dir: str | None) -> Path | None:
    """Where this model's backend is stored: None when its files cannot be read."""
    digest = hashlib.sha256()
    for library in ("transformers", "tokenizers"):
        try:
            digest.update(f"{library}={metadata.version(library)}\n".encode())
        except metadata.PackageNotFoundError:
            return None
    try:
        for name in TOKENIZER_FILES:
            path = Path(model, name)
            if path.is_file():
                digest.update(f"{name}:".encode() + path.read_bytes() + b"\n")
    except OSError:
        return None
    return cache_root(cache_dir) / FOLDER / f"{digest.hexdigest()[:32]}.json"


def _backend_stands_for(tokenizer: Any) -> bool:
    """Whether the detokenizer's calls on this tokenizer are its backend's, unchanged."""
    from transformers import PreTrainedTokenizerFast as Fast  # TokenizersBackend in 5.x

    if not isinstance(tokenizer, Fast):
        return False
    kind = type(tokenizer)
    return (kind.convert_ids_to_tokens is Fast.convert_ids_to_tokens
            and kind.added_tokens_decoder is Fast.added_tokens_decoder
            and kind.backend_tokenizer is Fast.backend_tokenizer)


def _store(path: Path, text: str) -> None:
    """Write the entry whole (a temporary file renamed into place), or not at all: a cache
    that cannot be written costs the next start-up its speed only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.debug("detokenizer: could not store the tokenizer in %s: %s", path, exc)
