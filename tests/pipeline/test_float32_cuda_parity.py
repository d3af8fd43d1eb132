"""dtype float32 on CUDA computes in float32: the whole pipeline equals transformers float32
on the same GPU, token for token, with logprobs that agree to float32 rounding.

TF32 dots in the attention kernels (Triton's float32 default) move this tiny model's logits
by ~1e-2 while IEEE float32 stays near 1e-5 (measured in the interpreter with TF32 rounding
emulated). Greedy tokens alone rarely flip on so small a model, so the top logprobs are
compared too.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hf_reference import hf_greedy_logprobs, hf_model
from pipeline_config import tiny_engine
from random_prompts import random_prompts

from frontend import LLM
from protocol import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT_LENGTHS = [1, 7, 33, 64, 100, 150]
MAX_TOKENS = 24
TOP = 5
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True,
                        top_logprobs=TOP)
# IEEE float32 on both sides differs by ~1e-5 here; TF32 attention dots by ~1e-2.
LOGPROB_ATOL = 1e-3


def _transformers_cuda(model_dir: str, prompts: list[list[int]]
                       ) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: greedy tokens and the logprobs of every step, float32 on the GPU."""
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default: IEEE float32 GEMMs
    results = [hf_greedy_logprobs(model_dir, p, MAX_TOKENS, device="cuda") for p in prompts]
    hf_model.cache_clear()
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _memory_utilization(extra: float) -> float:
    free, total = torch.cuda.mem_get_info()
    return min(0.95, (total - free) / total + extra)


def test_float32_cuda_matches_transformers_float32(tiny_llama_dir):
    prompts = random_prompts(7, PROMPT_LENGTHS)
    expected = _transformers_cuda(tiny_llama_dir, prompts)
    cfg = tiny_engine(tiny_llama_dir, device="cuda", dtype="float32",
                      gpu_memory_utilization=_memory_utilization(0.05))
    with LLM(**cfg) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        assert out["token_ids"] == tokens, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)"
        for step, top in enumerate(out["top_logprobs"]):
            ids = torch.tensor([t for t, _ in top])
            got = torch.tensor([lp for _, lp in top])
            err = (got - logprobs[step, ids]).abs().max().item()
            assert err < LOGPROB_ATOL, f"prompt {i} step {step}: top logprobs off by {err:.1e}"
