"""The detokenizer's tokenizer from nanopipe's cache: built by transformers the first time,
read back without it later, and decoding, spelling and listing added tokens alike."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from frontend.actors.decoder_cache import BackendTokenizer, load_decoder
from frontend.actors.incremental_detok import make_decode_fn
from frontend.actors.token_bytes import TokenBytes


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "decoders").glob("*.json"))


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_the_stored_tokenizer_decodes_and_spells_as_transformers(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    built = load_decoder(model_dir, str(tmp_path))
    assert not isinstance(built, BackendTokenizer)  # the first load builds it
    assert len(_entries(tmp_path)) == 1
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
    assert len(_entries(tmp_path / "cache")) == 2


def test_a_broken_entry_is_rebuilt(tiny_qwen3_dir, tmp_path):
    load_decoder(tiny_qwen3_dir, str(tmp_path))
    (entry,) = _entries(tmp_path)
    entry.write_text("{not json")
    assert not isinstance(load_decoder(tiny_qwen3_dir, str(tmp_path)), BackendTokenizer)
    assert isinstance(load_decoder(tiny_qwen3_dir, str(tmp_path)), BackendTokenizer)


def test_a_cache_that_cannot_be_written_costs_only_speed(tiny_qwen3_dir, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    tokenizer = load_decoder(tiny_qwen3_dir, str(blocked))
    assert make_decode_fn(tokenizer)([5, 6, 7], False)
