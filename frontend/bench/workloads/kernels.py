"""Time the kernels at the Qwen3-0.6B shape on a CUDA GPU.

Decode attention reports achieved memory bandwidth (KV bytes read / time); prefill reports
TFLOP/s of causal attention. flash-attn's paged kernels run as a peer when importable, and
torch's dense SDPA gives a non-paged reference point for prefill. The small per-layer ops
(fused q/k-norm + rotary + KV store, add + RMSNorm, SiLU-and-mul) are timed against the
unfused sequences they replace, each replayed from a CUDA graph as the decode step runs them.
The decode step's projections at one to eight rows (--only gemv) run from a CUDA graph of 28
distinct weights, one per layer, so no weight is read from L2: cuBLAS against the skinny
kernel, alone, with the SiLU-mul before it (down_proj) and with the RMSNorm before it. The
sampler (--only sampler) draws from W1's logits (153 rows of Qwen3's 151,936-token vocabulary)
against torch's softmax and multinomial.

The projections at W1's batch (--only gemm) are kernels_gemm.py's. Every floor is taken at the
device's copy bandwidth and matmul rate, measured at the start of the run
(frontend.bench.ceilings).

    nanopipe bench kernels [--block-size 256] [--iters 50]
                           [--only small|attention|gemv|gemm|sampler]
"""

from __future__ import annotations

import argparse
import functools
import random

import torch
import torch.nn.functional as F

from frontend.bench.ceilings import DeviceCeilings, device_ceilings
from frontend.bench.common.cuda_timing import (
    LAYERS,
    bench,
    bench_graphed,
    bench_graphed_over,
    make_cache,
)
from frontend.bench.errors import BenchUsageError
from frontend.bench.figures import Figure
from frontend.bench.workloads.kernels_gemm import bench_gemm
from kernels.activation import silu_and_mul_triton
from kernels.paged_attention import paged_attention_triton
from kernels.paged_decode_attention import paged_decode_attention_triton
from kernels.qk_norm_rope_store import qk_norm_rope_store_triton
from kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
from kernels.rotary import apply_rotary_triton, build_rope_cache
from kernels.sampling import sample_from_logits_triton
from kernels.store_kv import store_kv_triton

H, HKV, D = 16, 8, 128
HIDDEN, INTER = 1024, 3072
DTYPE = torch.bfloat16


def try_flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_varlen_func, flash_attn_with_kvcache


