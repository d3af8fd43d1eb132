"""Matmuls on the CPU with weights reordered once for oneDNN.

`F.linear` on the CPU goes to MKL's sgemm, reading the [out, in] weight transposed; on AMD
CPUs MKL takes a generic path, which for the few rows of a decode step reaches about half the
machine's memory bandwidth. oneDNN's inner product over a weight reordered once into its
blocked layout reads the weights near the bandwidth: on two EPYC cores a SmolLM2-135M decode
step's matmuls take about 0.65x the time at batch 1 and 16 (`nanopipe profile cpu
--ops 8` shows them), and prefills of 256 to 4,096 rows take about the same time (±10%).

At one or two rows the answer depends on the CPU: on two cores of an Intel Xeon (AVX-512, no
AMX) MKL's GEMV over the plain weights took 21.8 ms for a SmolLM2-135M step's matmuls against
25.3 through oneDNN, while oneDNN won from four rows on (32.9 against 39.8 ms at four, 47.2
against 60.6 at 16); on two AMD EPYC cores, where MKL takes a generic path, oneDNN was the
faster at one row too. So on an Intel CPU the layers keep their plain weights beside the
reordered ones (twice the weight memory) and use them for steps of up to FEW_ROWS rows. The
choice is the CPU's, not a timing's at start-up, so a machine runs the same kernels (and
rounds the same way) every time.

After loading, `use_onednn_weights` gives every linear layer and the LM head on the CPU an
`onednn_weight` and, unless the plain one is kept as above, drops the plain one (a tied LM
head's stays with the embedding, which looks rows up). Where oneDNN is missing or cannot
take the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT), the layer keeps its plain weight and
F.linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.cpu_threads import one_thread

FEW_ROWS = 2
"""Steps of at most this many rows may take the plain weights (see the module's docstring)."""


def onednn_wanted() -> bool:
    """Whether this torch build has oneDNN's inner product (the plain weights stay if not)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
    if onednn_weight is not None and (weight is None or x.numel() > FEW_ROWS * x.shape[-1]):
        return onednn_linear(x, onednn_weight, bias)
    return F.linear(x, weight, bias)


def use_onednn_weights(model: nn.Module) -> None:
    """Reorder the weight of every module with an `onednn_weight` slot that sits on the CPU.
    Such a module's `weight` becomes None, so that what reads it fails loudly instead of
    using a copy the forward no longer does."""
    if not onednn_wanted():
        return
    layers = []
    with one_thread():  # bulk copies: gpu_workers/cpu_threads.py says why
        for module in model.modules():
            if not hasattr(module, "onednn_weight") or module.onednn_weight is not None:
                continue
            weight = module.weight
            if weight is None or weight.device.type != "cpu":
                continue
            reordered = onednn_layout(weight)
            if reordered is not None:
                layers.append((module, reordered))
    keep_plain = bool(layers) and few_rows_take_plain()
    for module, reordered in layers:
        module.onednn_weight = reordered
        if not keep_plain:
            module.weight = None


def few_rows_take_plain() -> bool:
    """Whether steps of up to FEW_ROWS rows use MKL over the plain weights: where torch has MKL
    and the CPU is Intel's (see the module's docstring)."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
