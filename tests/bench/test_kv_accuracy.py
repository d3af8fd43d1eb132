"""`nanopipe bench kv-accuracy`: the figures it computes from two runs, and a run on a tiny
model that records them."""

from __future__ import annotations

import pytest
from test_tool import nanopipe, recorded

from frontend.bench.workloads.kv_accuracy import compare


def test_agreement_counts_positions_before_the_first_difference_and_overall():
    auto = [{"token_ids": [1, 2, 3, 4], "logprobs": [-0.1, -0.2, -0.3, -0.4]},
            {"token_ids": [5, 6, 7, 8], "logprobs": [-1.0, -1.0, -1.0, -1.0]}]
    fp8 = [{"token_ids": [1, 2, 3, 4], "logprobs": [-0.2, -0.2, -0.3, -0.1]},
           {"token_ids": [5, 9, 7, 8], "logprobs": [-1.5, -3.0, -1.0, -1.0]}]
    figures = compare(auto, fp8)
    assert figures["agree_until_first_diff"] == 5 / 8  # 4 of the first, 1 of the second
    assert figures["agree_overall"] == 7 / 8
    assert figures["prompts_identical"] == 1 / 2
    # Logprobs are compared where both runs chose the same token after the same context.
    assert figures["mean_abs_logprob_diff"] == pytest.approx((0.1 + 0 + 0 + 0.3 + 0.5) / 5)


@pytest.mark.slow
def test_kv_accuracy_records_its_figures(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "kv-accuracy", "--model", tiny_qwen3_dir, "--device", "cpu",
             "--num-prompts", "3", "--new-tokens", "6", "--dtype", "bfloat16",
             "--reference-dtype", "float32", "--record", str(rec))
    figures = recorded(rec, "kv-accuracy")
    assert 0 <= figures["agree_until_first_diff"] <= figures["agree_overall"] <= 1
    assert figures["mean_abs_logprob_diff"] >= 0
    assert figures["kv_blocks_ratio"] == 2  # bf16 -> fp8: twice the blocks in the same bytes
    assert 0 <= figures["agree_until_first_diff[float32]"] <= 1  # the scale reference
    assert figures["mean_abs_logprob_diff[float32]"] >= 0
