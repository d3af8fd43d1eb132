"""Structured outputs under speculative decoding, in one process: the real Scheduler and
ModelRunner on the tiny qwen3 (CPU float32), its real BPE tokenizer compiling the grammars.

Every verified position is masked by the grammar after the proposals before it, so greedy and
seeded constrained output is the same token for token with and without speculation (n-gram or
a draft model), beside an unconstrained request in the same batch; unseeded draws from a draft
go through rejection sampling against the masked target and still obey their grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from grammar_reference import allowed_after
from spec_helpers import generate, truncate_model

from protocol import AddRequest, FinishReason, SamplingParams
from protocol.structured_outputs import structured_from_user

REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2,5}\."
CHOICES = ["alpha", "beta gamma"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}}}
# Prompts that already hold text of each grammar's language, so n-gram proposals are accepted.
CASES = [({"regex": REGEX}, "alpha beta gamma. alpha beta gamma. alpha beta"),
         ({"choice": CHOICES}, "say beta gamma or alpha: beta gamma"),
         ({"json": SCHEMA}, '{"ok": true, "color": "red"} {"ok": false, "color": "green"} {"ok"'),
         (None, "hello hello hello hello")]
EOS = 2  # the tiny model's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def draft_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    return str(truncate_model(tiny_qwen3_dir, tmp_path_factory.mktemp("draft_trunc"), 1))


def _requests(tokenizer, temperature: float = 0.0, seed: int | None = None):
    reqs = []
    for rid, (spec, text) in enumerate(CASES):
        extra = {} if spec is None else {"structured_outputs": spec}
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, **extra)
        reqs.append(AddRequest(rid, tokenizer.encode(text), params, [EOS]))
    return reqs


def _check_grammars(tokenizer, out) -> None:
    texts = {rid: tokenizer.decode([t for t in ids if t != EOS]) for rid, (ids, _) in out.items()}
    assert all(out[rid][1] is FinishReason.STOP for rid in range(3)), out
    assert re.fullmatch(REGEX, texts[0]), texts[0]
    assert texts[1] in CHOICES
    jsonschema.validate(json.loads(texts[2]), SCHEMA)


def test_greedy_and_seeded_output_is_the_same_with_speculation(tiny_qwen3_dir, tokenizer,
                                                               draft_dir):
    for temperature, seed in ((0.0, None), (0.9, 11)):
        reqs = _requests(tokenizer, temperature, seed)
        base, _, _ = generate(tiny_qwen3_dir, reqs)
        _check_grammars(tokenizer, base)
        for how in (dict(k=4, ngram=2), dict(k=4, ngram=2, overlap=True),
                    dict(k=3, draft=draft_dir)):
            spec, sched, _ = generate(tiny_qwen3_dir, reqs, **how)
            assert spec == base, (how, temperature)
            stats = sched.stats()
            assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0, how


def test_a_draft_proposes_under_the_grammar(tiny_qwen3_dir, tokenizer):
    """The target as its own draft: masked by the same grammar, every proposal of a greedy
    constrained request is the target's own choice, so (nearly) all are accepted."""
    reqs = _requests(tokenizer)[:3]
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, draft=tiny_qwen3_dir)
    assert spec == base
    stats = sched.stats()
    assert stats.spec_accepted_tokens > 0.9 * stats.spec_proposed_tokens > 0, stats


def test_draws_from_a_draft_obey_their_grammar(tiny_qwen3_dir, tokenizer, draft_dir):
    """Unseeded sampling: the draft's proposals are drawn from its own q, unaware of the
    grammar; rejection sampling against the masked target refuses the ones it forbids."""
    out, sched, _ = generate(tiny_qwen3_dir, _requests(tokenizer, 0.9), k=3, draft=draft_dir)
    _check_grammars(tokenizer, out)
    assert sched.stats().spec_proposed_tokens > 0


