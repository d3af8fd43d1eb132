"""The one reader of a model directory's config.json (and generation_config.json).

The launcher's checks, the tokenizer, the workers and the engine config all read the same
few fields; reading them here means one file format, one set of fallbacks (a missing
`max_position_embeddings`, `num_key_value_heads` or `head_dim`) and one wording of every
error. Pure json, no torch: every process may import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_POSITION_EMBEDDINGS = 4096
"""What a config.json without `max_position_embeddings` is taken to allow."""


class ModelConfigError(ValueError):
    """A model directory whose config.json is missing, not JSON, or lacks a field."""


def config_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / CONFIG_FILE


def has_model_config(model_dir: str | Path) -> bool:
    return config_path(model_dir).is_file()


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict; ModelConfigError (one line naming the file) if it cannot be."""
    path = config_path(model_dir)
    if not path.is_file():
        raise ModelConfigError(f"model directory {str(model_dir)!r} has no {CONFIG_FILE}")
    return _read_object(path)


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json as a dict, or {} when the model has none."""
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    return _read_object(path) if path.is_file() else {}


def _read_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def require(config: dict[str, Any], key: str) -> Any:
    """config[key], or a ModelConfigError naming the missing field."""
    try:
        return config[key]
    except KeyError:
        raise ModelConfigError(f"{CONFIG_FILE} lacks {key!r}") from None


def positive_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """config[key] (or `default` when absent), which must be an integer above 0: a size of
    the model's tensors, which a negative or fractional value would make meaningless."""
    value = config.get(key, default) if default is not None else require(config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{CONFIG_FILE}'s {key!r} must be a positive integer, "
                               f"got {value!r}")
    return value


def attention_heads(config: dict[str, Any]) -> tuple[int, int]:
    """(query heads, KV heads); a config without `num_key_value_heads` has one per query head."""
    heads = positive_int(config, "num_attention_heads")
    if config.get("num_key_value_heads") is None:
        return heads, heads
    return heads, positive_int(config, "num_key_value_heads")


def max_position_embeddings(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))


def vocab_size(config: dict[str, Any]) -> int | None:
    """The embedding rows (a multimodal config keeps them under `text_config`), if stated."""
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def eos_token_ids(config: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: it may be absent, one id, or a list of ids."""
    value = config.get("eos_token_id")
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
