"""Kernel tests run the Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET is read when a function is decorated with `triton.jit`: when triton's own
language modules and our `kernels` modules are first imported. It is set here; if another
test package imported them earlier (compiled mode), their Python modules are dropped so that
the tests below re-import them interpreted (triton's C extension stays loaded).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def _triton_interpreted() -> bool:
    std = sys.modules.get("triton.language.standard")
    return std is None or type(std.zeros).__name__ == "InterpretedFunction"


def _drop_compiled_modules() -> None:
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top == "kernels" or (top == "triton" and not name.startswith("triton._C")):
            del sys.modules[name]


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if not _triton_interpreted():
        _drop_compiled_modules()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_paged_case(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    seed: int = 0,
    extra_blocks: int = 3,
):
    """A ragged batch over a paged cache whose block ids are shuffled and non-contiguous.

    seq_lens_k[b] = ctx_lens[b] + q_lens[b]; the cache holds random K/V for every position
    (the part written by this step included), unused block-table slots hold -1 or junk.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + extra_blocks
    perm = torch.randperm(total, generator=gen)
    max_blocks = max(nblocks + [1]) + 2
    tables = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return dict(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=tables.to(device), cu_seqlens_q=cu.to(device), seq_lens_k=lens.to(device),
        scale=head_dim**-0.5,
    )


def dense_causal_attention(case: dict) -> torch.Tensor:
    """Naive per-head attention on a contiguous copy of each sequence's K/V (fp64, on the
    CPU whatever the case's device)."""
    q, kc, vc = (case[name].double().cpu() for name in ("q", "k_cache", "v_cache"))
    bs, hkv = kc.shape[1], kc.shape[2]
    group = q.shape[1] // hkv
    out = torch.zeros_like(q)
    cu, lens = case["cu_seqlens_q"].tolist(), case["seq_lens_k"].tolist()
    for b, n in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        table = case["block_tables"][b].tolist()
        k = torch.stack([kc[table[p // bs], p % bs] for p in range(n)])  # [L, Hkv, D]
        v = torch.stack([vc[table[p // bs], p % bs] for p in range(n)])
        for h in range(q.shape[1]):
            qh = q[cu[b]:cu[b + 1], h]
            s = qh @ k[:, h // group].T * case["scale"]
            qpos = torch.arange(n - q_len, n)[:, None]
            s = s.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
            out[cu[b]:cu[b + 1], h] = s.softmax(-1) @ v[:, h // group]
    return out


@pytest.fixture
def paged_case():
    return make_paged_case


@pytest.fixture
def dense_attention():
    return dense_causal_attention