def bench_decode(batch: int, lo: int, hi: int, block_size: int, iters: int, fa, *,
                 ceilings: DeviceCeilings, capacity: int = 0, splits: tuple[int, ...] = (),
                 heads=(H, HKV, D), tiles: tuple[int, ...] = (), kv_dtype: torch.dtype = DTYPE,
                 fp8_dots: tuple[int, ...] = ()) -> Figure:
    """The automatic choice's microseconds, against the KV read at the copy bandwidth of
    `ceilings` and against flash-attn where it is importable. capacity: the block table's
    width in tokens, as a decode graph sizes it (0: the longest context); every case then
    runs from a CUDA graph, as in a decode step. `splits`: also time these fixed numbers of
    splits; `tiles`: these keys per tile (block_n); `heads`: (q heads, kv heads, head dim);
    `kv_dtype`: the cache's (fp8: flash-attn does not take it); `fp8_dots`: these modes of
    e4m3 tensor-core dots (an fp8 cache), each with its largest difference from the widened
    path's output."""
    h, hkv, d = heads
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    k_cache, v_cache, table = make_cache(lens, block_size, -(-capacity // block_size), hkv, d)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    fa = fa if kv_dtype == DTYPE else None
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, dtype=DTYPE, device="cuda")
    scale = d**-0.5
    kv_bytes = (sum(lens) * hkv * d * 2 * k_cache.element_size()
                + 2 * q.numel() * q.element_size())
    print(f"decode: batch {batch}, context {lo}-{hi} (mean {sum(lens) / batch:.0f}), "
          f"heads {h}/{hkv}x{d}, block {block_size}, {str(kv_dtype)[6:]} KV read "
          f"{kv_bytes / 1e6:.1f} MB"
          + (f", table for {capacity} tokens, graphed" if capacity else ""))
    cases = {
        "triton decode (auto split)": lambda: paged_decode_attention_triton(
            q, k_cache, v_cache, table, seq_lens, scale),
        "triton decode (1 split)": lambda: paged_decode_attention_triton(
            q, k_cache, v_cache, table, seq_lens, scale, num_splits=1),
    }
    for n in splits:
        cases[f"triton decode ({n} splits)"] = functools.partial(
            paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, scale,
            num_splits=n)
    for n in tiles:
        cases[f"triton decode ({n}-key tiles)"] = functools.partial(
            paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, scale,
            block_n=n)
    for mode in fp8_dots:
        cases[f"triton decode (fp8 dots {FP8_DOTS[mode]})"] = functools.partial(
            paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, scale,
            fp8_dots=mode)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    cases["triton unified paged_attention"] = lambda: paged_attention_triton(
        q, k_cache, v_cache, table, cu, seq_lens, scale)
    if fa is not None:
        q4 = q.unsqueeze(1)
        cases["flash-attn with_kvcache"] = lambda: fa[1](
            q4, k_cache, v_cache, cache_seqlens=seq_lens, block_table=table,
            softmax_scale=scale, causal=True)
    times = {}
    for name, fn in cases.items():
        try:
            ms = times[name] = bench_graphed(fn, iters) / 1e3 if capacity else bench(fn, iters)
        except Exception as exc:  # noqa: BLE001 - a knob's setting the GPU cannot run
            if name == "triton decode (auto split)":
                raise
            print(f"  {name:34s} failed: {str(exc).splitlines()[0][:100]}")
            continue
        print(f"  {name:34s} {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e6:7.0f} GB/s"
              + (_difference(fn, cases["triton decode (auto split)"])
                 if "fp8 dots" in name else ""))
    fa_ms = times.get("flash-attn with_kvcache")
    fp8 = "" if kv_dtype == DTYPE else "[fp8]"
    return Figure(f"decode_attention_us@{batch}x{lo}-{hi}{fp8}",
                  round(times["triton decode (auto split)"] * 1e3, 2), "us",
                  bound=round(kv_bytes / ceilings.copy_bytes_per_s * 1e6, 2),
                  higher_is_better=False,
                  peer=None if fa_ms is None else round(fa_ms * 1e3, 2), peer_name="flash-attn")


FP8_DOTS = {1: "QK", 2: "QK+PV"}


def _difference(fn, reference) -> str:
    """`fn`'s largest absolute difference from `reference`'s output."""
    return f"  max |diff| {(fn().float() - reference().float()).abs().max().item():.4f}"


def bench_prefill(seq_len: int, num_seqs: int, block_size: int, iters: int, fa) -> None:
    lens = [seq_len] * num_seqs
    k_cache, v_cache, table = make_cache(lens, block_size)
    total = seq_len * num_seqs
    q = torch.randn(total, H, D, dtype=DTYPE, device="cuda")
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = D**-0.5
    flops = num_seqs * 4 * H * D * seq_len * (seq_len + 1) / 2
    print(f"prefill: {num_seqs} x {seq_len} tokens, block {block_size}, "
          f"{flops / 1e12:.3f} TFLOP (causal)")
    cases = {"triton paged_attention": lambda: paged_attention_triton(
        q, k_cache, v_cache, table, cu, seq_lens, scale)}
    if fa is not None:
        cases["flash-attn varlen (paged)"] = lambda: fa[0](
            q, k_cache, v_cache, cu, cu, seq_len, seq_len, softmax_scale=scale, causal=True,
            block_table=table)
    qd = q.view(num_seqs, seq_len, H, D).transpose(1, 2)
    kd = torch.randn(num_seqs, HKV, seq_len, D, dtype=DTYPE, device="cuda")
    vd = torch.randn_like(kd)
    cases["torch sdpa (dense, not paged)"] = lambda: F.scaled_dot_product_attention(
        qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    for name, fn in cases.items():
        ms = bench(fn, iters)
        print(f"  {name:34s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s")


def bench_gemv(iters: int, ceilings: DeviceCeilings) -> None:
    """Qwen3-0.6B's four projections (out, in) at a decode step's few rows."""
    from kernels.skinny_linear import use_skinny

    print(f"decode projections: {LAYERS} distinct bf16 weights per graph, microseconds per call")
    for name, (n, k) in (("qkv_proj", (4096, 1024)), ("o_proj", (1024, 2048)),
                         ("gate_up_proj", (6144, 1024)), ("down_proj", (1024, 3072))):
        weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02 for _ in range(LAYERS)]
        for rows in (1, 2, 4, 8):
            times = {c: bench_graphed_over(fn, weights, iters)
                     for c, fn in _gemv_cases(name, rows, k).items()}
            used = "used" if use_skinny(rows, n, k) else "not used"
            print(f"  {name:12s} {rows} row(s), {n * k * 2 / 1e6:4.1f} MB (floor "
                  f"{n * k * 2 / ceilings.copy_bytes_per_s * 1e6:4.1f}), skinny {used}: "
                  + ", ".join(f"{c} {t:5.2f}" for c, t in times.items()))


def _gemv_cases(name: str, rows: int, k: int) -> dict:
    """fn(weight) per way of computing the projection."""
    from kernels.norm_linear import norm_linear_triton
    from kernels.skinny_linear import skinny_linear_triton

    gate_up = torch.randn(rows, 2 * k, dtype=DTYPE, device="cuda")
    x, residual = gate_up[:, :k].contiguous(), gate_up[:, k:].contiguous()
    norm_w = torch.ones(k, dtype=DTYPE, device="cuda")
    cases = {"cuBLAS": functools.partial(F.linear, x),
             "skinny": functools.partial(skinny_linear_triton, x)}
    if name == "down_proj":
        cases["skinny, SiLU-mul inside"] = lambda w: skinny_linear_triton(gate_up, w, gated=True)
    elif name != "o_proj":
        cases["skinny, add+RMSNorm inside"] = functools.partial(
            norm_linear_triton, x, residual, norm_w, 1e-6)
    return cases


def unfused_qkv(qkv, positions, cos_sin, qw, kw, k_cache, v_cache, slots, heads, kv_heads):
    """The decoder's former sequence: strided copies, two norms, rotary, store_kv."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = rms_norm_triton(q.reshape(-1, D), qw, 1e-6).view(t, heads, D)
    k = rms_norm_triton(k.reshape(-1, D), kw, 1e-6).view(t, kv_heads, D)
    q, k = apply_rotary_triton(q, k, positions, cos_sin)
    store_kv_triton(k, v.view(t, kv_heads, D), k_cache, v_cache, slots)
    return q


def bench_small_ops(tokens: int, block_size: int, iters: int, heads: int = H,
                    kv_heads: int = HKV) -> None:
    dev = "cuda"
    num_blocks = -(-tokens // block_size) + 1
    cache = (num_blocks, block_size, kv_heads, D)
    k_cache = torch.randn(cache, dtype=DTYPE, device=dev)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens].to(torch.int32)
    positions = torch.randint(0, 1024, (tokens,), device=dev, dtype=torch.int32)
    cos_sin = build_rope_cache(D, 4096, 1e6, None, dev)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * D, dtype=DTYPE, device=dev)
    qw, kw = torch.randn(D, dtype=DTYPE, device=dev), torch.randn(D, dtype=DTYPE, device=dev)
    x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, dtype=DTYPE, device=dev)
    gate_up = torch.randn(tokens, 2 * INTER, dtype=DTYPE, device=dev)
    qkv_args = (qkv, positions, cos_sin, qw, kw, k_cache, v_cache, slots, heads, kv_heads)
    # (name, fused, unfused, calls per decode step)
    cases = [
        ("q/k norm + rotary + store_kv",
         lambda: qk_norm_rope_store_triton(qkv, heads, kv_heads, positions, cos_sin, qw, kw,
                                           1e-6, k_cache, v_cache, slots),
         lambda: unfused_qkv(*qkv_args), LAYERS),
        ("residual add + RMSNorm", lambda: add_rms_norm_triton(x, res, w, 1e-6),
         lambda: rms_norm_triton(x + res, w, 1e-6), 2 * LAYERS),
        ("SiLU-and-mul", lambda: silu_and_mul_triton(gate_up),
         lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], LAYERS),
    ]
    print(f"small ops: {tokens} tokens, {heads} q / {kv_heads} kv heads, bf16, "
          f"{LAYERS} calls per CUDA graph")
    saved = 0.0
    for name, fused, unfused, per_step in cases:
        f_us, u_us = bench_graphed(fused, iters), bench_graphed(unfused, iters)
        saved += (u_us - f_us) * per_step
        print(f"  {name:30s} fused {f_us:7.1f} us  unfused {u_us:7.1f} us  "
              f"x{per_step}/step: {f_us * per_step / 1e3:.3f} vs {u_us * per_step / 1e3:.3f} ms")
    print(f"  saved per forward step: {saved / 1e3:.3f} ms")


def bench_sampler(rows: int, vocab: int, iters: int, ceilings: DeviceCeilings) -> Figure:
    """Temperature sampling (0.6, W1's) from bf16 logits: one read of them by the kernel."""
    logits = torch.randn(rows, vocab, dtype=DTYPE, device="cuda") * 3
    inv = torch.full((rows,), 1 / 0.6, dtype=torch.float32, device="cuda")
    seeds = torch.randint(0, 2**62, (rows,), dtype=torch.int64, device="cuda")
    ours = bench(lambda: sample_from_logits_triton(logits, inv, seeds), iters) * 1e3
    peer = bench(lambda: torch.multinomial(torch.softmax(logits.float() * (1 / 0.6), -1), 1),
                 iters) * 1e3
    gbs = logits.numel() * logits.element_size() / ours / 1e3
    print(f"sampler: {rows} rows x {vocab} bf16 logits: {ours:7.1f} us ({gbs:,.0f} GB/s of "
          f"logits read); torch softmax + multinomial {peer:7.1f} us ({peer / ours:.1f}x)")
    bound = logits.numel() * logits.element_size() / ceilings.copy_bytes_per_s * 1e6
    return Figure("sampler_us", round(ours, 2), "us", bound=round(bound, 2), peer=round(peer, 2),
                  peer_name="torch softmax+multinomial", higher_is_better=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--only", choices=["small", "attention", "gemv", "gemm", "sampler"],
                        default=None)


def run(args: argparse.Namespace) -> list[Figure]:
    if not torch.cuda.is_available():
        raise BenchUsageError("the kernel benchmarks need a CUDA GPU")
    ceilings = device_ceilings("cuda")  # before this process allocates on the device
    fa = try_flash_attn()
    print(f"{torch.cuda.get_device_name()}; flash-attn: {'yes' if fa else 'not importable'}; "
          f"floors at {ceilings.describe()}")
    decode = functools.partial(bench_decode, ceilings=ceilings)
    torch.manual_seed(0)
    figures = []
    if args.only in (None, "sampler"):
        figures.append(bench_sampler(153, 151_936, args.iters, ceilings))
    if args.only == "sampler":
        return figures
    if args.only in (None, "small"):
        bench_small_ops(170, args.block_size, args.iters)  # W1's decode steps
        bench_small_ops(170, args.block_size, args.iters, heads=8, kv_heads=4)  # a TP=2 rank
        bench_small_ops(4096, args.block_size, args.iters)  # a prefill chunk
    if args.only in (None, "gemv"):
        bench_gemv(args.iters, ceilings)
    if args.only in (None, "gemm"):
        bench_gemm(args.iters, ceilings)
    if args.only in ("small", "gemv", "gemm"):
        return figures
    decode(256, 500, 700, args.block_size, args.iters, fa, splits=(2,))
    # W1 at full load: ~150 sequences whose contexts spread from 200 to 2,000 tokens.
    figures.append(decode(153, 200, 2000, args.block_size, args.iters, fa, capacity=4096,
                          splits=(2, 3, 4, 6, 8), tiles=(64,)))
    # The same with an fp8 cache: half the bytes, so a tile of twice the keys moves as much.
    figures.append(decode(153, 200, 2000, args.block_size, args.iters, fa, capacity=4096,
                          splits=(2, 4), tiles=(64, 256), kv_dtype=torch.float8_e4m3fn,
                          fp8_dots=(1, 2)))
    # W1 on the SmolLM2-135M shape (9 q heads on 3 kv heads of 64; flash-attn's build here
    # has head dim 128 only): ~190 sequences. A 256-key tile of head dim 64 moves the bytes
    # a 128-key tile of head dim 128 does.
    decode(190, 200, 2000, args.block_size, args.iters, None, capacity=4096,
           splits=(2, 4), heads=(9, 3, 64), tiles=(64, 256))
    decode(16, 4000, 4200, args.block_size, args.iters, fa, splits=(8, 16, 32, 64))
    decode(2, 30000, 32000, args.block_size, args.iters, fa, splits=(16, 32, 64))
    for batch, lo, hi in ((1, 500, 700), (1, 1024, 1152), (8, 500, 700)):  # few sequences
        decode(batch, lo, hi, args.block_size, args.iters, fa, capacity=4096)
    bench_prefill(1024, 8, args.block_size, args.iters, fa)
    bench_prefill(8192, 1, args.block_size, args.iters, fa)
    return figures

