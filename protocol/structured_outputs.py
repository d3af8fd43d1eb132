"""Structured outputs: what a request's text must match (a JSON schema, any JSON object, a
regular expression, one of a list of choices, an EBNF grammar, a structural tag: free text
with constrained parts, protocol.structural_tags), as vLLM spells it.

One kind per request. The spec travels as text (a schema as its JSON), so the wire carries a
small struct and no nested JSON values. Two levels of checking:
  * the struct's own check (on every decode, cheap): a known kind and a bounded spec;
  * `check_compiles` where a request is made (SamplingParams, the HTTP body, the tokenizer):
    xgrammar parses the spec, so a bad schema, regex or grammar is refused there with an error
    naming the field, before the request reaches the scheduler; so is a schema with a keyword
    xgrammar would skip (protocol.schema_keywords).
xgrammar (and torch beneath it) is imported only by the checks and by `build_grammar`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol import reasoning, structural_tags
from protocol.outcomes import FieldError
from protocol.schema_keywords import first_unenforced
from protocol.wire_registry import struct

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 256 * 1024
"""A schema, regex or grammar longer than this is refused (compiling one costs its length)."""
MAX_CHOICES = 1024
FIELD = "structured_outputs"


class StructuredOutputsError(FieldError):
    """A structured-outputs spec that is not valid; `field` names where it was given."""


@struct()
@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    kind: str
    """One of KINDS."""
    spec: str
    """json: the schema's JSON text; json_object: ""; regex: the pattern; choice: the JSON
    text of the list of strings; grammar: the EBNF text; structural_tag: the JSON text of the
    tag in xgrammar's spelling (protocol.structural_tags.normalize)."""
    reasoning: str = ""
    """A reasoning parser (protocol.reasoning.PARSERS) whose block the answer may open with,
    left free by the grammar; "" holds the whole output to it."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputsError(
                FIELD, f"{FIELD} kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise StructuredOutputsError(
                f"{FIELD}.{self.kind}",
                f"{FIELD}.{self.kind} must be at most {MAX_SPEC_CHARS} characters")
        if self.reasoning and self.reasoning not in reasoning.PARSERS:
            raise StructuredOutputsError(FIELD, f"{FIELD} reasoning must be one of "
                                                f"{', '.join(reasoning.PARSERS)} or empty")

    @property
    def key(self) -> tuple[str, str, str]:
        """What a compiled grammar is cached by."""
        return self.kind, self.spec, self.reasoning


def structured_from_user(value: Any, field: str = FIELD) -> StructuredOutputs:
    """vLLM's spelling ({"json": schema} | {"json_object": True} | {"regex": r} |
    {"choice": [...]} | {"grammar": ebnf} | {"structural_tag": tag}) or a StructuredOutputs,
    checked in full: exactly one kind, and xgrammar can parse it. Errors name `field` (and the
    kind)."""
    if isinstance(value, StructuredOutputs):
        check_compiles(value, field)
        return value
    if not isinstance(value, Mapping):
        raise StructuredOutputsError(field, f"{field} must be an object with one of "
                                            f"{', '.join(KINDS)}, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = [k for k in given if k not in KINDS]
    if unknown:
        raise StructuredOutputsError(field, f"{field}.{unknown[0]} is not supported (one of "
                                            f"{', '.join(KINDS)})")
    if len(given) != 1:
        raise StructuredOutputsError(field, f"{field} takes exactly one of {', '.join(KINDS)}, "
                                            f"got {', '.join(given) or 'none'}")
    kind, raw = next(iter(given.items()))
    where = f"{field}.{kind}"
    spec = _spec_text(kind, raw, where)
    try:
        out = StructuredOutputs(kind, spec)
    except StructuredOutputsError as exc:
        raise StructuredOutputsError(where, str(exc).replace(FIELD, field, 1)) from None
    check_compiles(out, field)
    return out


def _spec_text(kind: str, raw: Any, where: str) -> str:
    if kind == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise StructuredOutputsError(where, f"{where} is not valid JSON: {exc}") from None
        if not isinstance(raw, Mapping | bool):
            raise StructuredOutputsError(where, f"{where} must be a JSON schema object")
        try:
            # Key order kept: the output follows the schema's property order.
            return json.dumps(raw, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise StructuredOutputsError(where, f"{where} is not JSON: {exc}") from None
    if kind == "json_object":
        if raw is not True:
            raise StructuredOutputsError(where, f"{where} must be true")
        return ""
    if kind == "structural_tag":
        try:
            tag = structural_tags.normalize(json.loads(raw) if isinstance(raw, str) else raw)
            return json.dumps(tag, separators=(",", ":"))
        except (ValueError, TypeError) as exc:  # StructuralTagError, bad JSON, not JSON
            raise StructuredOutputsError(where, f"{where} {_reason(exc)}") from None
    if kind == "choice":
        if (not isinstance(raw, list | tuple) or not raw or len(raw) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in raw)):
            raise StructuredOutputsError(where, f"{where} must be a list of 1 to {MAX_CHOICES} "
                                                "non-empty strings")
        return json.dumps(list(raw))
    if not isinstance(raw, str) or not raw:
        raise StructuredOutputsError(where, f"{where} must be a non-empty string")
    return raw


def check_compiles(spec: StructuredOutputs, field: str = FIELD) -> None:
    """xgrammar parses the spec (no tokenizer needed: cheap next to compiling it), and a
    schema may use only keywords its grammar enforces: xgrammar skips some silently, and
    the output would then break the schema. Every way a request comes in passes here."""
    where = f"{field}.{spec.kind}"
    if spec.kind == "json":
        _check_enforced(spec.spec, where)
    if spec.kind == "structural_tag":
        for path, schema in structural_tags.json_schemas(json.loads(spec.spec)["format"]):
            _check_enforced(json.dumps(schema), f"{where}.{path}")
    try:
        build_grammar(spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own kinds
        raise StructuredOutputsError(
            where, f"{where} cannot be compiled: {short_error(exc)}") from None


def _reason(exc: Exception) -> str:
    if isinstance(exc, structural_tags.StructuralTagError):
        return str(exc)
    return f"is not valid JSON: {exc}" if isinstance(exc, ValueError) else "is not JSON"


def _check_enforced(schema_text: str, where: str) -> None:
    """Refuse a schema that relies on a keyword xgrammar would skip, naming it and where."""
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return  # xgrammar's own parse says what is wrong
    found = first_unenforced(schema)
    if found is not None:
        raise StructuredOutputsError(
            where, f'{where} uses "{found.keyword}" at {found.path}, which structured outputs '
                   f"cannot enforce ({found.reason}); the output could break the schema")


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def short_error(exc: BaseException) -> str:
    """xgrammar's message, first line, without its time and source-file prefix."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


