"""Each rank loads exactly its uneven shard, from split or packed (qkv_proj, gate_up_proj)
checkpoints alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from gpu_workers.config import ModelConfig
from gpu_workers.layers.parallel import TPInfo
from gpu_workers.loader import load_weights
from gpu_workers.models import CausalLM
from protocol.head_partition import even_split, partition_heads

SHAPE = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=98)
D = 16  # head_dim of the tiny models


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("split"), seed=2, **SHAPE)


@pytest.fixture(scope="module")
def packed_dir(split_dir, tmp_path_factory) -> Path:
    """The same weights with q/k/v and gate/up stored packed, as some checkpoints do."""
    out = tmp_path_factory.mktemp("packed")
    tensors = load_file(str(split_dir / "model.safetensors"))
    for name in [n for n in tensors if ".q_proj." in n]:
        parts = [tensors.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        tensors[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    for name in [n for n in tensors if ".gate_proj." in n]:
        parts = [tensors.pop(name.replace("gate_proj", p)) for p in ("gate_proj", "up_proj")]
        tensors[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((split_dir / "config.json").read_text())
    return out


def _load(model_dir: Path, rank: int, tp: int) -> CausalLM:
    model = CausalLM(ModelConfig.from_dir(model_dir), TPInfo(rank, tp), "torch", "cpu", 64)
    load_weights(model, model_dir)
    return model


def _rows(heads: range) -> slice:
    return slice(heads.start * D, heads.stop * D)


@pytest.mark.parametrize("tp", [2, 3, 4, 6])
def test_each_rank_holds_its_heads_and_mlp_columns(split_dir, packed_dir, tp):
    hf = load_file(str(split_dir / "model.safetensors"))
    p = "model.layers.1."
    for rank in range(tp):
        heads = partition_heads(6, 3, tp)[rank]
        mlp = even_split(98, tp)[rank]
        layer = _load(split_dir, rank, tp).model.layers[1]
        attn, ffn = layer.self_attn, layer.mlp
        assert torch.equal(attn.qkv_proj.weight, torch.cat([
            hf[p + "self_attn.q_proj.weight"][_rows(heads.q_heads)],
            hf[p + "self_attn.k_proj.weight"][_rows(heads.kv_heads)],
            hf[p + "self_attn.v_proj.weight"][_rows(heads.kv_heads)],
        ]))
        o_cols = _rows(heads.q_heads)
        assert torch.equal(attn.o_proj.weight, hf[p + "self_attn.o_proj.weight"][:, o_cols])
        assert torch.equal(ffn.gate_up_proj.weight, torch.cat([
            hf[p + "mlp.gate_proj.weight"][mlp.start:mlp.stop],
            hf[p + "mlp.up_proj.weight"][mlp.start:mlp.stop],
        ]))
        down_cols = slice(mlp.start, mlp.stop)
        assert torch.equal(ffn.down_proj.weight, hf[p + "mlp.down_proj.weight"][:, down_cols])
        packed = dict(_load(packed_dir, rank, tp).named_parameters())
        for name, param in _load(split_dir, rank, tp).named_parameters():
            assert torch.equal(packed[name], param), (rank, name)


def test_packed_tensor_of_the_wrong_size_is_refused(packed_dir, tmp_path):
    tensors = load_file(str(packed_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-D]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((packed_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"{name}: 176 rows, expected 192"):
        _load(tmp_path, 0, 2)
