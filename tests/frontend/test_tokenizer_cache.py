"""Tokenizers from nanopipe's cache: the first load is AutoTokenizer's and stores its choice;
later loads build the same class directly (the tokenizer actor) or read the Rust backend
without transformers (the detokenizer), and encode, template, decode and spell alike."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from frontend.actors.incremental_detok import make_decode_fn
from frontend.actors.token_bytes import TokenBytes
from frontend.actors.tokenizer_cache import BackendTokenizer, load_decoder, load_tokenizer

TEXTS = ["The quick brown fox", "  two  spaces\nand a line", "<|im_end|> in text", "é ü 42"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]


def _entries(cache: Path, suffix: str) -> list[Path]:
    return sorted((cache / "tokenizers").glob(f"*{suffix}"))


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_the_stored_class_builds_autotokenizers_tokenizer(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    reference = AutoTokenizer.from_pretrained(model_dir)
    load_tokenizer(model_dir, str(tmp_path))
    (stored,) = _entries(tmp_path, ".class")
    assert stored.read_text() == type(reference).__name__
    again = load_tokenizer(model_dir, str(tmp_path))
    assert type(again) is type(reference)
    for text in TEXTS:
        for special in (True, False):
            assert again.encode(text, add_special_tokens=special) == \
                reference.encode(text, add_special_tokens=special)
    assert again.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (again.eos_token_id, len(again), again.get_vocab()) == \
        (reference.eos_token_id, len(reference), reference.get_vocab())


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_the_stored_backend_decodes_and_spells_as_transformers(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    built = load_decoder(model_dir, str(tmp_path))
    assert not isinstance(built, BackendTokenizer)  # the first load builds it
    assert len(_entries(tmp_path, ".backend.json")) == 1
    stored = load_decoder(model_dir, str(tmp_path))
    assert isinstance(stored, BackendTokenizer)
    vocab = built.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    ids = random.Random(0).choices(range(vocab), k=400)
    for skip in (False, True):
        assert make_decode_fn(stored)(ids, skip) == make_decode_fn(built)(ids, skip)
    assert TokenBytes(stored).many(list(range(vocab))) == TokenBytes(built).many(list(range(vocab)))
    assert {i: t.content for i, t in stored.added_tokens_decoder.items()} == \
        {i: t.content for i, t in built.added_tokens_decoder.items()}


def test_a_changed_tokenizer_file_makes_a_new_entry(tiny_qwen3_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model)
    load_decoder(str(model), str(tmp_path / "cache"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert not isinstance(load_decoder(str(model), str(tmp_path / "cache")), BackendTokenizer)
    assert len(_entries(tmp_path / "cache", ".backend.json")) == 2


def test_broken_entries_are_rebuilt(tiny_qwen3_dir, tmp_path):
    load_decoder(tiny_qwen3_dir, str(tmp_path))
    (backend,) = _entries(tmp_path, ".backend.json")
    (kind,) = _entries(tmp_path, ".class")
    backend.write_text("{not json")
    kind.write_text("NoSuchTokenizer")
    assert not isinstance(load_decoder(tiny_qwen3_dir, str(tmp_path)), BackendTokenizer)
    assert isinstance(load_decoder(tiny_qwen3_dir, str(tmp_path)), BackendTokenizer)
    assert kind.read_text() != "NoSuchTokenizer"


def test_a_cache_that_cannot_be_written_costs_only_speed(tiny_qwen3_dir, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    tokenizer = load_decoder(tiny_qwen3_dir, str(blocked))
    assert make_decode_fn(tokenizer)([5, 6, 7], False)
    assert load_tokenizer(tiny_qwen3_dir, str(blocked)).encode("hello")
