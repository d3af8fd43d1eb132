"""Constrained requests under every way the engine runs a step: overlap off and on, worker
lookahead with two plans ahead, tensor parallelism (gloo, CPU), data parallelism,
speculative decoding (n-gram, or the model as its own draft) and prefill/decode
disaggregation (the grammar's state rebuilt on the decode replica from the first token) give
the same greedy tokens, each obeying its grammar, beside unconstrained requests."""

from __future__ import annotations

import re

import pytest

from frontend import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["hello world", "the cat sat on", "numbers:", "one two three four"]
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2,5}\."
NUMBERS = r"\d{1,3}(,\d{1,3}){3}"
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": REGEX}),
    SamplingParams(temperature=0, max_tokens=40,
                   structured_outputs={"choice": ["alpha", "beta gamma"]}),
    SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": NUMBERS}),
    SamplingParams(temperature=0, max_tokens=12),
]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8)


def _run(model_dir: str, **options) -> list[dict]:
    with LLM(model_dir, **ENGINE, **options) as llm:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir) -> list[dict]:
    out = _run(tiny_qwen3_dir, overlap=False)
    assert re.fullmatch(REGEX, out[0]["text"]), out[0]["text"]
    assert out[1]["text"] in ("alpha", "beta gamma")
    assert re.fullmatch(NUMBERS, out[2]["text"]), out[2]["text"]
    assert all(o["finish_reason"] == "stop" for o in out[:3])
    return out


@pytest.mark.parametrize("options", [
    dict(overlap=True, worker_lookahead=False),
    dict(overlap=True, worker_lookahead=True, plans_ahead=2),
    dict(tensor_parallel_size=2),
    dict(data_parallel_size=2),
    dict(speculative="ngram", num_speculative_tokens=4, ngram_size=1),
    dict(speculative="ngram", num_speculative_tokens=4, ngram_size=1, tensor_parallel_size=2),
    dict(speculative="draft", num_speculative_tokens=3),
    dict(prefill_replicas=1, decode_replicas=1),
    dict(prefill_replicas=1, decode_replicas=1, tensor_parallel_size=2),
], ids=["overlap", "lookahead", "tp2", "dp2", "ngram", "ngram-tp2", "draft", "disagg",
        "disagg-tp2"])
def test_same_tokens_however_the_step_runs(tiny_qwen3_dir, reference, options):
    if options.get("speculative") == "draft":
        options = dict(options, draft_model=tiny_qwen3_dir)
    out = _run(tiny_qwen3_dir, **options)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in reference]
    if options.get("prefill_replicas"):  # decoded past the first token on the decode replica
        assert all(o["metrics"].kv_transfer_s is not None for o in out), out
