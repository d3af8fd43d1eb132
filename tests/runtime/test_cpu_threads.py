"""Start-up's weight copies run on one intra-op thread and give the steps back every thread."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.config import WorkerConfig
from gpu_workers.cpu_threads import one_thread
from gpu_workers.model_runner import ModelRunner


def test_one_thread_inside_and_the_count_restored_after_an_error():
    torch.set_num_threads(2)
    with pytest.raises(ValueError), one_thread():
        assert torch.get_num_threads() == 1
        raise ValueError("a failed load")
    assert torch.get_num_threads() == 2


def test_a_started_runner_steps_with_every_thread(tiny_qwen3_dir):
    torch.set_num_threads(2)
    runner = ModelRunner(WorkerConfig(model=tiny_qwen3_dir, dtype="float32", max_model_len=256,
                                      max_num_batched_tokens=256))
    assert torch.get_num_threads() == 2
    assert [p.name for p in runner.startup.phases] == ["weights", "kv"]