def test_verify_masks_follow_the_proposals_and_leave_the_matcher_where_it_was(
        tiny_qwen3_dir, tokenizer):
    from gpu_workers.grammar_book import GrammarBook

    spec = structured_from_user({"choice": CHOICES})
    book = GrammarBook(tiny_qwen3_dir, len(tokenizer))
    book.add(0, 5, spec, [])
    beta, gamma = tokenizer.encode("beta"), tokenizer.encode(" gamma")
    good = np.array(beta + gamma[:1])
    bad = np.array(beta[:1] + tokenizer.encode("x") + gamma[:1])  # "x" breaks it at 1
    vocab = len(tokenizer)
    logits = torch.zeros(len(good) + 1 + len(bad) + 1, vocab)
    one = np.array([True, True])
    book.mask_logits(logits, np.array([0, 0]), np.array([5, 5]), one, [good, bad])

    def allowed(prefix: list[int]) -> torch.Tensor:
        return allowed_after(book.compiled(spec).result(), prefix, vocab)

    for j in range(len(good) + 1):
        assert torch.equal(logits[j] == 0, allowed(list(good[:j]))), j
    second = len(good) + 1
    assert torch.equal(logits[second] == 0, allowed([]))
    for j in range(1, len(bad) + 1):  # the refusal's mask, repeated to the end
        assert torch.equal(logits[second + j] == 0, allowed(beta[:1])), j
    assert not torch.isfinite(logits[second + 1, bad[1]])
    # Rolled back: the next step's mask is the empty prefix's again.
    again = torch.zeros(1, vocab)
    book.mask_logits(again, np.array([0]), np.array([5]), one[:1])
    assert torch.equal(again[0] == 0, allowed([]))


def _ended(tiny_qwen3_dir, tokenizer, regex: str, **how):
    """Greedy output of a request whose prompt repeats "xqz." under `regex`, and the errors
    the steps' results ended requests with."""
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": regex})
    reqs = [AddRequest(0, tokenizer.encode("xqz." * 4), params, [EOS])]
    out, _, worker = generate(tiny_qwen3_dir, reqs, **how)
    return out[0], [error for result in worker.results for error in result.ended_errors]


@pytest.mark.parametrize("draft", [False, True])
def test_a_grammar_that_dies_past_accepted_proposals_ends_the_request(tiny_qwen3_dir,
                                                                     tokenizer, draft):
    """After "xqz." the grammar allows nothing, and each token before is the only one it
    allows: the proposals (n-gram lookup in the prompt, or the target as its own draft) walk
    it there and are all accepted, so the verify draws at the dead position and the request
    ends with the dead-end error, as without speculation."""
    from gpu_workers.grammar_book import DEAD_END

    regex = r"xqz\.[^\d\D]"
    how = dict(k=3, draft=tiny_qwen3_dir) if draft else dict(k=4, ngram=2)
    expected = (FinishReason.ERROR, [DEAD_END])
    (_, reason), ended = _ended(tiny_qwen3_dir, tokenizer, regex)
    assert (reason, ended) == expected
    (_, reason), ended = _ended(tiny_qwen3_dir, tokenizer, regex, **how)
    assert (reason, ended) == expected


def test_a_dead_position_the_verify_does_not_reach_leaves_the_request_alone(tiny_qwen3_dir,
                                                                           tokenizer):
    """The n-gram proposals "qz.x" lead to a dead end after "xqz."; the grammar also allows
    "xqy..", which the target prefers: it rejects "z" and goes on as without speculation."""
    regex = r"xq(z\.[^\d\D]|y+)"
    base = _ended(tiny_qwen3_dir, tokenizer, regex)
    assert tokenizer.decode(base[0][0]).startswith("xqy") and base[1] == []
    assert _ended(tiny_qwen3_dir, tokenizer, regex, k=4, ngram=2) == base


@pytest.mark.gpu
def test_on_the_gpu_with_cuda_graphs(tiny_qwen3_dir, tokenizer, draft_dir):
    """Verify steps replay CUDA graphs there; the masks are applied on the device."""
    free, total = torch.cuda.mem_get_info()
    cuda = dict(device="cuda", dtype="float32",
                gpu_memory_utilization=min(0.95, (total - free) / total + 0.05))
    for temperature, seed in ((0.0, None), (0.9, 11)):
        reqs = _requests(tokenizer, temperature, seed)
        base, _, _ = generate(tiny_qwen3_dir, reqs, **cuda)
        _check_grammars(tokenizer, base)
        for how in (dict(k=4, ngram=2), dict(k=3, draft=draft_dir),
                    dict(k=3, draft=tiny_qwen3_dir)):
            spec, sched, _ = generate(tiny_qwen3_dir, reqs, **how, **cuda)
            assert spec == base, (how, temperature)
            assert sched.stats().spec_accepted_tokens > 0, how
        torch.cuda.empty_cache()
