"""The hardware bound of a workload and a throughput's ratio to it.

docs/benchmarks.md: a benchmark prints its ratio to the bound computed for its own workload. The
bound reads every sequence's KV cache once per decode step and the weights once per step at
the copy bandwidth, and computes the prefill FLOPs at the matmul rate: the ceilings measured
on the device at the start of the run (frontend.bench.ceilings), passed in by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from frontend.bench.ceilings import DeviceCeilings


def hardware_bound_s(mc, num_params: int, work,
                     ceilings: DeviceCeilings) -> tuple[float, dict]:
    """Seconds at least for `work` ((prompt, output tokens) pairs) on a model with config
    `mc` (a gpu_workers.ModelConfig) on a device with these ceilings, and the parts: KV and
    weight reads, prefill FLOPs."""
    kv_tok = mc.kv_bytes_per_token()
    elem = torch.empty((), dtype=mc.dtype).element_size()
    kv_read = sum(kv_tok * (out * len(p) + out * (out - 1) // 2) for p, out in work)
    steps = max(out for _, out in work)
    weights = num_params * elem * steps
    attn = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T and PV, causal half
    flops = sum(2 * num_params * len(p) + attn * len(p) ** 2 // 2 for p, _ in work)
    t = ((kv_read + weights) / ceilings.copy_bytes_per_s
         + flops / ceilings.matmul_flops_per_s)
    return t, dict(kv_read_tb=kv_read / 1e12, weights_tb=weights / 1e12,
                   prefill_tflop=flops / 1e12)


@dataclass(frozen=True)
class Throughput:
    """Output tokens produced in `seconds`, against a bound of `bound_s` for the same tokens."""

    tokens: int
    seconds: float
    bound_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def bound_tok_s(self) -> float:
        return self.tokens / self.bound_s

    @property
    def ratio(self) -> float:
        return self.tok_s / self.bound_tok_s
