"""`nanopipe bench disagg`'s default modes: colocated, dp2 and disagg, except on a single GPU,
where dp2's two replicas could not start (the prefill and decode replicas share the one GPU)
and the split runs with either way of moving the KV."""

from __future__ import annotations

import torch

from frontend.bench.workloads.disagg import MODES, default_modes


def test_colocated_dp2_and_disagg_on_the_cpu():
    assert default_modes("cpu") == ["colocated", "dp2", "disagg"]
    assert set(MODES) == {"colocated", "dp2", "disagg", "disagg-frames", "disagg-shared"}


def test_one_gpu_compares_the_transfer_modes_instead_of_dp2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_modes("cuda") == ["colocated", "disagg-frames", "disagg-shared"]
    assert "dp2 left out" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_modes("cuda") == ["colocated", "dp2", "disagg"]
