"""Sampling from temperature-scaled logits in one read of the logits.

Each row's token is argmax(logit / T - log E) with E ~ Exp(1) drawn per vocabulary entry (the
exponential race: argmax p / E is a draw from p); a row with T = 0 takes argmax(logit). An
optional per-row threshold drops the tokens whose logit / T is below it: top-k, top-p and
min-p are each such a threshold, found from a bounded top-k by the caller. The
noise is a counter-based hash of (row seed, token id), so nothing but the logits is read or
written at vocabulary size: no float32 copy, no softmax, no noise tensor. The same seed gives
the same draw on any device, and the torch reference computes exactly the kernel's noise.

The vocabulary is cut into chunks that run in parallel (a batch of one row still fills the
GPU); a second small kernel picks each row's best chunk.
"""

from __future__ import annotations

import torch

from kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check,
    jit,
    next_pow2,
    require_triton,
    tl,
    use_triton,
)

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_SMALL_U = 1e-4
"""Below this uniform, -log(1 - u) is computed by its series: float32 cannot hold 1 - u."""
_MAX_U = 1.0 - 2.0**-24
_CHUNK = 8192
_BLOCK = 1024


@jit
def _mix32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@jit
def _sample_partial_kernel(logits_ptr, stride_row, inv_temp_ptr, seed_ptr, thresh_ptr, part_val_ptr,
                    part_idx_ptr, vocab, num_chunks, HAS_THRESH: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    tau = -float("inf")
    if HAS_THRESH:
        tau = tl.load(thresh_ptr + row)
    seed = tl.load(seed_ptr + row)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best_val = -float("inf")
    best_idx = 0
    start = chunk * CHUNK
    for off in range(start, start + CHUNK, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask,
                    other=-float("inf")).to(tl.float32)
        h = _mix32(_mix32(cols.to(tl.uint32) ^ seed_lo) ^ seed_hi)
        u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2**-32
        u = tl.minimum(u, 0.9999999403953552)  # 1 - 2**-24
        e = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
        scaled = x * inv_t
        drawn = tl.where(scaled >= tau, scaled - tl.log(e), -float("inf"))
        score = tl.where(inv_t > 0, drawn, x)
        score = tl.where(mask, score, -float("inf"))
        m = tl.max(score, axis=0)
        i = tl.argmax(score, axis=0)
        better = m > best_val
        best_idx = tl.where(better, off + i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(part_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx)


@jit
def _sample_pick_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=-float("inf"))
    best = tl.argmax(vals, axis=0)
    idx = tl.load(part_idx_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, idx.to(tl.int64))


def _check(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
           threshold: torch.Tensor | None) -> None:
    check(logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}")
    check(logits.dtype in FLOAT_DTYPES, f"unsupported logits dtype {logits.dtype}")
    rows = logits.shape[0]
    check(inv_temperature.shape == (rows,) and inv_temperature.dtype == torch.float32,
          "inv_temperature must be float32 [R]")
    check(seeds.shape == (rows,) and seeds.dtype == torch.int64, "seeds must be int64 [R]")
    check(threshold is None or (threshold.shape == (rows,) and threshold.dtype == torch.float32),
          "threshold must be float32 [R]")


def sample_from_logits_triton(logits: torch.Tensor, inv_temperature: torch.Tensor,
                              seeds: torch.Tensor, threshold: torch.Tensor | None = None
                              ) -> torch.Tensor:
    require_triton()
    _check(logits, inv_temperature, seeds, threshold)
    check(logits.stride(1) == 1, "logits rows must be contiguous")
    inv_temperature, seeds = inv_temperature.contiguous(), seeds.contiguous()
    threshold = threshold.contiguous() if threshold is not None else None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = cdiv(vocab, _CHUNK)
    part_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _sample_partial_kernel[(rows, chunks)](
        logits, logits.stride(0), inv_temperature, seeds,
        threshold if threshold is not None else inv_temperature, part_val, part_idx, vocab,
        chunks, HAS_THRESH=threshold is not None, CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4)
    _sample_pick_kernel[(rows,)](part_val, part_idx, out, chunks, BLOCK_C=next_pow2(chunks),
                          num_warps=1)
    return out


def _mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernel's hash on uint32 values held in int64 (products wrap, the mask keeps 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def exponential_noise_ref(seeds: torch.Tensor, vocab: int, device=None) -> torch.Tensor:
    """E [R, V] float32: the Exp(1) draws the kernel makes for each (row seed, token id)."""
    cols = torch.arange(vocab, dtype=torch.int64, device=device)[None, :]
    lo = (seeds & _MASK32)[:, None].to(device)
    hi = ((seeds >> 32) & _MASK32)[:, None].to(device)
    h = _mix32_ref(_mix32_ref(cols ^ lo) ^ hi)
    u = ((h.to(torch.float32) + 0.5) * 2.0**-32).clamp(max=_MAX_U)
    return torch.where(u < _SMALL_U, u + 0.5 * u * u, -torch.log(1.0 - u))


def sample_from_logits_ref(logits: torch.Tensor, inv_temperature: torch.Tensor,
                           seeds: torch.Tensor, threshold: torch.Tensor | None = None
                           ) -> torch.Tensor:
    _check(logits, inv_temperature, seeds, threshold)
    x = logits.float()
    noise = exponential_noise_ref(seeds, x.shape[1], x.device)
    scaled = x * inv_temperature[:, None]
    drawn = scaled - torch.log(noise)
    if threshold is not None:
        drawn = drawn.masked_fill(scaled < threshold[:, None], float("-inf"))
    score = torch.where(inv_temperature[:, None] > 0, drawn, x)
    return score.argmax(dim=-1)


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor,
                       seeds: torch.Tensor, threshold: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Token ids [R] int64: row r drawn from softmax(logits[r] * inv_temperature[r]) with the
    noise of seeds[r], restricted to the tokens whose scaled logit reaches threshold[r], or
    argmax(logits[r]) where inv_temperature[r] is 0."""
    if use_triton(logits, inv_temperature, seeds):
        return sample_from_logits_triton(logits, inv_temperature, seeds, threshold)
    return sample_from_logits_ref(logits, inv_temperature, seeds, threshold)
