"""`nanopipe bench disagg`'s default modes: all three, except dp2 on a single GPU, where its
two replicas could not start (the prefill and decode replicas share the one GPU)."""

from __future__ import annotations

import torch

from frontend.bench.workloads.disagg import MODES, default_modes


def test_all_modes_on_the_cpu():
    assert default_modes("cpu") == list(MODES) == ["colocated", "dp2", "disagg"]


def test_dp2_is_left_out_on_one_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_modes("cuda") == ["colocated", "disagg"]
    assert "dp2 left out" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_modes("cuda") == list(MODES)
