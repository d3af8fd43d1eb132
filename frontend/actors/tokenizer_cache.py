"""Loading a model's tokenizer in a fraction of the time, from what an earlier load stored.

AutoTokenizer decides which tokenizer class a model uses by reading the model's config
through transformers' config classes, which import torch, `torch.distributed.tensor` and
sympy: about 2 s of CPU before the tokenizer itself is built. The decision depends only on
the model's files and the library's version, so the first load stores the class it chose, and
a later load with the same files and versions builds that class directly (`from_pretrained`
with the same arguments AutoTokenizer passes it for a local directory).

The detokenizer needs even less: decoding ids, spelling tokens and the added tokens are all
the fast tokenizer's Rust backend's (transformers forwards those calls to it). The first load
also stores the backend, serialized, and the detokenizer later reads it without transformers
(0.1 s instead of seconds).

Entries live in nanopipe's cache (`~/.cache/nanopipe/tokenizers/`, or `$NANOPIPE_CACHE`),
named by a digest of the model's tokenizer files and the transformers and tokenizers versions.
Only a class transformers exports by name is stored, a backend only when the class leaves
those calls to it; an entry that does not load is rebuilt; a cache that cannot be written
costs the next start-up its speed only.
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

from frontend.embedded_model.cache import cache_root
from protocol import model_config as hf

log = logging.getLogger("nanopipe.tokenizers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", hf.CONFIG_FILE, "tokenizer.model", "vocab.json",
                   "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
"""What AutoTokenizer reads to build a tokenizer (the model's config too, for its type): a
change in any of them makes a new entry. Hashed, not parsed."""
FOLDER = "tokenizers"


@dataclass(frozen=True)
class BackendTokenizer:
    """What the detokenizer uses of a fast tokenizer, answered by its Rust backend alone (as
    transformers' fast tokenizer answers it)."""

    backend_tokenizer: Any
    """A tokenizers.Tokenizer."""

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)


def load_tokenizer(model: str, cache_dir: str | None = None) -> Any:
    """The tokenizer AutoTokenizer gives for the model directory `model`."""
    entry = _entry(model, cache_dir)
    name = _read(entry, ".class")
    if name is not None:
        import transformers

        tokenizer_class = getattr(transformers, name, None)
        if isinstance(tokenizer_class, type):
            return tokenizer_class.from_pretrained(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if entry is not None:
        _remember(entry, tokenizer)
    return tokenizer


def load_decoder(model: str, cache_dir: str | None = None) -> Any:
    """The model's tokenizer for decoding: the stored backend when there is one, else the
    transformers tokenizer (whose backend is then stored, when it can stand for it)."""
    entry = _entry(model, cache_dir)
    text = _read(entry, ".backend.json")
    if text is not None:
        from tokenizers import Tokenizer

        try:
            return BackendTokenizer(Tokenizer.from_str(text))
        except Exception as exc:  # noqa: BLE001 - the library's errors have no common type
            log.debug("rebuilding the stored tokenizer %s: %s", entry, exc)
    tokenizer = load_tokenizer(model, cache_dir)
    if entry is not None:  # a missing or broken backend is stored again
        _remember(entry, tokenizer)
    return tokenizer


def _entry(model: str, cache_dir: str | None) -> Path | None:
    """The stem of this model's entries: None when its files cannot be read."""
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
        root = cache_root(cache_dir)
    except (OSError, RuntimeError):  # RuntimeError: no home directory to cache in
        return None
    return root / FOLDER / digest.hexdigest()[:32]


def _read(entry: Path | None, suffix: str) -> str | None:
    if entry is None:
        return None
    try:
        return entry.with_name(entry.name + suffix).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _remember(entry: Path, tokenizer: Any) -> None:
    """Store the class AutoTokenizer chose and, when it can stand for it, the backend."""
    import transformers
    from transformers import PreTrainedTokenizerFast as Fast  # TokenizersBackend in 5.x

    kind = type(tokenizer)
    if isinstance(tokenizer, Fast) and all(
            getattr(kind, name) is getattr(Fast, name)
            for name in ("convert_ids_to_tokens", "added_tokens_decoder", "backend_tokenizer")):
        _store(entry, ".backend.json", tokenizer.backend_tokenizer.to_str())
    if getattr(transformers, kind.__name__, None) is kind:
        _store(entry, ".class", kind.__name__)


def _store(entry: Path, suffix: str, text: str) -> None:
    """Write one file whole (a temporary file renamed into place), or not at all."""
    path = entry.with_name(entry.name + suffix)
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
        log.debug("could not store %s: %s", path, exc)
