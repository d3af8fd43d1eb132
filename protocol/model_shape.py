"""What nanopipe can run, and a model's shape as config.json gives it; no torch.

The one place that decides the supported model types and dtypes and parses a config.json
into the shape a worker builds. The launcher checks a model with it before any process
starts; gpu_workers.config.ModelConfig is this shape plus the torch dtype, so both refuse a
model with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import model_config as hf
from protocol.head_partition import HeadShard, partition_heads

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
"""Each accepted dtype name (a leading `torch.` is dropped) and the torch dtype it names."""


def canonical_dtype(name: str) -> str:
    """The torch dtype attribute `name` stands for; ValueError listing the accepted names."""
    try:
        return DTYPE_NAMES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {name!r}") from None


def check_model_type(model_type: Any) -> str:
    """`model_type` if nanopipe runs it; ValueError naming the supported ones otherwise."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )
    return model_type


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A supported model's architecture; `dtype_name` is the torch dtype it runs in."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    dtype_name: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> ModelShape:
        return ModelShape.from_dict(hf.read_model_config(model_dir), dtype)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], dtype: str | None = None) -> ModelShape:
        """The shape of config.json `cfg` run in `dtype` (None: the checkpoint's, or float32);
        ValueError for an unsupported type or dtype, ModelConfigError for a missing field."""
        model_type = check_model_type(cfg.get("model_type"))
        heads, kv_heads = hf.attention_heads(cfg)
        hidden = hf.positive_int(cfg, "hidden_size")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        dtype_name = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return ModelShape(
            model_type=model_type,
            vocab_size=hf.positive_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=hf.positive_int(cfg, "intermediate_size"),
            num_layers=hf.positive_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.positive_int(cfg, "head_dim") if cfg.get("head_dim") is not None
            else hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype_name=canonical_dtype(dtype_name),
            max_position_embeddings=hf.max_position_embeddings(cfg),
            eos_token_ids=hf.eos_token_ids(cfg),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    def head_shards(self, world_size: int) -> list[HeadShard]:
        """Each rank's attention heads (ValueError if world_size cannot run this model)."""
        return partition_heads(self.num_heads, self.num_kv_heads, world_size)