def build_grammar(spec: StructuredOutputs) -> Any:
    """The xgrammar Grammar of a spec, after the reasoning block its parser leaves free."""
    grammar = _answer_grammar(spec)
    return reasoning.after_block(grammar, spec.reasoning) if spec.reasoning else grammar


def _answer_grammar(spec: StructuredOutputs) -> Any:
    """JSON is compact (no free whitespace): a small model given free whitespace may spend its
    whole budget on newlines."""
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}),
                                            any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.spec)
    if spec.kind == "choice":
        alternatives = " | ".join(_ebnf_literal(c) for c in json.loads(spec.spec))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(spec.spec)


def _ebnf_literal(text: str) -> str:
    """A string literal of xgrammar's EBNF (JSON's escapes, which it reads)."""
    return json.dumps(text, ensure_ascii=True)


def from_response_format(value: Any) -> StructuredOutputs | None:
    """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, and vLLM's
    {"type": "structural_tag", ...} (either spelling: protocol.structural_tags). Errors name
    response_format."""
    field = "response_format"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise StructuredOutputsError(field, f"{field} must be an object")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return structured_from_user({"json_object": True}, field)
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, Mapping) or not isinstance(js.get("schema", {}), Mapping):
            raise StructuredOutputsError(field, f"{field}.json_schema must be an object with "
                                                "a `schema` object")
        schema = js.get("schema", {})
        try:
            return structured_from_user({"json": dict(schema)}, field)
        except StructuredOutputsError as exc:
            raise StructuredOutputsError(field, str(exc).replace(f"{field}.json",
                                                                 f"{field}.json_schema", 1)
                                         ) from None
    if kind == "structural_tag":
        return structured_from_user({"structural_tag": dict(value)}, field)
    raise StructuredOutputsError(field, f"{field}.type must be text, json_object, json_schema "
                                        f"or structural_tag, got {kind!r}")
