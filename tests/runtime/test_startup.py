"""Start-up: config parsing, KV sizing errors, sharded checkpoints, the worker process."""

from __future__ import annotations

import json
import multiprocessing
import shutil

import pytest
import zmq
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner
from safetensors.torch import load_file, save_file

from gpu_workers import KVCacheTooSmall, ModelConfig, WorkerConfig
from gpu_workers.worker_proc import run_worker
from protocol import (
    CachedSequences,
    Endpoints,
    NewSequence,
    Ready,
    SamplingParams,
    Shutdown,
    StartupFailed,
    StepPlan,
    StepResult,
)
from protocol.control import StartupProgress
from protocol.sockets import MessageSocket


def test_kv_pool_too_small_for_max_model_len_fails_with_advice(tiny_qwen3_dir):
    # 512 bytes per token (2 layers x 2 kv heads x 16 x fp32 x K,V): 64 KiB hold 128 tokens.
    with pytest.raises(KVCacheTooSmall) as err:
        make_runner(tiny_qwen3_dir, max_model_len=256, kv_cache_bytes=64 * 1024)
    msg = str(err.value)
    assert "max_model_len=256" in msg and "lower max_model_len (--max-model-len)" in msg
    assert "raise kv_cache_bytes=65536 (--kv-cache-bytes)" in msg  # the LLM's name and the flag


def test_worker_config_rejects_bad_values():
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig(model="x", attention_backend="magic")
    with pytest.raises(ValueError, match="device"):
        WorkerConfig(model="x", device="tpu")


def test_model_config_variants():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    qwen2 = ModelConfig.from_dict({**base, "model_type": "qwen2", "rope_theta": 1e6,
                                   "torch_dtype": "bfloat16", "eos_token_id": [1, 2]})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.head_dim == 16
    assert qwen2.eos_token_ids == (1, 2) and str(qwen2.dtype) == "torch.bfloat16"
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 5e5}
    llama = ModelConfig.from_dict({**base, "model_type": "llama", "rope_parameters": scaling},
                                  dtype="float32")
    assert llama.rope_theta == 5e5 and llama.rope_scaling["rope_type"] == "llama3"
    assert not llama.qkv_bias and not llama.qk_norm
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})


def test_sharded_checkpoint_loads_like_a_single_file(tiny_llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = load_file(f"{tiny_llama_dir}/model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(sharded / fname))
        weight_map.update({n: fname for n in chunk})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner = make_runner(str(sharded))
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    (p,) = random_prompts(9, [21])
    planner.add(0, p, 8)
    assert planner.run(runner)[0] == hf_greedy(tiny_llama_dir, p, 8)


def test_checkpoint_missing_a_tensor_is_refused(tiny_qwen3_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    tensors = load_file(f"{tiny_qwen3_dir}/model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        make_runner(str(broken))


def _worker_config(model_dir: str, **kw) -> WorkerConfig:
    return WorkerConfig(model=model_dir, max_model_len=128, block_size=BLOCK_SIZE,
                        max_num_seqs=4, max_num_batched_tokens=256, kv_cache_bytes=1 << 20, **kw)


def _start(config: WorkerConfig):
    endpoints = Endpoints.ipc(1)  # short private dir: ipc paths have a length limit
    ctx = zmq.Context()
    control = MessageSocket(ctx, zmq.PULL, endpoints.control, bind=True,
                            accepts=(Ready, StartupFailed, StartupProgress))
    results = MessageSocket(ctx, zmq.PULL, endpoints.step_results, bind=True,
                            accepts=(StepResult,))
    proc = multiprocessing.get_context("spawn").Process(
        target=run_worker, args=(config, 0, 1, endpoints))
    proc.start()
    while True:  # what start-up is doing, then Ready or StartupFailed
        assert control.poll(120_000), "worker did not report"
        report = control.recv()
        if not isinstance(report, StartupProgress):
            return ctx, endpoints, control, results, proc, report


def test_worker_process_serves_plans_and_stops(tiny_qwen3_dir):
    ctx, ep, control, results, proc, ready = _start(_worker_config(tiny_qwen3_dir))
    steps = MessageSocket(ctx, zmq.PUSH, ep.worker_steps[0], bind=False)
    try:
        assert isinstance(ready, Ready) and ready.num_kv_blocks == 128
        params = SamplingParams(temperature=0.0)
        prompt = [5, 6, 7, 8]
        steps.send(StepPlan(0, [], [NewSequence(3, prompt, 4, 0, 4, [0], params)],
                            CachedSequences([], [], [])))
        steps.send(StepPlan(1, [], [], CachedSequences([3], [1], [[]])))
        got = []
        for _ in range(2):
            assert results.poll(60_000)
            got.append(results.recv())
        assert [r.step_id for r in got] == [0, 1] and got[0].seq_ids == [3]
        assert [r.token_ids[0] for r in got] == hf_greedy(tiny_qwen3_dir, prompt, 2)
        steps.send(Shutdown(reason="test"))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        for s in (steps, control, results):
            s.close()
        ctx.term()
        ep.cleanup()


def test_worker_process_reports_startup_failure(tiny_qwen3_dir):
    config = WorkerConfig(model=tiny_qwen3_dir, max_model_len=128, kv_cache_bytes=4096)
    ctx, ep, control, results, proc, msg = _start(config)
    try:
        assert isinstance(msg, StartupFailed) and "max_model_len" in msg.error
        proc.join(30)
        assert proc.exitcode != 0
    finally:
        if proc.is_alive():
            proc.kill()
        control.close()
        results.close()
        ctx.term()
        ep.cleanup()


def test_a_rank_checks_its_own_copy_of_the_checkpoint(tiny_qwen3_dir, tmp_path):
    """A rank on another host reads its own model directory: one whose config.json claims a
    million layers is refused from the headers, before the model is allocated, in one line."""
    broken = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    ctx, ep, control, results, proc, msg = _start(_worker_config(str(broken)))
    try:
        assert isinstance(msg, StartupFailed), msg
        assert msg.error.endswith(f"model {str(broken)!r}: config.json's num_hidden_layers is "
                                  "1000000 but the checkpoint holds weights for 2 layers")
        assert "\n" not in msg.error
        proc.join(30)
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
        control.close()
        results.close()
        ctx.term()
        ep.cleanup()
