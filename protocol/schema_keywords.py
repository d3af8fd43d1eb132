"""The JSON-schema keywords structured outputs can enforce, so that a schema relying on one the
grammar engine (xgrammar 0.2) skips is refused instead of accepted and then broken.

xgrammar reads one family of keywords per schema object, the first of: `$ref`, `const`,
`enum`, `anyOf`, `oneOf`, `allOf`, the keywords of `type`, the object keywords (when
`properties` or `additionalProperties` appear without a type), the array keywords (when
`items` or `prefixItems` do). It skips the rest of that object without a word. It never
reads `not`, `if`/`then`/`else`, `dependentSchemas`, `dependentRequired`, `dependencies`,
`uniqueItems` or `contains`; an `allOf` of several schemas becomes "any JSON value"; a `$ref`
outside the schema becomes "any JSON value"; `multipleOf` holds on integers only, and not
beside a bound on one side only. Annotations (`title`, `description`, `default`...) and
keywords JSON Schema does not define constrain nothing, so they are never refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "multipleOf"})
STRING = frozenset({"minLength", "maxLength", "pattern"})
ARRAY = frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
                   "uniqueItems", "contains"})
OBJECT = frozenset({"properties", "patternProperties", "additionalProperties",
                    "unevaluatedProperties", "propertyNames", "required", "minProperties",
                    "maxProperties", "dependentRequired", "dependentSchemas", "dependencies"})
ANY_VALUE = frozenset({"type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if",
                       "$ref", "$dynamicRef", "$recursiveRef"})
"""Keywords that constrain a value of any type (`then`/`else` act only through `if`)."""
NEVER_READ = frozenset({"not", "if", "$dynamicRef", "$recursiveRef", "uniqueItems", "contains",
                        "dependentRequired", "dependentSchemas", "dependencies"})
ALL_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})

_READ_BY_TYPE = {
    "integer": NUMERIC - {"multipleOf"},  # multipleOf: see _multiple_of_holds
    "number": NUMERIC - {"multipleOf"},
    "string": STRING,
    "array": ARRAY - NEVER_READ,
    "object": OBJECT - NEVER_READ,
}
_FIRST_READ = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
"""The keywords that, present, are all xgrammar reads of their schema object (in this order)."""
INTEGER_MULTIPLE_MAX = 1024
INTEGER_RANGE_MAX = 10_000
"""multipleOf holds on integers by at most this divisor, within at most this many integers."""

_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames",
              "unevaluatedItems", "contains", "not", "if", "then", "else", "additionalItems")
_SUBSCHEMA_LISTS = ("items", "prefixItems", "allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas", "dependencies")


@dataclass(frozen=True, slots=True)
class Unenforced:
    """A keyword the grammar would skip: where it is (a JSON pointer) and why."""

    keyword: str
    path: str
    reason: str


def first_unenforced(schema: Any) -> Unenforced | None:
    """The first keyword, anywhere in `schema`, that the grammar would not enforce."""
    for node, path, default_type in _schemas(schema):
        found = _unenforced_here(node, path, default_type)
        if found is not None:
            return found
    return None


def _schemas(root: Any) -> Iterator[tuple[Mapping[str, Any], str, str | None]]:
    """Every schema object in `root`, in document order, with its JSON pointer and the type
    xgrammar assumes where it names none. A loop, not recursion: any depth is walked."""
    stack: list[tuple[Any, str, str | None]] = [(root, "#", None)]
    while stack:
        node, path, default_type = stack.pop()
        if not isinstance(node, Mapping):
            continue
        yield node, path, default_type
        stack.extend(reversed(list(_children(node, path))))


def _children(node: Mapping[str, Any], path: str) -> Iterator[tuple[Any, str, str | None]]:
    for key, value in node.items():
        at = f"{path}/{_pointer_part(key)}"
        if key in _SUBSCHEMA and isinstance(value, Mapping):
            yield value, at, "string" if key == "propertyNames" else None
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            yield from ((v, f"{at}/{i}", None) for i, v in enumerate(value))
        elif key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            yield from ((v, f"{at}/{_pointer_part(k)}", None) for k, v in value.items())


def _pointer_part(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _unenforced_here(node: Mapping[str, Any], path: str,
                     default_type: str | None) -> Unenforced | None:
    """The first keyword of this schema object alone (not its subschemas) left unenforced."""
    first = next((k for k in _FIRST_READ if k in node), None)
    if first is not None:
        return _beside_first(node, path, first)
    types = _types(node, default_type)
    read = _read_keywords(node, types)
    for key, value in node.items():
        if key in read or not _constrains(key, value, node, types):
            continue
        why = _never_read_why(key) or 'the grammar skips it in a schema without a "type"'
        return Unenforced(key, f"{path}/{_pointer_part(key)}", why)
    return None


def _never_read_why(key: str) -> str | None:
    """Why `key` goes unenforced wherever it is, if it does."""
    if key == "multipleOf":
        return (f'the grammar enforces multipleOf only with "type": "integer", a whole '
                f"divisor of at most {INTEGER_MULTIPLE_MAX}, and no bound or bounds on both "
                f"sides at most {INTEGER_RANGE_MAX} integers apart")
    return "the grammar does not enforce this keyword" if key in NEVER_READ else None


def _beside_first(node: Mapping[str, Any], path: str, first: str) -> Unenforced | None:
    """A schema object with $ref, const, enum, anyOf, oneOf or allOf: xgrammar reads that
    keyword alone; a keyword beside it is skipped (a `type` that every const or enum value
    has already holds)."""
    here = f"{path}/{_pointer_part(first)}"
    if first == "allOf" and isinstance(node[first], list) and len(node[first]) > 1:
        return Unenforced(first, here, "the grammar enforces an allOf of one schema only; "
                                       "merge its schemas into one")
    ref = node.get("$ref")
    if first == "$ref" and isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return Unenforced(first, here, 'only references within the schema ("#" or "#/...") '
                                       "are resolved")
    values = [node["const"]] if first == "const" else node.get("enum")
    for key, value in node.items():
        if key == first or not _constrains(key, value, node, ALL_TYPES):
            continue
        if key == "type" and first in ("const", "enum") and _all_typed(values, value):
            continue
        why = _never_read_why(key) or (f'the grammar reads only "{first}" in this schema '
                                       f'and skips what is beside it')
        return Unenforced(key, f"{path}/{_pointer_part(key)}", why)
    return None


def _types(node: Mapping[str, Any], default_type: str | None) -> frozenset[str]:
    """The types xgrammar lets this schema object's values have."""
    declared = node.get("type", default_type)
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list) and declared:
        return frozenset(t for t in declared if isinstance(t, str))
    if any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        return frozenset({"object"})
    if any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        return frozenset({"array"})
    return ALL_TYPES


