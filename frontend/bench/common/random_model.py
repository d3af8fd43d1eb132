"""Random-weight checkpoints of real model shapes, built on the device itself (no download).

Speed depends on the shapes, not the weights, so the benchmarks run on these; a word-level
tokenizer that names every id lets them go through the whole pipeline.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": dict(model_type="qwen3", eos_token_id=151645,
                       vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                       max_position_embeddings=40960),
    "qwen3-8b": dict(model_type="qwen3", eos_token_id=151645,
                     vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                     max_position_embeddings=40960),
    # The embedded default model's shape (frontend.embedded_model: SmolLM2-135M-Instruct).
    "smollm2-135m": dict(model_type="llama", eos_token_id=2, vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def param_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3 or Llama checkpoint with config `c`, by its Hugging Face
    name (Llama has no q/k norms)."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if c.get("model_type", "qwen3") == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (d,),
                           p + "self_attn.k_norm.weight": (d,)})
    return shapes


def make_random(shape: str, out_dir: Path, device: str, tokenizer: bool = False,
                max_positions: int | None = None) -> Path:
    """Random bf16 weights of a real model shape in out_dir; with `tokenizer`, also a
    synthetic one, for runs through the whole pipeline. `max_positions` above the shape's
    own limit raises the config's max_position_embeddings to it: a step's cost at a long
    max_model_len can then be measured on a shape whose real checkpoint reaches that length
    only through rope scaling (Qwen3's YaRN to 131,072), which the speed does not depend on."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    c = SHAPES[shape]
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in c.items() if k != "model_type"}
    if max_positions is not None and max_positions > config["max_position_embeddings"]:
        config["max_position_embeddings"] = max_positions
    AutoConfig.for_model(c["model_type"], **config, dtype="bfloat16").save_pretrained(out_dir)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, s in param_shapes(c).items():
        if len(s) == 1:
            tensors[name] = torch.ones(s, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(s, dtype=torch.bfloat16, device=device)
            tensors[name] = t.normal_(0.0, 0.02, generator=g)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    if tokenizer:
        write_synthetic_tokenizer(out_dir, c["vocab_size"])
    return out_dir


def write_synthetic_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer that names every id, so random-weight models run end to end."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="t0")
    fast.save_pretrained(model_dir)


def param_count(model_dir: str) -> int:
    """Parameters in a checkpoint, read from the safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total
