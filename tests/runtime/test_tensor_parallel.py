"""TP=2 over gloo (two processes) produces exactly the tokens of TP=1."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch.multiprocessing as mp
from rt_helpers import BLOCK_SIZE, make_runner, prompts
from rt_planner import Planner

PROMPT_LENGTHS = [3, 18, 41]
MAX_TOKENS = 12


def _plan_and_run(runner, rank: int, broadcast) -> dict[int, list[int]]:
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(prompts(7, PROMPT_LENGTHS)):
        planner.add(i, p, MAX_TOKENS)
    # Chunked first steps, then free-running: both ranks build the same plans.
    for step in range(3):
        plan = planner.plan(chunks={2: 16})
        planner.apply(broadcast(runner.execute(plan)))
        del step
    while (plan := planner.plan()) is not None:
        planner.apply(broadcast(runner.execute(plan)))
    return {s.seq_id: s.output for s in planner.seqs.values()}


def _tp_worker(rank: int, model_dir: str, init_file: str, out_path: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    runner = make_runner(model_dir, rank=rank, world_size=2)

    def broadcast(result):
        box = [result]
        dist.broadcast_object_list(box, src=0)  # test-harness only: the scheduler's role
        return box[0]

    out = _plan_and_run(runner, rank, broadcast)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({str(k): v for k, v in out.items()}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("model", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_tp2_equals_tp1(model, request, tmp_path):
    """Qwen3 ties its embeddings; Llama has its own vocab-parallel lm_head."""
    model_dir = request.getfixturevalue(model)
    single = _plan_and_run(make_runner(model_dir), 0, lambda r: r)
    out_path = tmp_path / "tp2.json"
    mp.spawn(_tp_worker, args=(model_dir, str(tmp_path / "init"), str(out_path)),
             nprocs=2, join=True)
    tp2 = {int(k): v for k, v in json.loads(out_path.read_text()).items()}
    assert tp2 == single
