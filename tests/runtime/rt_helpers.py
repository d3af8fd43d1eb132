"""Shared helpers for runtime tests: runner factory and the transformers greedy reference."""

from __future__ import annotations

import functools

import torch

from gpu_workers import ModelRunner, WorkerConfig

BLOCK_SIZE = 16


def make_runner(model_dir: str, rank: int = 0, world_size: int = 1, **overrides) -> ModelRunner:
    kw = dict(model=model_dir, device="cpu", dtype="float32", max_model_len=256,
              block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=1024,
              kv_cache_bytes=2 << 20)
    kw.update(overrides)
    return ModelRunner(WorkerConfig(**kw), rank, world_size)


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(seed: int, lengths: list[int], vocab: int = 600) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
