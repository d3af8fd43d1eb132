"""--kv-cache-dtype: auto or fp8 (fp8_e4m3 is the same) on the command line, LLM and the
configs; a bad value, or fp8 with flash-attn, is a one-line error before anything starts."""

from __future__ import annotations

import json

import pytest

from frontend.engine.config import EngineConfig
from frontend.engine.serve_flags import parse_serve_args
from gpu_workers.config import ModelConfig, WorkerConfig


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 128,
        "vocab_size": 100, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    return str(tmp_path)


@pytest.mark.parametrize("given, worker", [("auto", "auto"), ("fp8", "fp8"),
                                           ("fp8_e4m3", "fp8")])
def test_each_spelling_reaches_the_workers_as_auto_or_fp8(model_dir, given, worker):
    engine = EngineConfig(model=model_dir, device="cpu", kv_cache_dtype=given)
    assert engine.worker_config("tcp://127.0.0.1:1").kv_cache_dtype == worker
    args = parse_serve_args(["--model", model_dir, "--device", "cpu", "--kv-cache-dtype", given])
    assert args.engine.kv_cache_dtype == given


def test_the_default_is_auto_the_models_dtype(model_dir):
    engine = EngineConfig(model=model_dir, device="cpu")
    assert engine.kv_cache_dtype == "auto" and engine.kv_cache_label == "model dtype"
    assert EngineConfig(model=model_dir, device="cpu", kv_cache_dtype="fp8").kv_cache_label \
        == "fp8_e4m3"


def test_fp8_halves_the_bytes_a_token_takes(model_dir):
    import torch

    auto = ModelConfig.from_dir(model_dir)
    fp8 = ModelConfig.from_dir(model_dir, kv_cache_dtype="fp8_e4m3")
    assert auto.kv_dtype == torch.bfloat16 and fp8.kv_dtype == torch.float8_e4m3fn
    assert fp8.dtype == torch.bfloat16  # the weights keep theirs
    assert 2 * fp8.kv_bytes_per_token() == auto.kv_bytes_per_token() == 2 * 3 * 2 * 16 * 2


@pytest.mark.parametrize("kwargs, expected", [
    ({"kv_cache_dtype": "int8"}, "EngineConfig.kv_cache_dtype must be one of 'auto', 'fp8', "
                                 "'fp8_e4m3', got 'int8'"),
    ({"kv_cache_dtype": "FP8"}, "EngineConfig.kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8", "device": "cuda", "attention_backend": "flash_attn",
      "block_size": 256}, "EngineConfig.kv_cache_dtype fp8 needs the Triton attention kernels"),
])
def test_a_bad_value_is_a_one_line_error_naming_the_field(kwargs, expected):
    with pytest.raises(ValueError, match=expected) as err:
        EngineConfig(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv, expected", [
    (["--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice: 'int8'"),
    (["--device", "cuda", "--attention-backend", "flash_attn", "--block-size", "256",
      "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs the Triton attention kernels"),
])
def test_a_bad_flag_is_a_usage_error(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_llm_refuses_a_bad_value_before_starting():
    from frontend.engine.llm import LLM

    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype must be one of"):
        LLM("/no/model", kv_cache_dtype="e5m2")


def test_a_hand_built_worker_config_checks_it_too():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        WorkerConfig(model="/m", kv_cache_dtype="fp16")
