"""Settings for small CPU pipelines used by the end-to-end tests."""

from __future__ import annotations

import json
import os


def kv_bytes_per_token(model_dir: str, itemsize: int = 4) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * itemsize


def tiny_engine(model_dir: str, **overrides) -> dict:
    """Keyword arguments of EngineConfig (and LLM) for a small CPU pipeline."""
    settings = dict(model=model_dir, device="cpu", dtype="float32", max_model_len=256,
                    max_num_seqs=64, max_num_batched_tokens=512)
    settings.update(overrides)
    return settings
