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
from pipeline_config import tiny_engine

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


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 600, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def _transformers_cuda(model_dir: str, prompts: list[list[int]]) -> list[tuple[list[int],
                                                                                torch.Tensor]]:
    """Per prompt: greedy tokens and the logprobs of every step, float32 on the GPU."""
    from transformers import AutoModelForCausalLM

    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default: IEEE float32 GEMMs
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").to("cuda").eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = model(out).logits[0, len(prompt) - 1:-1].float()
        results.append((tokens, logits.log_softmax(-1).cpu()))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _memory_utilization(extra: float) -> float:
    free, total = torch.cuda.mem_get_info()
    return min(0.95, (total - free) / total + extra)


def test_float32_cuda_matches_transformers_float32(tiny_llama_dir):
    prompts = _prompts()
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
