"""Strict tools under tool_choice auto, and the structural tags they are built on: the text
stays free, a call the model opens must name a known tool and give a strict tool arguments its
schema allows, and parallel_tool_calls false ends the answer after one call. The grammars are
checked on strings over a one-character-per-token vocabulary (xgrammar matches bytes, so any
tokenization of an accepted string is accepted)."""

from __future__ import annotations

import json

import pytest

from frontend.openai_server.errors import ApiError
from frontend.openai_server.schema import ChatCompletionRequest
from frontend.structured.tool_calls import ToolsError, parse_hermes, tool_plan
from protocol.structured_outputs import (
    StructuredOutputsError,
    build_grammar,
    from_response_format,
    structured_from_user,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


GOOD = call("get_weather", '{"city": "Oslo", "days": 3}')


def accepts(constraint: dict, text: str) -> bool:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(128)]))
    grammar = build_grammar(structured_from_user(constraint))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def test_auto_with_a_strict_tool_constrains_only_the_calls():
    plan = tool_plan([WEATHER, CLOCK], "auto")
    constraint = plan.structured_outputs()
    assert list(constraint) == ["structural_tag"]
    assert accepts(constraint, "No call needed: it is sunny.")
    assert accepts(constraint, f"Let me check.\n{GOOD}\nDone.")
    assert accepts(constraint, f"{GOOD}\n{call('get_time', '{}')}")  # parallel by default
    assert accepts(constraint, call("get_time", '{"zone": "UTC"}'))  # not strict: any object
    assert not accepts(constraint, call("get_weather", '{"city": "Oslo", "days": "3"}'))
    assert not accepts(constraint, call("get_weather", '{"city": "Oslo"}'))
    assert not accepts(constraint, call("get_weather", '{"city": "Oslo", "days": 3, "x": 1}'))
    assert not accepts(constraint, call("get_forecast", '{"city": "Oslo", "days": 3}'))
    content, calls = parse_hermes(f"Let me check.\n{GOOD}")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 3})]


def test_no_parallel_calls_ends_the_answer_after_the_first():
    constraint = tool_plan([WEATHER, CLOCK], "auto", parallel=False).structured_outputs()
    assert accepts(constraint, f"Checking.\n{GOOD}")
    assert not accepts(constraint, f"{GOOD}\n{call('get_time', '{}')}")


def test_without_strict_tools_auto_leaves_the_output_free():
    assert tool_plan([CLOCK, {"type": "function", "function": {
        "name": "f", "strict": False, "parameters": {"type": "object"}}}],
        "auto").structured_outputs() is None
    assert tool_plan([WEATHER], "none").structured_outputs() is None


@pytest.mark.parametrize("fn, says", [
    ({"name": "f", "strict": "yes"}, "tools[0].function.strict must be true or false"),
    ({"name": "f", "strict": True, "parameters": {"type": "array", "uniqueItems": True}},
     'tools[0].function.parameters uses "uniqueItems"'),
])
def test_bad_strict_tools_are_refused_naming_the_tool(fn, says):
    with pytest.raises(ToolsError, match=says.replace("[", r"\[").replace("]", r"\]")) as info:
        tool_plan([{"type": "function", "function": fn}], "auto")
    assert info.value.field == "tools"


def test_a_loose_tool_may_use_what_a_strict_one_may_not():
    loose = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "uniqueItems": True}}}
    assert tool_plan([loose], "auto").structured_outputs() is None


def test_the_chat_body_sends_the_tag_and_refuses_a_second_constraint():
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    params = ChatCompletionRequest.model_validate(body).sampling_params()
    assert params.structured_outputs.kind == "structural_tag"
    both = ChatCompletionRequest.model_validate({**body, "response_format": {
        "type": "json_object"}})
    with pytest.raises(ApiError, match="a strict tool constrains the output") as info:
        both.sampling_params()
    assert (info.value.status, info.value.param) == (400, "tools")


LEGACY = {"type": "structural_tag", "triggers": ["<fn="], "structures": [
    {"begin": "<fn=add>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"]}, "end": "</fn>"}]}


def test_structural_tags_in_either_spelling():
    legacy = from_response_format(LEGACY)
    assert legacy.kind == "structural_tag"
    tag = json.loads(legacy.spec)
    assert tag["format"]["type"] == "triggered_tags"
    assert structured_from_user({"structural_tag": tag}) == legacy
    assert structured_from_user({"structural_tag": json.dumps(tag)}) == legacy
    assert accepts({"structural_tag": tag}, 'sum: <fn=add>{"a": 1}</fn> ok')
    assert not accepts({"structural_tag": tag}, 'sum: <fn=add>{"a": "1"}</fn>')


@pytest.mark.parametrize("value, says", [
    ("{", "is not valid JSON"),
    ({"format": 3}, '"format"'),
    ({"structures": [], "triggers": []}, '"structures" and "triggers"'),
    ({"structures": [{"begin": "<a>"}], "triggers": ["<"]}, "structures[0] must have"),
    ({"type": "structural_tag", "format": {"type": "bogus"}}, "cannot be compiled"),
    ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "array", "uniqueItems": True}}}, 'uses "uniqueItems"'),
])
def test_bad_structural_tags_name_the_field(value, says):
    with pytest.raises(StructuredOutputsError, match=says.replace("[", r"\[")) as info:
        structured_from_user({"structural_tag": value})
    assert info.value.field.startswith("structured_outputs.structural_tag")
