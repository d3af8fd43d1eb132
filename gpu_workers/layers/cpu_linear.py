"""Matmuls on the CPU with weights reordered once for oneDNN.

`F.linear` on the CPU goes to MKL's sgemm, reading the [out, in] weight transposed; for the
few rows of a decode step that reaches about half the machine's memory bandwidth (and on AMD
CPUs MKL takes a generic path). oneDNN's inner product over a weight reordered once into its
blocked layout reads the weights near the bandwidth: on two EPYC cores a SmolLM2-135M decode
step's matmuls take about 0.65x the time at batch 1 and 16 (`python scripts/profile_cpu.py
--ops 8` shows them), and prefills of 256 to 4,096 rows take about the same time (±10%).

After loading, `use_onednn_weights` gives every linear layer and the LM head on the CPU an
`onednn_weight` and drops the plain one (a tied LM head's stays with the embedding, which
looks rows up). Where oneDNN is missing or cannot take the dtype (bf16 needs AVX-512 or
AVX-NE-CONVERT), the layer keeps its plain weight and F.linear. NANOPIPE_PLAIN_CPU_LINEAR=1
keeps them all plain, to compare.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

PLAIN_ENV = "NANOPIPE_PLAIN_CPU_LINEAR"


def onednn_wanted() -> bool:
    return (os.environ.get(PLAIN_ENV, "0") in ("", "0") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or None where oneDNN cannot take it on this CPU."""
    try:
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        onednn_linear(probe, reordered)
    except RuntimeError:
        return None
    return reordered


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) with W from `onednn_layout`; x may have any leading dimensions."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def cpu_linear(x: torch.Tensor, weight: torch.Tensor | None, onednn_weight: torch.Tensor | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's matmul: over its reordered weight where it has one (only ever on the CPU),
    else F.linear over the plain one."""
    if onednn_weight is not None:
        return onednn_linear(x, onednn_weight, bias)
    return F.linear(x, weight, bias)


def use_onednn_weights(model: nn.Module) -> None:
    """Reorder the weight of every module with an `onednn_weight` slot that sits on the CPU.
    Such a module's `weight` becomes None, so that what reads it fails loudly instead of
    using a copy the forward no longer does."""
    if not onednn_wanted():
        return
    for module in model.modules():
        if not hasattr(module, "onednn_weight") or module.onednn_weight is not None:
            continue
        weight = module.weight
        if weight is None or weight.device.type != "cpu":
            continue
        reordered = onednn_layout(weight)
        if reordered is not None:
            module.onednn_weight, module.weight = reordered, None
