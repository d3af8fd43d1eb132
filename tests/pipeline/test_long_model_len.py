"""A 131,072-token limit changes no token: the same prompts through LLM under the default
limit and under --max-model-len 131072 give the same greedy tokens, while the contexts grow
across many block boundaries (each step's block tables as wide as its longest context)."""

from __future__ import annotations

import pytest
from pipeline_config import tiny_engine
from random_prompts import random_prompts
from tiny_models import make_tiny_model

from frontend import LLM
from protocol import SamplingParams

pytestmark = pytest.mark.slow

HUGE = 131072


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> str:
    """The tiny Qwen3 with room for 131,072 positions."""
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny_128k"), seed=0,
                               max_position_embeddings=HUGE))


def test_greedy_tokens_are_the_same_under_a_huge_limit(long_context_model):
    prompts = random_prompts(11, [3, 15, 16, 17, 40, 90])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for limit in (256, HUGE):
        with LLM(**tiny_engine(long_context_model, max_model_len=limit)) as llm:
            outputs[limit] = [r["token_ids"] for r in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert all(len(t) == 40 for t in outputs[HUGE])
    assert outputs[HUGE] == outputs[256]
