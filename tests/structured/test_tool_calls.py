"""Tool calling's pure parts: tools and tool_choice checked and turned into a plan, the
Hermes <tool_call> parser (whole and streamed in any split), the grammar of required and
named choices, assistant tool calls written back into the history."""

from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.openai_server.responses import ChatFormat
from frontend.openai_server.schema import ChatCompletionRequest
from frontend.structured.tool_calls import (
    HermesStream,
    ToolsError,
    parse_hermes,
    render_tool_calls,
    tool_plan,
    with_tools,
)
from protocol import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_whole_answer_parses_into_content_and_calls():
    content, calls = parse_hermes(TEXT)
    assert content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_hermes(broken) == (broken, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, len(TEXT)])
def test_streamed_in_any_split_gives_the_same_calls_and_never_leaks_tags(size):
    stream, content, calls = HermesStream(), "", []
    for i in range(0, len(TEXT), size):
        text, more = stream.feed(TEXT[i:i + size])
        content, calls = content + text, calls + more
    tail, more = stream.finish()
    content, calls = content + tail, calls + more
    assert content.strip() == "Let me look."  # no piece of a tag leaked into the content
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_an_unclosed_last_call_still_counts():
    content, calls = parse_hermes('<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert content is None and [c.name for c in calls] == ["get_time"]


def test_tool_choice_plans():
    assert tool_plan(None, None) is None
    assert tool_plan([WEATHER], None).mode == "auto"
    assert tool_plan([WEATHER], "none").parses is False
    named = tool_plan([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name) == ("named", "get_time")
    schema = named.structured_outputs()["json"]
    assert schema == {"type": "object", "properties": {}}
    required = tool_plan([WEATHER, CLOCK], "required").structured_outputs()["json"]
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], None,
     "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
     "auto", "tools"),
])
def test_bad_tools_name_their_field(tools, choice, field):
    with pytest.raises(ToolsError) as info:
        tool_plan(tools, choice)
    assert info.value.field == field


def test_tools_go_into_the_system_prompt_and_calls_back_into_history():
    msgs = with_tools([{"role": "user", "content": "hi"}], [WEATHER["function"]])
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    merged = with_tools([{"role": "system", "content": "Be kind."}], [WEATHER["function"]])
    assert merged[0]["content"].startswith("Be kind.\n\n# Tools")
    text = render_tool_calls([{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    assert parse_hermes(text)[1][0].arguments == '{"city": "Oslo"}'


def test_chat_request_with_required_tools_is_constrained():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "sunny"}],
        "tools": [WEATHER], "tool_choice": "required"})
    params = req.sampling_params()
    assert params.structured_outputs.kind == "json"
    roles = [m.role for m in req.wire_messages()]
    assert roles == ["system", "user", "assistant", "tool"]
    assert "<tool_call>" in req.wire_messages()[2].content


class _Out:
    def __init__(self, text, finish=None):
        self.text, self.finish_reason = text, finish
        self.token_ids, self.logprobs, self.top_logprobs = [1], None, None
        self.prompt_tokens, self.completion_tokens, self.metrics = 1, 1, None


def test_streaming_chunks_carry_numbered_tool_calls_and_finish_tool_calls():
    fmt = ChatFormat("m", tools=tool_plan([WEATHER, CLOCK], "auto"))
    chunks = []
    for i in range(0, len(TEXT), 5):
        chunks += fmt.delta_chunks(_Out(TEXT[i:i + 5]))
    chunks += fmt.delta_chunks(_Out("", "stop"))
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"), (1, "get_time")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = ChatFormat("m", tools=tool_plan([WEATHER], "required")).response(
        [_Out('[{"name": "get_weather", "arguments": {"city": "Rome"}}]', "stop")])
    message = whole["choices"][0]["message"]
    assert message["content"] is None and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_constrained_params_survive_choice_copies():
    p = SamplingParams(n=2, seed=1, structured_outputs={"choice": ["a", "b"]})
    from protocol.sampling_params import choice_params

    assert all(c.structured_outputs == p.structured_outputs for c in choice_params(p, 2))
