"""Prefill/decode disaggregation's settings: the flags parse into EngineConfig, and what does
not go together is refused in one line naming the field."""

from __future__ import annotations

import pytest

from frontend.engine import disagg_gpus
from frontend.engine.cli import parse_serve_args
from frontend.engine.config import EngineConfig
from frontend.engine.disagg import gpus_shared, kv_transfer_mode, worker_env
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



def peers(monkeypatch, visible: str, reachable: bool) -> None:
    """`visible` GPUs, each able to read every other's memory directly or none."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(disagg_gpus, "can_access_peer", lambda reader, owner: reachable)


def split(**kw) -> EngineConfig:
    return EngineConfig(device="cuda", prefill_replicas=1, decode_replicas=1, **kw)


@pytest.mark.parametrize("visible, reachable, explicit, mode", [
    ("0", False, None, "shared"),  # one GPU for both replicas: CUDA IPC on that GPU
    ("0", False, "frames", "frames"),
    ("0,1", True, None, "shared"),  # a GPU each, with peer access: CUDA IPC across them
    ("0,1", True, "frames", "frames"),
    ("0,1", False, None, "frames"),  # no peer access: auto keeps frames
])
def test_kv_transfer_auto_on_cuda(monkeypatch, visible, reachable, explicit, mode):
    peers(monkeypatch, visible, reachable)
    assert kv_transfer_mode(split(kv_transfer=explicit)) == mode
    cpu = EngineConfig(device="cpu", prefill_replicas=1, decode_replicas=1)
    assert kv_transfer_mode(cpu) == "shared" and worker_env(cpu, 1) is None


def test_shared_without_peer_access_is_refused_naming_the_gpus(monkeypatch):
    peers(monkeypatch, "3,5", False)
    with pytest.raises(ConfigError, match=r"kv_transfer shared cannot work here: GPU 5 \(a "
                       r"decode rank's\) has no peer access to GPU 3 \(its prefill rank's\); "
                       r"use frames \(--kv-transfer frames\)") as info:
        split(kv_transfer="shared")
    assert "\n" not in str(info.value)
    peers(monkeypatch, "3,5", True)
    assert kv_transfer_mode(split(kv_transfer="shared")) == "shared"


@pytest.mark.parametrize("reachable, envs", [
    (True, ["4,5,6,7,0,1", "6,7,4,5,0,1", "0,1,4,5,6,7"]),  # shared: all, own group first
    (False, ["4,5", "6,7", "0,1"]),  # frames: each replica its own group, as with --dp
])
def test_each_worker_sees_its_own_group_first(monkeypatch, reachable, envs):
    """tp 2, one prefill and two decode replicas on six GPUs; a seventh is left out."""
    peers(monkeypatch, "4,5,6,7,0,1,2", reachable)
    cfg = EngineConfig(device="cuda", prefill_replicas=1, decode_replicas=2,
                       tensor_parallel_size=2)
    assert [worker_env(cfg, i)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == envs
    assert not gpus_shared(cfg)


def test_one_gpu_for_every_replica_is_left_as_it_was(monkeypatch):
    peers(monkeypatch, "2", False)
    cfg = split()
    assert gpus_shared(cfg) and kv_transfer_mode(cfg) == "shared"
    assert [worker_env(cfg, i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "2"}] * 2
    assert cfg.worker_config("").gpu_share


def test_the_decode_ranks_read_the_prefill_ranks_of_their_index():
    assert disagg_gpus.reading_pairs(2, 1, 2) == [(2, 0), (3, 1), (4, 0), (5, 1)]
    assert disagg_gpus.reading_pairs(1, 2, 1) == [(2, 0), (2, 1)]
    assert disagg_gpus.worker_gpus(list("abcd"), 1, 4, 2, True) == list("cabd")


def test_without_cuda_visible_devices_the_gpus_are_counted_as_the_launcher_counts_them(
        monkeypatch):
    """From the driver's listing (frontend.engine.torch_build), not by importing torch."""
    from frontend.engine import torch_build

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch_build, "gpu_count", lambda: 3)
    assert torch_build.visible_gpus() == ["0", "1", "2"]
