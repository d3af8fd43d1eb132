"""The workers' profiling window (gpu_workers.profiling.step_profiler): a TP=2 pipeline over
gloo, started with NANOPIPE_PROFILE_DIR in its environment, leaves one file per rank that
covers the window's plans and counts each step's collectives; a bad window is refused naming
the variable."""

from __future__ import annotations

import json

import pytest
from pipeline_config import tiny_engine

from frontend import LLM
from gpu_workers.profiling.step_profiler import DIR_ENV, STEPS_ENV, ProfileWindow, profiled
from protocol import SamplingParams

FIRST, LAST = 2, 5


def test_every_rank_writes_its_window(tiny_qwen3_dir, tmp_path, monkeypatch):
    out = tmp_path / "profile"
    monkeypatch.setenv(DIR_ENV, str(out))  # the worker processes inherit it
    monkeypatch.setenv(STEPS_ENV, f"{FIRST},{LAST}")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(**tiny_engine(tiny_qwen3_dir, tensor_parallel_size=2,
                           worker_lookahead=True)) as llm:
        outputs = llm.generate(["one", "two three"], params, use_tqdm=False)
    assert all(len(o["token_ids"]) == 8 for o in outputs)
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert (report["rank"], report["world_size"], report["device"]) == (rank, 2, "cpu")
        assert report["steps"] == [FIRST, LAST] and report["steps_seen"] == LAST - FIRST
        steps = report["per_step"]
        assert [s["step"] for s in steps] == list(range(FIRST, LAST))
        for s in steps:
            # Two all-reduces per layer, the embedding's, the logits gather, the broadcast of
            # the sampled ids: gloo ops on the CPU, each with the size of its tensor.
            assert s["collectives"] > 0 and s["collective_bytes"] > 0, s
            assert s["host_ms"]["launch"] >= s["host_ms"]["forward"] > 0, s
            assert s["wall_ms"] > 0
        kinds = report["collectives_by_kind"]
        assert {"all_reduce", "broadcast"} <= kinds.keys()
        assert kinds["all_reduce"]["bytes_per_call"] > 0
        assert report["gpu_ms_per_step"]["collectives"] > 0
        assert report["host_ms_per_step"]["sample"] > 0
    # Every rank runs the same all-reduces (only rank 0 samples; the others wait for its ids).
    counts = [json.loads((out / f"rank{r}.json").read_text())["collectives_by_kind"]
              ["all_reduce"]["per_step"] for r in (0, 1)]
    assert counts[0] == counts[1]


def test_off_unless_asked_and_a_bad_window_names_the_variable():
    runner = object()
    assert profiled(runner, {}) is runner
    assert profiled(runner, {DIR_ENV: ""}) is runner
    window = ProfileWindow.from_env({DIR_ENV: "/tmp/x"})
    assert (window.first, window.last) == (300, 340)
    for bad in ("5", "a,b", "9,3", "-1,4", "1,2,3"):
        with pytest.raises(ValueError, match=STEPS_ENV):
            ProfileWindow.from_env({DIR_ENV: "/tmp/x", STEPS_ENV: bad})


def test_a_ranged_sampler_keeps_what_the_decode_graphs_read():
    """profile_step wraps the runner's sampler in a range; the decode graphs' sampling then reads
    the sampler's draw_seeds through the wrap (it failed with an AttributeError at batch 1)."""
    import torch

    from gpu_workers.profiling.step_profiler import Ranged
    from gpu_workers.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), seed=0)
    ranged = Ranged("nanopipe.sampler", sampler)
    assert ranged.draw_seeds == sampler.draw_seeds