def _read_keywords(node: Mapping[str, Any], types: frozenset[str]) -> frozenset[str]:
    """The keywords xgrammar enforces in a schema object read by its type(s)."""
    if types is ALL_TYPES:
        return frozenset()
    read = {"type"}.union(*(_READ_BY_TYPE.get(t, ()) for t in types))
    if _multiple_of_holds(node, types):
        read.add("multipleOf")
    return frozenset(read)


def _multiple_of_holds(node: Mapping[str, Any], types: frozenset[str]) -> bool:
    """xgrammar keeps an integer multipleOf when the divisor is a whole number it supports and
    the range is either unbounded or bounded on both sides and narrow enough."""
    divisor = node.get("multipleOf")
    if "number" in types or not _is_number(divisor) or divisor != int(divisor):
        return False
    if not 0 < divisor <= INTEGER_MULTIPLE_MAX:
        return False
    low, high = _lowest(node), _highest(node)
    if low is None and high is None:
        return True
    return low is not None and high is not None and high - low + 1 <= INTEGER_RANGE_MAX


def _lowest(node: Mapping[str, Any]) -> int | None:
    """The smallest integer the lower bounds allow (None: no lower bound)."""
    found = []
    if _is_number(node.get("minimum")):
        found.append(math.ceil(node["minimum"]))
    if _is_number(node.get("exclusiveMinimum")):
        found.append(math.floor(node["exclusiveMinimum"]) + 1)
    return max(found, default=None)


def _highest(node: Mapping[str, Any]) -> int | None:
    """The largest integer the upper bounds allow (None: no upper bound)."""
    found = []
    if _is_number(node.get("maximum")):
        found.append(math.floor(node["maximum"]))
    if _is_number(node.get("exclusiveMaximum")):
        found.append(math.ceil(node["exclusiveMaximum"]) - 1)
    return min(found, default=None)


def _constrains(key: str, value: Any, node: Mapping[str, Any], types: frozenset[str]) -> bool:
    """Whether `key` restricts this schema's values of `types` (false for annotations, for
    keywords of other types, and for keywords whose value allows everything)."""
    if key == "uniqueItems" and value is not True:
        return False
    if key in ("dependentRequired", "dependentSchemas", "dependencies", "patternProperties"
               ) and not value:
        return False
    if key == "if":
        return "then" in node or "else" in node
    if key in ANY_VALUE:
        return True
    return any(key in family and bool(types & kinds) for family, kinds in (
        (NUMERIC, {"integer", "number"}), (STRING, {"string"}), (ARRAY, {"array"}),
        (OBJECT, {"object"})))


def _all_typed(values: Any, declared: Any) -> bool:
    """Whether every value is of a type `declared` names (a string or a list of them)."""
    listed = declared if isinstance(declared, list) else [declared]
    names = {t for t in listed if isinstance(t, str)}
    return isinstance(values, list) and all(_json_types(v) & names for v in values)


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    kinds = ((str, "string"), (list, "array"), (Mapping, "object"))
    return {name for kind, name in kinds if isinstance(value, kind)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
