"""A server started with a reasoning parser, over a scripted client, through the openai SDK:
reasoning_content and content apart, whole and streamed, tool calls read from the content
only, and the request's constraint sent with the parser's block left free."""

from __future__ import annotations

import openai
import pytest
from http_fakes import FakeClient
from http_serving import running_server, static_app

from frontend.openai_server.app import create_app

SCRIPT = ["<thi", "nk>\nThe user wants ", "the weather; <tool_call> is ", "how I ask.\n</th",
          "ink>\n\n", "Checking.\n<tool_call>\n", '{"name": "get_weather", "arguments": ',
          '{"city": "Rome"}}\n</tool_call>']
REASONING = "\nThe user wants the weather; <tool_call> is how I ask.\n"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def fake() -> FakeClient:
    return FakeClient(script=SCRIPT)


@pytest.fixture(scope="module")
def oai(fake):
    app = create_app(fake, "fake-model", reasoning_parser="qwen3")
    with running_server(lambda: static_app(app)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_reasoning_and_tool_calls_apart(oai, fake):
    choice = oai.chat.completions.create(model="fake-model", messages=ASK,
                                         tools=[WEATHER]).choices[0]
    message = choice.message
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content.strip() == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"


def test_streamed_reasoning_then_content(oai):
    reasoning, content, logprobs = "", "", 0
    for chunk in oai.chat.completions.create(model="fake-model", messages=ASK, stream=True,
                                             logprobs=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        logprobs += len((chunk.choices[0].logprobs and chunk.choices[0].logprobs.content) or [])
    assert reasoning == REASONING
    assert content == "".join(SCRIPT).split("</think>\n\n")[1]
    assert logprobs == len(SCRIPT)  # each token's, once, with its reasoning or its content


def test_the_constraint_leaves_the_block_free(oai, fake):
    oai.chat.completions.create(model="fake-model", messages=ASK, extra_body={
        "structured_outputs": {"regex": "[A-Z][a-z]+"}})
    assert fake.calls[-1].params.structured_outputs.reasoning == "qwen3"
