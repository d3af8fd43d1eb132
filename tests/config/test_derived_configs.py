"""Every process's config is derived from the one EngineConfig: each field a process shares
with it (by name) has the engine's resolved value, and each default is written once."""

from __future__ import annotations

import dataclasses
import json

import pytest

from frontend.actors.detokenizer import DetokenizerConfig
from frontend.engine.config import ENGINE_FIELDS, EngineConfig
from frontend.engine.options import ConfigError
from gpu_workers.config import WorkerConfig
from protocol.limits import BLOCK_SIZE, DEEP_PLAN_MAX_SEQS, MAX_NUM_BATCHED_TOKENS
from scheduler_proc.config import SchedulerConfig


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as far as configs look: a config.json with a long position limit."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    return str(tmp_path)


def _derived(engine: EngineConfig) -> list:
    return [engine.worker_config("tcp://127.0.0.1:1"), engine.scheduler_config(64),
            engine.tokenizer_config(), engine.detokenizer_config()]


@pytest.mark.parametrize("settings", [
    {},
    {"device": "cpu", "block_size": 32, "max_num_seqs": 3, "max_num_batched_tokens": 100,
     "max_model_len": 5000, "overlap": False, "enable_prefix_caching": False, "seed": 7,
     "dtype": "bfloat16", "kv_cache_bytes": 1 << 20, "enforce_eager": True,
     "attention_backend": "torch", "gpu_memory_utilization": 0.5, "served_model_name": "m"},
    {"device": "cuda", "worker_lookahead": True},
])
def test_every_shared_field_has_the_engines_value(model_dir, settings):
    engine = EngineConfig(model=model_dir, **settings)
    for config in _derived(engine):
        shared = {f.name for f in dataclasses.fields(config)} & ENGINE_FIELDS
        assert shared, type(config).__name__
        for name in shared:
            assert getattr(config, name) == engine.resolved(name), \
                f"{type(config).__name__}.{name}"
        if hasattr(config, "model_name"):
            assert config.model_name == engine.model_name


def test_the_detokenizer_gets_max_model_len(model_dir):
    engine = EngineConfig(model=model_dir, max_model_len=300)
    assert engine.detokenizer_config().max_model_len == 300
    assert engine.tokenizer_config().max_model_len == 300


def test_per_device_defaults_are_resolved_once(model_dir):
    for device in ("cpu", "cuda"):
        engine = EngineConfig(model=model_dir, device=device)
        worker, sched = engine.worker_config("x"), engine.scheduler_config(64)
        for config in (worker, sched):
            assert config.block_size == BLOCK_SIZE[device]
            assert config.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS[device]
        assert worker.max_model_len == sched.max_model_len == 4096  # the cap below 8192


@pytest.mark.parametrize("cls, required", [
    (WorkerConfig, {"model": None}),
    (SchedulerConfig, {"num_kv_blocks": 64, "block_size": None, "max_model_len": None}),
])
def test_hand_built_defaults_agree_with_the_engines_cpu_defaults(cls, required, model_dir):
    """The defaults a test relies on when it builds a process config by hand are the
    engine's own (on cpu), not a second opinion."""
    engine = EngineConfig(model=model_dir, device="cpu")
    kw = {k: engine.resolved(k) if v is None else v for k, v in required.items()}
    by_hand = cls(**kw)
    derived = engine._derive(cls, **{k: v for k, v in kw.items() if k not in ENGINE_FIELDS})
    for f in dataclasses.fields(cls):
        if f.name in ENGINE_FIELDS:
            assert getattr(by_hand, f.name) == getattr(derived, f.name), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("overlap,plans_ahead,plans", [(True, 1, 2), (True, 2, 3), (False, 1, 1)])
