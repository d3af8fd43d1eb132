"""Schemas with keywords the grammar would skip are refused wherever a request comes in (HTTP
response_format and structured_outputs, tools, SamplingParams, the LLM API, a ZMQ client),
naming the keyword and where it is; schemas it enforces still work. A constraint that reaches
a dead end names, over HTTP, the body field that set it."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from schemas import SCHEMAS

from frontend import LLM, AsyncClient, Client, SamplingParams, SamplingParamsError
from frontend.client.outputs import RequestRejected
from frontend.openai_server.app import create_app
from protocol.structured_outputs import StructuredOutputs, build_grammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http_api"))
from http_serving import running_server  # noqa: E402

ASK = [{"role": "user", "content": "Answer in JSON."}]
REFUSED = [  # (schema, keyword, JSON pointer, a text the grammar would let through)
    ({"not": {}}, "not", "#/not", '"a"'),
    ({"type": "string", "not": {"const": "x"}}, "not", "#/not", '"x"'),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf", "#/allOf", "[]"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "not": {"const": "x"}}}}}, "not", "#/properties/tags/items/not",
     '{"tags": ["x"]}'),
    ({"$defs": {"n": {"type": "integer", "not": {"const": 3}}}, "$ref": "#/$defs/n"}, "not",
     "#/$defs/n/not", "3"),
    ({"anyOf": [{"type": "null"}, {"type": "integer", "if": {"minimum": 5},
                                   "then": {"maximum": 7}}]}, "if", "#/anyOf/1/if", "9"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#/dependentRequired",
     '{"a": 1}'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems",
     "#/uniqueItems", "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains",
     "#/contains", "[1]"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#/multipleOf", "0.3"),
    ({"type": "integer", "minimum": 0, "multipleOf": 3}, "multipleOf", "#/multipleOf", "4"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3}, "maximum",
     "#/maximum", "7"),
    ({"maxLength": 2}, "maxLength", "#/maxLength", '"abc"'),
]
ENFORCED = {  # every constraint here holds in the output; a property may be named "not"
    "title": "Enforced", "description": "annotations constrain nothing", "type": "object",
    "properties": {"not": {"type": "integer", "minimum": 0, "maximum": 99, "multipleOf": 5,
                           "examples": [5], "default": 5, "$comment": "a property name"},
                   "kind": {"enum": ["a", "b"], "type": "string", "title": "Kind"}},
    "required": ["not", "kind"], "additionalProperties": False,
}
DEAD_END = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}},
            "required": ["a"]}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    with LLM(tiny_qwen3_dir, device="cpu", dtype="float32", max_model_len=1024,
             max_num_seqs=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def http(llm):
    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(llm.pipeline.address) as client:
            yield create_app(client, client.welcome.model)

    with running_server(make_app) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def refusal(resp: httpx.Response, param: str) -> str:
    """The OpenAI error body of a 400 naming `param`; its message."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("schema, keyword, path, text", REFUSED)
def test_http_response_format_refuses_a_keyword_the_grammar_skips(http, schema, keyword, path,
                                                                   text):
    """The grammar built from each schema accepts a text that breaks it, so the server
    refuses the schema, naming the keyword and where it is."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    assert grammar_accepts(schema, text)
    message = refusal(http.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 8, "response_format": response_format(schema)}),
        "response_format")
    assert message.startswith(f'response_format.json_schema uses "{keyword}" at {path}')


def test_http_structured_outputs_and_tools_refuse_it_and_enforced_schemas_work(http):
    conflict = {"allOf": [{"type": "string"}, {"type": "integer"}]}
    message = refusal(http.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 8, "structured_outputs": {"json": conflict}}),
        "structured_outputs.json")
    assert '"allOf" at #/allOf' in message
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "not": {"const": ""}}}}}}
    message = refusal(http.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 8, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}), "tools")
    assert '"not" at #/properties/x/not' in message
    resp = http.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 48, "temperature": 0,
        "response_format": response_format(ENFORCED)})
    assert resp.status_code == 200, resp.text
    jsonschema.validate(json.loads(resp.json()["choices"][0]["message"]["content"]), ENFORCED)


def test_llm_and_zmq_clients_are_refused_and_enforced_schemas_work(llm):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs={"json": {"type": "object", "properties": {
            "not": {"not": {"type": "null"}}}}})
    assert info.value.field == "structured_outputs.json"
    assert '"not" at #/properties/not/not' in str(info.value)
    # A StructuredOutputs struct skips SamplingParams' own check; the tokenizer refuses it.
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(
        "json", json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})))
    with pytest.raises(RequestRejected, match='"uniqueItems" at #/uniqueItems') as info:
        llm.generate(["hi"], params, use_tqdm=False)
    assert info.value.field == "params.structured_outputs.json"
    with Client(llm.pipeline.address, timeout=60) as client:
        with pytest.raises(RequestRejected, match='"uniqueItems" at #/uniqueItems') as info:
            client.generate("hi", params)
    assert info.value.field == "params.structured_outputs.json"
    for schema in SCHEMAS.values():  # the structured tests' schemas are all enforced
        SamplingParams(structured_outputs={"json": schema})
    (out,) = llm.chat([ASK], SamplingParams(temperature=0, max_tokens=48,
                                             structured_outputs={"json": ENFORCED}),
                      use_tqdm=False)
    jsonschema.validate(json.loads(out["text"]), ENFORCED)


@pytest.mark.parametrize("body, param", [
    ({"response_format": response_format(DEAD_END)}, "response_format"),
    ({"structured_outputs": {"json": DEAD_END}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEAD_END}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_a_dead_end_names_the_body_field_that_set_the_constraint(http, body, param):
    """The engine calls every constraint params.structured_outputs; the client is told the
    field it wrote, whole answer or stream."""
    request = {"messages": ASK, "max_tokens": 16, **body}
    assert "cannot be completed" in refusal(http.post("/v1/chat/completions", json=request),
                                            param)
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as resp:
        resp.read()
    if resp.status_code == 200:  # the error came after the first delta: as the last event
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        error = next(e["error"] for e in events if "error" in e)
    else:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
    assert error["param"] == param and "cannot be completed" in error["message"]


def grammar_accepts(schema: dict, text: str) -> bool:
    """Whether the grammar the engine builds from `schema` accepts all of `text`."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(i) for i in range(128)]))
    grammar = build_grammar(StructuredOutputs("json", json.dumps(schema)))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()
