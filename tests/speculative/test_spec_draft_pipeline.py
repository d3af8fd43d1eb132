"""`--speculative draft` through the whole pipeline, as a user runs it: TP=2 over gloo with the
draft on both ranks, and the start-up checks of the draft model."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
import torch  # noqa: E402
from hf_reference import hf_greedy, hf_model  # noqa: E402
from pipeline_config import tiny_engine  # noqa: E402
from spec_helpers import repeating_prompt, truncate_model  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from frontend import LLM, Client  # noqa: E402
from frontend.engine.config import EngineConfig  # noqa: E402
from frontend.engine.options import ConfigError  # noqa: E402
from frontend.openai_server.responses import usage_extension  # noqa: E402
from gpu_workers import WorkerConfig  # noqa: E402
from gpu_workers.model_runner import ModelRunner  # noqa: E402
from gpu_workers.speculative.draft import DraftVocabMismatch  # noqa: E402
from protocol import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def draft_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    return str(truncate_model(tiny_qwen3_dir, tmp_path_factory.mktemp("draft"), 1))


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("vocab600"), vocab_size=600,
                               num_hidden_layers=1))


@pytest.fixture(scope="module")
def draft_llm(tiny_qwen3_dir, draft_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir, tensor_parallel_size=2, speculative="draft",
                           draft_model=draft_dir, num_speculative_tokens=3)) as llm:
        yield llm


def test_greedy_tp2_equals_tp1(draft_llm, tiny_qwen3_dir):
    """Greedy output with a draft on two ranks equals transformers' (the TP=1 reference the
    non-speculative pipeline is tested against)."""
    rng = random.Random(1)
    prompts = [repeating_prompt(rng, rng.randint(10, 40), rng.randint(3, 8)) for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = draft_llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, result in zip(prompts, out, strict=True):
        assert result["token_ids"] == hf_greedy(tiny_qwen3_dir, prompt, 24)


def test_each_request_reports_its_acceptance(draft_llm):
    """RequestMetrics of a speculating request count its proposed and accepted tokens; the
    client library and the HTTP usage extension carry them."""
    rng = random.Random(2)
    prompts = [repeating_prompt(rng, 20, 4) for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for result in draft_llm.generate(prompts, params, use_tqdm=False):
        m = result["metrics"]
        # 20 tokens: the first from the prefill, then each verifying step adds its accepted
        # proposals and one more token, so at most 18 can be accepted
        assert m.generated_tokens == 20 and m.spec_proposed_tokens > 0
        assert 0 <= m.spec_accepted_tokens <= min(m.spec_proposed_tokens, 18)
        # Verifying steps time their tokens too: TPOT spans the first to the last token.
        assert m.tpot_s is not None and m.tpot_s > 0 and m.ttft_s + 19 * m.tpot_s <= m.e2e_s
    with Client(draft_llm.pipeline.address) as client:
        m = client.generate(prompt_token_ids=prompts[0], params=params).metrics
    assert m.spec_proposed_tokens > 0
    usage = usage_extension([m])["nanopipe"]
    assert (usage["spec_proposed_tokens"], usage["spec_accepted_tokens"]) == (
        m.spec_proposed_tokens, m.spec_accepted_tokens)


def test_sampled_tokens_carry_the_target_logprobs(draft_llm, tiny_qwen3_dir):
    """Unseeded temperature > 0: tokens settled by rejection sampling report the target's
    logprob of the token actually kept (a seeded request twice gives the same tokens)."""
    prompt = list(range(40, 60))
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=True)
    outs = draft_llm.generate([prompt, prompt], params, use_tqdm=False)
    model = hf_model(tiny_qwen3_dir)
    for out in outs:
        full = torch.tensor([prompt + out["token_ids"]])
        with torch.no_grad():
            logits = model(full).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        expected = logits.gather(1, torch.tensor(out["token_ids"])[:, None]).squeeze(1)
        assert out["logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    twice = draft_llm.generate([prompt, prompt], seeded, use_tqdm=False)
    assert twice[0]["token_ids"] == twice[1]["token_ids"]


def test_a_draft_of_another_vocabulary_is_refused(tiny_qwen3_dir, other_vocab_dir):
    with pytest.raises(ConfigError) as err:
        LLM(**tiny_engine(tiny_qwen3_dir, speculative="draft", draft_model=other_vocab_dir))
    assert err.value.field == "draft_model" and "vocab_size" in str(err.value)
    # A worker started by hand (no engine config) refuses it too, before sizing anything.
    config = WorkerConfig(tiny_qwen3_dir, dtype="float32", max_model_len=64,
                          speculative="draft", num_speculative_tokens=2,
                          draft_model=other_vocab_dir)
    with pytest.raises(DraftVocabMismatch, match="vocab_size"):
        ModelRunner(config)


@pytest.mark.parametrize("kw, problem", [
    (dict(speculative="draft"), "is required"),
    (dict(speculative="ngram", draft_model="x"), "is only used"),
])
def test_draft_options_name_the_field(tiny_qwen3_dir, kw, problem):
    with pytest.raises(ConfigError) as err:
        EngineConfig(model=tiny_qwen3_dir, **kw)
    assert err.value.field == "draft_model" and problem in str(err.value)