def test_overlap_headroom_is_one_number_the_worker_receives(model_dir, overlap, plans_ahead,
                                                             plans):
    engine = EngineConfig(model=model_dir, max_model_len=100, block_size=16, max_num_seqs=8,
                          overlap=overlap, worker_lookahead=True, plans_ahead=plans_ahead)
    worker, sched = engine.worker_config("x"), engine.scheduler_config(64)
    assert sched.max_plans_in_flight == plans == worker.max_plans_in_flight
    assert worker.lookahead is overlap  # lookahead needs overlap
    # A sequence may be computed by every plan sent after the one that finished it.
    assert worker.max_seq_tokens == 100 + plans
    assert worker.max_blocks_per_seq == 7 + plans - 1
    assert worker.mirror_rows >= plans * 8


@pytest.mark.parametrize("device,kw,plans,limit", [
    ("cuda", {}, 3, DEEP_PLAN_MAX_SEQS),
    ("cpu", {}, 2, DEEP_PLAN_MAX_SEQS),
    ("cuda", dict(plans_ahead=2), 3, None),
    ("cuda", dict(plans_ahead=1), 2, DEEP_PLAN_MAX_SEQS),
    ("cuda", dict(worker_lookahead=False), 2, DEEP_PLAN_MAX_SEQS),
    ("cuda", dict(overlap=False), 1, DEEP_PLAN_MAX_SEQS),
    ("cuda", dict(speculative="ngram"), 2, DEEP_PLAN_MAX_SEQS)])
def test_plans_ahead_auto_is_two_for_small_batches_on_a_gpu(model_dir, device, kw, plans, limit):
    """Left to auto, a GPU engine may plan two steps ahead (in small all-decoding batches) and
    the worker is sized for it; given explicitly, 2 applies to every step; where it cannot
    work (no overlap, no lookahead, speculation) or on a CPU, auto is 1."""
    engine = EngineConfig(model=model_dir, max_model_len=100, block_size=16, max_num_seqs=8,
                          device=device, **kw)
    worker, sched = engine.worker_config("x"), engine.scheduler_config(64)
    assert sched.max_plans_in_flight == plans == worker.max_plans_in_flight
    assert sched.deep_plan_max_seqs == (None if "plans_ahead" in kw else limit)


@pytest.mark.parametrize("kw,why", [
    (dict(overlap=False), "needs overlap and worker lookahead"),
    (dict(worker_lookahead=False), "needs overlap and worker lookahead"),
    (dict(speculative="ngram"), "does not go with speculative decoding"),
    (dict(plans_ahead=3), "must be in 1..2")])
def test_planning_two_steps_ahead_is_refused_where_it_cannot_work(model_dir, kw, why):
    with pytest.raises(ConfigError, match=why) as err:
        EngineConfig(model=model_dir, **{"plans_ahead": 2, **kw})
    assert err.value.field == "plans_ahead"


def test_detokenizer_config_needs_max_model_len():
    with pytest.raises(TypeError, match="max_model_len"):
        DetokenizerConfig(model="m")


def test_speculation_keeps_overlap_and_lookahead(model_dir):
    """Plans stay ahead of unknown acceptance (the scheduler sizes them for the worst case),
    so speculation changes neither overlap nor worker lookahead; --no-overlap still turns
    both off."""
    engine = EngineConfig(model=model_dir, max_model_len=100, block_size=16, max_num_seqs=8,
                          speculative="ngram")
    worker, sched = engine.worker_config("x"), engine.scheduler_config(64)
    assert worker.lookahead and sched.max_plans_in_flight == 2
    assert worker.max_plans_in_flight == 2
    assert sched.num_speculative_tokens == worker.num_speculative_tokens == 6  # the default
    off = EngineConfig(model=model_dir, max_model_len=100, block_size=16, max_num_seqs=8,
                       speculative="ngram", overlap=False)
    worker, sched = off.worker_config("x"), off.scheduler_config(64)
    assert not worker.lookahead and sched.max_plans_in_flight == 1


def test_the_scheduler_spins_for_results_only_on_a_gpu(model_dir):
    """On a CPU run the workers compute on the host's cores: a spinning scheduler would take
    one from them."""
    gpu = EngineConfig(model=model_dir, device="cuda").scheduler_config(64)
    cpu = EngineConfig(model=model_dir, device="cpu").scheduler_config(64)
    assert gpu.result_spin_s > 0 and cpu.result_spin_s == 0
