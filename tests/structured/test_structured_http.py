"""Structured outputs and tool calling through the HTTP server and the official openai client,
on the embedded SmolLM2: response_format (json_object, json_schema, the SDK's parse with a
pydantic model), vLLM's structured_outputs body field, tools with every tool_choice, tool
results back through the chat template, streaming delta.tool_calls."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from frontend import AsyncClient
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.openai_server.app import create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http_api"))
from http_serving import running_server  # noqa: E402

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def pipeline(smollm2_dir):
    config = EngineConfig(model=smollm2_dir, device="cpu", dtype="float32", max_model_len=1024,
                          max_num_seqs=8)
    with Pipeline(config) as pipeline:
        yield pipeline


def _server(pipeline: Pipeline, **app_kwargs):
    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(pipeline.address) as client:
            yield create_app(client, client.welcome.model, **app_kwargs)

    with running_server(make_app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(pipeline):
    yield from _server(pipeline)


@pytest.fixture(scope="module")
def oai_reasoning(pipeline):
    """The same engine served with the qwen3 reasoning parser."""
    yield from _server(pipeline, reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def test_sdk_parse_returns_the_pydantic_object(oai, model):
    done = oai.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person, temperature=0, max_tokens=64)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object_and_json_schema_on_chat_and_completions(oai, model):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {
        "enum": ["red", "blue", "green"]}, "minItems": 1, "maxItems": 3}}, "required": ["colors"]}
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name some colors."}], temperature=0,
        max_tokens=64, response_format={"type": "json_schema",
                                        "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    text = oai.completions.create(model=model, prompt="A JSON object about a dog:", max_tokens=96,
                                  temperature=0.7, seed=5,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(text.choices[0].text), dict)


def test_vllm_structured_outputs_body_field(oai, model):
    choice = oai.completions.create(model=model, prompt="The best pet is", max_tokens=8,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["cat", "dog"]}})
    assert choice.choices[0].text in ("cat", "dog")
    regex = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A date?"}], max_tokens=16,
        temperature=0, extra_body={"structured_outputs": {"regex": r"20\d\d-0[1-9]-[12]\d"}})
    assert re.fullmatch(r"20\d\d-0[1-9]-[12]\d", regex.choices[0].message.content)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": "low"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
])
def test_bad_specs_are_400s_naming_the_field(oai, model, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=8, extra_body=body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "[^\\s\\S]"}},  # matches nothing at all
    {"structured_outputs": {"regex": "a[^\\d\\D]"}},  # nothing after its first token
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}},
        "required": ["a"]}}}},
])
def test_a_constraint_that_cannot_be_completed_is_an_error_not_free_text(oai, model, body):
    """Where the grammar allows no next token the request ends with a 400, never a 200 whose
    text breaks the constraint; a stream ends with the same error; the engine serves on."""
    with pytest.raises(openai.BadRequestError, match="cannot be completed") as info:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=16, extra_body=body)
    assert info.value.body["param"] in ("structured_outputs", "response_format")
    with pytest.raises(openai.APIError, match="cannot be completed"):
        for _ in oai.chat.completions.create(model=model, messages=ASK, max_tokens=16,
                                             stream=True, extra_body=body):
            pass
    ok = oai.chat.completions.create(model=model, messages=ASK, max_tokens=8, extra_body={
        "structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", ok.choices[0].message.content)


def test_required_tool_call_round_trip(oai, model):
    first = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice="required", parallel_tool_calls=False,
                                        temperature=0, max_tokens=96)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert "city" in args
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = oai.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME],
                                         tool_choice="none", temperature=0, max_tokens=24)
    assert answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


def test_named_tool_choice_streams_its_call(oai, model):
    stream = oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(delta.index, []).append(delta)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    (delta,) = calls[0]
    assert delta.function.name == "get_weather" and delta.id
    jsonschema.validate(json.loads(delta.function.arguments), WEATHER["function"]["parameters"])


HERMES = (r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_tool_calls_the_model_writes(oai, model, stream):
    """The model is held to Hermes' syntax by a regex, so `auto` has a call to find."""
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0,
                  max_tokens=64, extra_body={"structured_outputs": {"regex": HERMES}})
    if not stream:
        message = oai.chat.completions.create(**kwargs).choices[0]
        assert message.finish_reason == "tool_calls"
        assert message.message.content.strip() == "I will check."
        (call,) = message.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] == "celsius"
        return
    content, calls, finish = "", [], None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "<tool_call>" not in content and content.strip() == "I will check."
    assert [c.function.name for c in calls] == ["get_weather"] and finish == "tool_calls"


STRICT_WEATHER = {"type": "function", "function": {
    **WEATHER["function"], "strict": True, "parameters": {
        **WEATHER["function"]["parameters"], "additionalProperties": False}}}
BEFORE = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 degrees celsius in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_tool_under_auto_gets_a_call_that_parses(oai, model, stream):
    """Following an earlier call in the history, the small model opens a `<tool_call>` of its
    own (left free, it writes a block that names no function); a strict tool holds what it
    writes there to the tool's name and schema, and one call ends the answer when parallel
    calls are off."""
    kwargs = dict(model=model, messages=BEFORE, tools=[STRICT_WEATHER, TIME], temperature=0,
                  max_tokens=80, parallel_tool_calls=False)
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    else:
        calls, finish = [], None
        for chunk in oai.chat.completions.create(**kwargs, stream=True):
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, STRICT_WEATHER["function"]["parameters"])
    assert args["city"] == "Rome"


def test_a_structural_tag_constrains_the_tagged_part(oai, model):
    """vLLM's structural_tag: free text around parts that must match their schema; with
    at_least_one the model must write one."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<city>"], "at_least_one": True,
        "stop_after_first": True, "tags": [{
            "type": "tag", "begin": "<city>", "end": "</city>", "content": {
                "type": "json_schema", "json_schema": {
                    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                    "required": ["name"], "additionalProperties": False}}}]}}
    text = oai.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=48,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}}
    ).choices[0].message.content
    match = re.search(r"<city>(.*)</city>", text, re.DOTALL)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)),
                        tag["format"]["tags"][0]["content"]["json_schema"])


def test_a_reasoning_parser_leaves_an_answer_without_a_block_to_its_constraint(
        oai_reasoning, model):
    """The grammar under a reasoning parser allows a `<think>` block first; a model that
    answers at once (SmolLM2 does not think) is held to the schema as before, and its answer
    has no reasoning_content."""
    schema = Person.model_json_schema()
    message = oai_reasoning.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=0, max_tokens=48, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema}}).choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(message.content), schema)
