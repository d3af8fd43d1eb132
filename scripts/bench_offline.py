"""W1 offline throughput: the scheduler and the model runner driven in one process.

    python scripts/bench_offline.py --make-random qwen3-0.6b        # on the GPU machine
    python scripts/bench_offline.py --model DIR --num-seqs 4 --max-input-len 64 \
        --max-output-len 32 --device cpu                              # CPU smoke run

Workload (BENCHMARKS.md): random.seed(0); for each of 256 sequences a prompt of
randint(100, 1024) tokens each randint(0, 10000); then for each max_tokens = randint(100, 1024);
temperature 0.6, ignore_eos; one warm-up request first. It prints output tok/s and the ratio to
the hardware bound of this very workload: the KV cache of every sequence read once per decode
step plus the weights once per step at the copy bandwidth, plus the prefill FLOPs at the matmul
rate (H200: 4.3 TB/s, 790 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from gpu_workers import ModelConfig, ModelRunner, WorkerConfig
from protocol import AddRequest, SamplingParams
from scheduler_proc import Scheduler, SchedulerConfig

COPY_BYTES_PER_S = 4.3e12
MATMUL_FLOPS_PER_S = 790e12

SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                       max_position_embeddings=40960),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                     max_position_embeddings=40960),
}


def param_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def make_random(shape: str, out_dir: Path, device: str) -> Path:
    """Random bf16 weights of a real model shape, built on the device (no download)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    c = SHAPES[shape]
    out_dir.mkdir(parents=True, exist_ok=True)
    Qwen3Config(**c, dtype="bfloat16", eos_token_id=151645).save_pretrained(out_dir)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, s in param_shapes(c).items():
        if len(s) == 1:
            tensors[name] = torch.ones(s, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(s, dtype=torch.bfloat16, device=device)
            tensors[name] = t.normal_(0.0, 0.02, generator=g)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def workload(num_seqs: int, max_in: int, max_out: int) -> list[tuple[list[int], int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_in))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_out) for _ in range(num_seqs)]
    return list(zip(prompts, max_tokens, strict=True))


def hardware_bound_s(mc: ModelConfig, num_params: int, work) -> tuple[float, dict]:
    kv_tok = mc.kv_bytes_per_token()
    elem = torch.empty((), dtype=mc.dtype).element_size()
    kv_read = sum(kv_tok * (out * len(p) + out * (out - 1) // 2) for p, out in work)
    steps = max(out for _, out in work)
    weights = num_params * elem * steps
    attn = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T and PV, causal half
    flops = sum(2 * num_params * len(p) + attn * len(p) ** 2 // 2 for p, _ in work)
    t = (kv_read + weights) / COPY_BYTES_PER_S + flops / MATMUL_FLOPS_PER_S
    return t, dict(kv_read_tb=kv_read / 1e12, weights_tb=weights / 1e12,
                   prefill_tflop=flops / 1e12)


def run(scheduler: Scheduler, runner: ModelRunner, requests, first_id: int) -> int:
    eos = list(runner.model_config.eos_token_ids)
    for k, (prompt, params) in enumerate(requests):
        scheduler.add_request(AddRequest(first_id + k, prompt, params, eos))
    return drain(scheduler, runner)


def drain(scheduler: Scheduler, runner) -> int:
    """Step until every request finished (no overlap); returns the tokens produced."""
    produced = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan is None:
            raise RuntimeError("the scheduler has unfinished requests but planned nothing")
        deltas = scheduler.process_result(runner.execute(plan))
        produced += sum(len(t) for t in deltas.token_ids)
        if any(e for e in deltas.errors):
            raise RuntimeError(f"request failed: {[e for e in deltas.errors if e]}")
    return produced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model directory")
    src.add_argument("--make-random", choices=sorted(SHAPES), help="random weights of this shape")
    ap.add_argument("--out", help="where --make-random writes (default: a temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()

    model_dir = args.model
    if args.make_random:
        out = Path(args.out or tempfile.mkdtemp(prefix=f"nanopipe-{args.make_random}-"))
        model_dir = str(make_random(args.make_random, out, args.device))
    block_size = args.block_size or (
        256 if args.device == "cuda" and args.attention_backend == "flash_attn" else 16)
    max_model_len = args.max_input_len + args.max_output_len
    config = WorkerConfig(
        model=model_dir, device=args.device, dtype=args.dtype, max_model_len=max_model_len,
        block_size=block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(config)
    print(f"start-up {time.perf_counter() - t0:.1f} s: backend={runner.backend} "
          f"kv_blocks={runner.num_kv_blocks} block_size={block_size} "
          f"cuda_graphs={runner.graphs is not None}")
    scheduler = Scheduler(SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks, block_size=block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, overlap=False,
    ))
    run(scheduler, runner, [([1, 2, 3, 4], SamplingParams(temperature=0.6, max_tokens=16,
                                                          ignore_eos=True))], 1 << 40)
    work = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    vocab = runner.model_config.vocab_size
    if vocab <= 10000:  # tiny test models only: keep the ids in their vocabulary
        work = [([t % vocab for t in p], m) for p, m in work]
    reqs = [(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m)) for p, m in work]
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    produced = run(scheduler, runner, reqs, 0)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    num_params = sum(p.numel() for p in runner.model.parameters()) * runner.world_size
    bound_s, parts = hardware_bound_s(runner.model_config, num_params, work)
    tput = produced / elapsed
    bound = produced / bound_s
    print(json.dumps(dict(
        num_seqs=len(work), prompt_tokens=sum(len(p) for p, _ in work), output_tokens=produced,
        seconds=round(elapsed, 3), output_tok_s=round(tput, 1),
        hardware_bound_s=round(bound_s, 3), hardware_bound_tok_s=round(bound, 1),
        ratio_to_bound=round(tput / bound, 4), **{k: round(v, 3) for k, v in parts.items()},
    ), indent=1))
    print(f"Throughput: {tput:.1f} output tok/s ({produced} tokens in {elapsed:.2f} s); "
          f"hardware bound {bound:.0f} tok/s (H200 figures); ratio {tput / bound:.3f}")


if __name__ == "__main__":
    main()
