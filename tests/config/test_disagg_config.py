"""Prefill/decode disaggregation's settings: the flags parse into EngineConfig, and what does
not go together is refused in one line naming the field."""

from __future__ import annotations

import pytest

from frontend.engine.cli import parse_serve_args
from frontend.engine.config import EngineConfig
from frontend.engine.options import ConfigError


def test_flags_give_the_replica_roles():
    engine = parse_serve_args(["--prefill-replicas", "1", "--decode-replicas", "2"]).engine
    assert (engine.prefill_replicas, engine.decode_replicas, engine.num_replicas) == (1, 2, 3)
    assert engine.replica_roles == ("prefill", "decode", "decode")
    assert EngineConfig(data_parallel_size=2).replica_roles == ("", "")


@pytest.mark.parametrize("settings, field, words", [
    (dict(prefill_replicas=1), "decode_replicas", "must be >= 1"),
    (dict(decode_replicas=2), "prefill_replicas", "must be >= 1"),
    (dict(prefill_replicas=1, decode_replicas=1, data_parallel_size=2), "data_parallel_size",
     "--dp"),
    (dict(prefill_replicas=1, decode_replicas=1, speculative="draft", draft_model="/d"),
     "speculative", "draft is not supported .* use ngram"),
])
def test_what_does_not_go_together_is_refused(settings, field, words):
    with pytest.raises(ConfigError, match=words) as info:
        EngineConfig(**settings)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_kv_transfer_timeout_flag_reaches_the_schedulers(capsys):
    argv = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    engine = parse_serve_args([*argv, "--kv-transfer-timeout", "2.5"]).engine
    assert engine.kv_transfer_timeout == 2.5
    assert engine.scheduler_config(64).transfer_timeout_s == 2.5
    assert parse_serve_args(argv).engine.scheduler_config(64).transfer_timeout_s == 30.0
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            parse_serve_args([*argv, "--kv-transfer-timeout", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == f"nanopipe serve: --kv-transfer-timeout must be > 0, got {float(bad)}"
    with pytest.raises(ConfigError, match="kv_transfer_timeout must be > 0"):
        EngineConfig(prefill_replicas=1, decode_replicas=1, kv_transfer_timeout=0)


@pytest.mark.parametrize("visible, explicit, mode", [
    ("0", None, "shared"),  # one GPU for both replicas: shared pools through CUDA IPC
    ("0", "frames", "frames"),
    ("0,1", None, "frames"),  # a GPU each, no peer access here: frames
])
def test_kv_transfer_auto_on_cuda(monkeypatch, visible, explicit, mode):
    from frontend.engine.disagg import kv_transfer_mode

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = EngineConfig(device="cuda", prefill_replicas=1, decode_replicas=1,
                       kv_transfer=explicit)
    assert kv_transfer_mode(cfg) == mode
    assert kv_transfer_mode(EngineConfig(device="cpu", prefill_replicas=1,
                                         decode_replicas=1)) == "shared"
