"""One reader of config.json (protocol/model_config.py): no other module opens it, and a
broken file is one error that names the file or the field, wherever it is read."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from frontend.actors.model_tokenizer import eos_token_ids, model_vocab_size
from frontend.engine.config import EngineConfig
from frontend.engine.preflight import check_model_fits_tp
from gpu_workers.config import ModelConfig
from protocol import model_config as hf
from protocol.head_partition import partition_from_hf_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "scheduler_proc", "gpu_workers", "kernels", "frontend")
READER = "protocol/model_config.py"
# Writes the config.json of the model it converts; reads none.
WRITERS = {"frontend/embedded_model/gguf_convert.py"}


def test_no_other_module_names_the_model_config_files():
    names = {hf.CONFIG_FILE, hf.GENERATION_CONFIG_FILE}
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == READER or rel in WRITERS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"config.json read outside {READER}: {offenders}"


def test_every_reader_sees_the_same_model(tiny_qwen3_dir):
    raw = json.loads((Path(tiny_qwen3_dir) / "config.json").read_text())
    model = ModelConfig.from_dir(tiny_qwen3_dir)
    assert model.vocab_size == hf.vocab_size(raw) == raw["vocab_size"]
    assert (model.num_heads, model.num_kv_heads) == hf.attention_heads(raw)
    assert len(partition_from_hf_config(raw, 2)) == 2
    engine = EngineConfig(model=tiny_qwen3_dir)
    assert engine.resolved_max_model_len == min(raw["max_position_embeddings"], 4096)

    class NoTokenizer:
        eos_token_id = None

        def __len__(self):
            return 1

    assert model_vocab_size(tiny_qwen3_dir, NoTokenizer()) == raw["vocab_size"]
    assert eos_token_ids(tiny_qwen3_dir, NoTokenizer()) == sorted(model.eos_token_ids)


@pytest.mark.parametrize("text, expected", [
    (None, "has no config.json"),
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "config.json must hold a JSON object, got list"),
    ('{"model_type": "llama"}', "config.json lacks 'num_attention_heads'"),
    ('{"model_type": "llama", "num_attention_heads": 4}', "config.json lacks 'hidden_size'"),
])
def test_a_broken_config_is_one_clear_error_everywhere(tmp_path, text, expected):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(hf.ModelConfigError, match=expected):
        ModelConfig.from_dir(tmp_path)
    engine = EngineConfig(model=str(tmp_path))
    if text is None:  # the engine refuses the directory before anything reads it
        with pytest.raises(ValueError, match="not a model directory with a config.json"):
            engine.model_dir  # noqa: B018
    else:  # the launcher's check, before any process starts
        with pytest.raises(ValueError, match=expected):
            check_model_fits_tp(engine)


def test_eos_ids_merge_generation_config_and_config(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 5, "vocab_size": 9}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 5]}')

    class Tok:
        eos_token_id = 2

    assert eos_token_ids(str(tmp_path), Tok()) == [2, 5, 7]
    assert hf.read_generation_config(tmp_path / "missing") == {}
