"""Does config.json describe the checkpoint beside it? Checked from the safetensors headers.

A config that disagrees with its weights does not fail on its own: too many layers allocate
a model the checkpoint cannot fill (gigabytes, then a hang), and a smaller
`intermediate_size` loads a slice of each tensor and serves wrong tokens. So before any
process starts, every tensor the config implies must be in the checkpoint with the shape it
implies, and every layer the checkpoint holds must be one the config has; each refusal is
one line naming the tensor, its file and the config fields that imply its shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from protocol.checkpoint_files import CheckpointError, TensorSpec, read_tensor_specs
from protocol.model_config import CONFIG_FILE
from protocol.model_shape import ModelShape

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors a checkpoint may carry that the model recomputes (the loader skips them too)."""
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Expected:
    """A tensor the config implies: its shape and the config fields that decide it."""

    shape: tuple[int, ...]
    fields: str


def _layer_tensors(m: ModelShape, packed_qkv: bool, packed_gate_up: bool
                   ) -> dict[str, Expected]:
    """The tensors of one decoder layer, by name below `model.layers.N.`."""
    h, d, i = m.hidden_size, m.head_dim, m.intermediate_size
    q, kv = m.num_heads * d, m.num_kv_heads * d
    hf, qf = "hidden_size", "num_attention_heads, head_dim"
    kvf = "num_key_value_heads, head_dim"
    out = {
        "input_layernorm.weight": Expected((h,), hf),
        "post_attention_layernorm.weight": Expected((h,), hf),
        "self_attn.o_proj.weight": Expected((h, q), f"hidden_size, {qf}"),
        "mlp.down_proj.weight": Expected((h, i), "hidden_size, intermediate_size"),
    }
    if packed_qkv:
        out["self_attn.qkv_proj.weight"] = Expected((q + 2 * kv, h), f"{qf}, {kvf}, {hf}")
        if m.qkv_bias:
            out["self_attn.qkv_proj.bias"] = Expected((q + 2 * kv,), f"{qf}, {kvf}")
    else:
        for name, rows, fields in (("q", q, qf), ("k", kv, kvf), ("v", kv, kvf)):
            out[f"self_attn.{name}_proj.weight"] = Expected((rows, h), f"{fields}, {hf}")
            if m.qkv_bias:
                out[f"self_attn.{name}_proj.bias"] = Expected((rows,), fields)
    if m.qk_norm:
        out["self_attn.q_norm.weight"] = Expected((d,), "head_dim")
        out["self_attn.k_norm.weight"] = Expected((d,), "head_dim")
    if packed_gate_up:
        out["mlp.gate_up_proj.weight"] = Expected((2 * i, h), "intermediate_size, hidden_size")
    else:
        out["mlp.gate_proj.weight"] = Expected((i, h), "intermediate_size, hidden_size")
        out["mlp.up_proj.weight"] = Expected((i, h), "intermediate_size, hidden_size")
    return out


def expected_tensors(m: ModelShape, names: set[str]) -> dict[str, Expected]:
    """Every tensor `m` loads, by checkpoint name; q/k/v and gate/up are expected packed
    where the checkpoint (`names`) stores them packed."""
    packed_qkv = "model.layers.0.self_attn.qkv_proj.weight" in names
    packed_gate_up = "model.layers.0.mlp.gate_up_proj.weight" in names
    vocab = Expected((m.vocab_size, m.hidden_size), "vocab_size, hidden_size")
    out = {"model.embed_tokens.weight": vocab,
           "model.norm.weight": Expected((m.hidden_size,), "hidden_size")}
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = vocab
    layer = _layer_tensors(m, packed_qkv, packed_gate_up)
    for n in range(m.num_layers):
        out.update((f"model.layers.{n}.{name}", spec) for name, spec in layer.items())
    return out


def _checkpoint_layers(names: set[str]) -> int:
    """How many decoder layers the checkpoint holds (one past the highest index)."""
    found = [int(match.group(1)) for name in names if (match := LAYER.match(name))]
    return max(found) + 1 if found else 0


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_checkpoint_matches(model_dir: str | Path, shape: ModelShape) -> None:
    """Refuse (CheckpointError, one line) a checkpoint that `shape`, read from the same
    directory's config.json, does not describe: a corrupt file, another layer count, a
    missing tensor, one of another shape, or one the model has no place for."""
    specs: dict[str, TensorSpec] = read_tensor_specs(model_dir)
    names = set(specs)
    layers = _checkpoint_layers(names)
    if layers != shape.num_layers:  # first: a huge count must not build a huge table
        raise CheckpointError(f"{CONFIG_FILE}'s num_hidden_layers is {shape.num_layers} but "
                              f"the checkpoint holds weights for {layers} layers")
    expected = expected_tensors(shape, names)
    for name, want in expected.items():
        spec = specs.get(name)
        if spec is None:
            raise CheckpointError(f"the checkpoint lacks {name}, which {CONFIG_FILE} "
                                  f"implies ({want.fields})")
        if spec.shape != want.shape:
            raise CheckpointError(f"{name} in {spec.file} is {_dims(spec.shape)} but "
                                  f"{CONFIG_FILE}'s {want.fields} make it {_dims(want.shape)}")
    tied_head = shape.tie_word_embeddings and "lm_head.weight" in names
    for name in sorted(names - expected.keys()):
        if name.endswith(IGNORED_SUFFIXES) or (tied_head and name == "lm_head.weight"):
            continue
        raise CheckpointError(f"checkpoint tensor {name} in {specs[name].file} is no "
                              f"weight of the model {CONFIG_FILE} describes")
