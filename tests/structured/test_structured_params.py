"""Structured-outputs parameters: vLLM's spelling, one kind per request, refused where made
with an error naming the field, and unchanged over the wire."""

from __future__ import annotations

import json

import pytest

from protocol import AddRequest, Decoder, SamplingParams, SamplingParamsError, encode
from protocol.structured_outputs import (
    StructuredOutputs,
    StructuredOutputsError,
    from_response_format,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("given, kind", [
    ({"json": SCHEMA}, "json"),
    ({"json": json.dumps(SCHEMA)}, "json"),
    ({"json_object": True}, "json_object"),
    ({"regex": r"[a-z]+\d"}, "regex"),
    ({"choice": ["yes", "no", 'say "maybe"']}, "choice"),
    ({"grammar": 'root ::= "a" root | "b"'}, "grammar"),
])
def test_each_kind_is_accepted_and_survives_the_wire(given, kind):
    params = SamplingParams(structured_outputs=given)
    assert params.structured_outputs.kind == kind
    req = AddRequest(request_id=1, prompt_token_ids=[1, 2], params=params, eos_token_ids=[2],
                     client_request_id="r", arrival_time=0.0)
    decoded = Decoder(AddRequest).decode(encode(req))
    assert decoded.params.structured_outputs == params.structured_outputs


def test_a_json_schema_given_as_a_dict_or_its_text_is_one_spec():
    a = SamplingParams(structured_outputs={"json": SCHEMA}).structured_outputs
    b = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA, indent=2)})
    assert a == b.structured_outputs
    assert json.loads(a.spec) == SCHEMA


@pytest.mark.parametrize("given, field, words", [
    ({"regex": "(("}, "structured_outputs.regex", "cannot be compiled"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json", "cannot be compiled"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar", "cannot be compiled"),
    ({"choice": []}, "structured_outputs.choice", "list of 1 to"),
    ({"choice": ["a", 3]}, "structured_outputs.choice", "non-empty strings"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs", "exactly one"),
    ({}, "structured_outputs", "exactly one"),
    ({"xml": "a"}, "structured_outputs", "xml is not supported"),
    ("json", "structured_outputs", "must be an object"),
])
def test_bad_specs_are_refused_naming_the_field(given, field, words):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs=given)
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert words in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's source paths are cut


def test_ignore_eos_cannot_outlast_a_grammar():
    with pytest.raises(SamplingParamsError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})


def test_the_struct_checks_its_kind_on_decode():
    with pytest.raises(StructuredOutputsError, match="kind"):
        StructuredOutputs("yaml", "")


def test_response_format_translates_and_names_itself():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    spec = from_response_format({"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA}})
    assert spec.kind == "json" and json.loads(spec.spec) == SCHEMA
    for bad in ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
                {"type": "yaml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(StructuredOutputsError) as info:
            from_response_format(bad)
        assert info.value.field == "response_format"
        assert str(info.value).startswith("response_format")
