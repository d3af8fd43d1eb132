"""Load Hugging Face safetensors checkpoints (single file or sharded) into a CausalLM.

Each parameter's owning layer slices out its tensor-parallel shard (uneven shards included,
see protocol.head_partition); the packed qkv_proj and gate_up_proj take their parts from the
separate HF tensors by shard id, or from a checkpoint that stores them packed already, which is
cut into those parts first.

A checkpoint quantized for an fp8 KV cache carries per-layer scalars
`model.layers.N.self_attn.k_scale` and `.v_scale` (older ones `...k_proj.k_scale`, or one
`kv_scale` for both): they become the layer's KV scales (kernels/kv_quant.py), which only an
fp8 cache uses. Without them the scales stay 1.0.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from gpu_workers.cpu_threads import one_thread
from protocol.checkpoint_files import checkpoint_files

# HF tensor name piece -> (our packed module name, shard id)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED = ("rotary_emb.inv_freq",)
_KV_SCALE = re.compile(r"^(?P<attn>.*\.self_attn)\.(?:[kv]_proj\.)?(?P<which>k|v|kv)_scale$")


def _target(name: str) -> tuple[str, object]:
    for piece, (packed, shard) in PACKED.items():
        if f".{piece}." in name:
            return name.replace(f".{piece}.", f".{packed}."), shard
    return name, None


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    with torch.no_grad(), one_thread():  # bulk copies: cpu_threads.py says why
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED) or (tied and name == "lm_head.weight"):
                        continue
                    if scale := _KV_SCALE.match(name):
                        _load_kv_scale(model, name, scale, f.get_tensor(name))
                        continue
                    target, shard = _target(name)
                    param = params.get(target)
                    if param is None:
                        raise KeyError(f"checkpoint tensor {name!r} matches no model parameter")
                    owner = model.get_submodule(target.rsplit(".", 1)[0])
                    tensor = f.get_tensor(name)
                    if shard is None and hasattr(owner, "packed_shards"):
                        for part, piece in _unpack(name, tensor, owner.packed_shards):
                            owner.load(param, piece, part)
                            loaded.add(f"{target}:{part}")
                        continue
                    if hasattr(owner, "load"):
                        owner.load(param, tensor, shard)
                    else:
                        if tuple(tensor.shape) != tuple(param.shape):
                            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != "
                                             f"{tuple(param.shape)}")
                        param.data.copy_(tensor)
                    loaded.add(target if shard is None else f"{target}:{shard}")
    _check_complete(params, loaded)


def _load_kv_scale(model: nn.Module, name: str, match: re.Match, tensor: torch.Tensor) -> None:
    """One layer's K and/or V scale: a positive finite scalar, or a ValueError naming it."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV scale must be one number per layer, got shape "
                         f"{tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: a KV scale must be positive and finite, got {value}")
    attn = model.get_submodule(match["attn"]).attn
    for which in ("k", "v") if match["which"] == "kv" else (match["which"],):
        attn.scales[f"{which}_scale"] = value


def _unpack(name: str, tensor: torch.Tensor, parts: tuple[tuple[object, int], ...]):
    """(shard id, tensor) of each part of a packed checkpoint tensor, split along dim 0."""
    sizes = [size for _, size in parts]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} (parts {sizes})")
    return zip([part for part, _ in parts], tensor.split(sizes, dim=0), strict=True)


def _expected(name: str) -> list[str]:
    if ".qkv_proj." in name:
        return [f"{name}:{s}" for s in "qkv"]
    if ".gate_up_proj." in name:
        return [f"{name}:0", f"{name}:1"]
    return [name]


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = [key for name in params for key in _expected(name) if key not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
