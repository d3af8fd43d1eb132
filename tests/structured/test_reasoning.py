"""Reasoning parsers: a thinking model's `<think>` block split off as reasoning_content,
whole and streamed in any split, and a constraint that leaves the block free (checked on
strings over a one-character-per-token vocabulary)."""

from __future__ import annotations

import json
import random

import pytest

from frontend.engine.serve_flags import parse_serve_args
from frontend.openai_server.schema import ChatCompletionRequest
from frontend.structured.reasoning import ReasoningSplit, split_reasoning
from protocol.structured_outputs import (
    StructuredOutputs,
    StructuredOutputsError,
    build_grammar,
    structured_from_user,
)

CASES = {  # text: (qwen3's split, deepseek_r1's split)
    "<think>\nLet me see.\n</think>\n\nParis.": (("\nLet me see.\n", "Paris."),) * 2,
    "Paris.": ((None, "Paris."), ("Paris.", None)),
    "  <think>a</think>b": (("a", "b"),) * 2,
    "<think>cut sh": (("cut sh", None),) * 2,
    "<thi": ((None, "<thi"), ("", None)),
    "x <think>y</think>z": ((None, "x <think>y</think>z"), ("x <think>y", "z")),
    "reason</think>\n\nanswer": ((None, "reason</think>\n\nanswer"), ("reason", "answer")),
    "": ((None, ""), ("", None)),
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", list(CASES))
def test_whole_and_streamed_in_any_split_agree(text, parser):
    whole = split_reasoning(text, parser)
    assert whole == CASES[text][parser == "deepseek_r1"]
    for seed in range(20):
        rng, split, got, at = random.Random(seed), ReasoningSplit(parser), ["", ""], 0
        while at < len(text):
            n = rng.randint(1, 4)
            for k, piece in enumerate(split.feed(text[at:at + n])):
                got[k] += piece
            at += n
        for k, piece in enumerate(split.finish()):
            got[k] += piece
        streamed = (got[0], got[1] or None) if split.block else (None, got[1])
        assert streamed == whole


def test_an_unknown_parser_is_refused(capsys):
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        split_reasoning("x", "gpt")
    with pytest.raises(StructuredOutputsError, match="reasoning must be one of"):
        StructuredOutputs("regex", "a", reasoning="gpt")
    with pytest.raises(SystemExit):
        parse_serve_args(["--no-http", "--reasoning-parser", "qwen3"])
    assert "--reasoning-parser applies to the HTTP API" in capsys.readouterr().err


def accepts(spec: StructuredOutputs, text: str) -> bool:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(128)]))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(spec)))
    return matcher.accept_string(text) and matcher.is_completed()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_constraint_holds_the_answer_after_the_block():
    plain = structured_from_user({"json": SCHEMA})
    qwen3 = StructuredOutputs(plain.kind, plain.spec, reasoning="qwen3")
    r1 = StructuredOutputs(plain.kind, plain.spec, reasoning="deepseek_r1")
    assert len({plain.key, qwen3.key, r1.key}) == 3  # compiled and cached apart
    thought = '<think>\nIs {"a": "x"} right? No.\n</think>\n\n{"a": 1}'
    assert not accepts(plain, thought) and accepts(plain, '{"a": 1}')
    assert accepts(qwen3, thought) and accepts(qwen3, '{"a": 1}')
    assert not accepts(qwen3, '<think>x</think>\n{"a": "1"}')
    assert not accepts(qwen3, 'Sure: {"a": 1}')
    assert accepts(r1, 'Is it one?</think>\n\n{"a": 1}')
    assert not accepts(r1, '{"a": 1}')  # the block was opened in the prompt: it must close


def test_the_chat_body_marks_its_constraint_with_the_servers_parser():
    strict = {"type": "function", "function": {"name": "f", "strict": True,
                                               "parameters": SCHEMA}}
    for body in ({"response_format": {"type": "json_schema", "json_schema": {
                  "name": "x", "schema": SCHEMA}}},
                 {"structured_outputs": {"regex": "[0-9]+"}},
                 {"tools": [strict]}, {"tools": [strict], "tool_choice": "required"}):
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **body})
        assert req.sampling_params("qwen3").structured_outputs.reasoning == "qwen3"
        assert req.sampling_params().structured_outputs.reasoning == ""
    free = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert free.sampling_params("qwen3").structured_outputs is None
    assert json.loads(structured_from_user({"json": SCHEMA}).spec) == SCHEMA
