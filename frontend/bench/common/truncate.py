"""A copy of a Hugging Face model directory that keeps only its first N decoder layers.

A draft model for `--speculative draft` must share the target's vocabulary; the target's own
first layers, with its embeddings, final norm and LM head, are the cheapest such draft (and a
fair one: it predicts the target's easy tokens). Tokenizer and generation files are copied.

`python scripts/truncate_model.py SRC_DIR OUT_DIR --layers 4` is its command line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from protocol.model_config import config_path, read_model_config

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_model(src: str | Path, out: str | Path, layers: int) -> Path:
    """Copy `src` to `out` with num_hidden_layers = layers (1 <= layers <= the source's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    config = read_model_config(src)
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in 1..{total}, got {layers}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                config_path(src).name, "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    config["num_hidden_layers"] = layers
    for key in ("layer_types",):  # per-layer lists some configs carry
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    config_path(out).write_text(json.dumps(config, indent=2))
    kept = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) < layers:
                    kept[name] = f.get_tensor(name).contiguous()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
