"""xgrammar's structural tags: free text with constrained parts, such as tool calls whose
arguments must match a schema once the model opens one.

Two spellings arrive, as vLLM takes them:
  * xgrammar's own, `{"type": "structural_tag", "format": {...}}`, where the format is a tree
    of `tag`, `json_schema`, `triggered_tags`, `sequence`, ... nodes; it is kept as given;
  * the older one, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`
    (OpenAI-style `response_format` of type `structural_tag`), rewritten into the first: a
    `triggered_tags` format whose tags hold each structure's schema.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

TYPE = "structural_tag"


class StructuralTagError(ValueError):
    """Not a structural tag of either spelling; the message says what is wrong."""


def normalize(value: Any) -> dict[str, Any]:
    """The structural tag in xgrammar's spelling (see the module's docstring)."""
    if not isinstance(value, Mapping):
        raise StructuralTagError("must be a JSON object")
    if "format" in value:
        if value.get("type", TYPE) != TYPE or not isinstance(value["format"], Mapping):
            raise StructuralTagError(f'must be {{"type": "{TYPE}", "format": {{...}}}}')
        return {"type": TYPE, "format": dict(value["format"])}
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise StructuralTagError('needs a "format" object, or "structures" and "triggers" lists')
    tags = []
    for i, s in enumerate(structures):
        if not (isinstance(s, Mapping) and isinstance(s.get("begin"), str)
                and isinstance(s.get("end"), str) and isinstance(s.get("schema"), Mapping)):
            raise StructuralTagError(f"structures[{i}] must have begin, schema and end")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": dict(s["schema"])}})
    if not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise StructuralTagError("triggers must be a list of non-empty strings")
    return {"type": TYPE, "format": {"type": "triggered_tags", "triggers": list(triggers),
                                     "tags": tags}}


def json_schemas(node: Any, path: str = "format") -> Iterator[tuple[str, Any]]:
    """(where, schema) of every json_schema node of a structural tag's format tree."""
    if isinstance(node, Mapping):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield path, node["json_schema"]
            return
        for key, child in node.items():
            yield from json_schemas(child, f"{path}.{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from json_schemas(child, f"{path}[{i}]")
