"""RMSNorm through the kernels' fused ops (residual add folded into the norm).

On the CPU in float32, torch's rms_norm does in one op what the reference does in six, with
the same roundings (float32 throughout: HF's cast back to the input dtype is a no-op); other
dtypes keep the reference, whose weight multiplies after the cast as HF's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.ops import add_rms_norm, rms_norm
from kernels.norm_linear import norm_linear_triton
from kernels.skinny_linear import runs_skinny


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32 and not x.is_cuda:
            if residual is None:
                return F.rms_norm(x, self.shape, self.weight, self.eps)
            s = x + residual
            return F.rms_norm(s, self.shape, self.weight, self.eps), s
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def norm_then_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                     linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual), or (linear(norm(x)), x) without a residual:
    one kernel where the skinny GEMV runs (a decode step's few rows on a GPU,
    kernels.norm_linear), the norm and the linear layer elsewhere. `linear` is a
    column-parallel layer (no reduction after it)."""
    if linear.bias is None and runs_skinny(x, linear.weight):
        return norm_linear_triton(x, residual, norm.weight, norm.eps, linear.weight)
    if residual is None:
        return linear(norm(x)), x
    h, residual = norm(x, residual)
    return linear(h), residual
