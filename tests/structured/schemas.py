"""JSON schemas the structured-output tests ask the embedded model for: nested objects,
arrays, enums, bounded numbers, required fields and patterned strings. Every string is
bounded so a small model's answer always ends within the tests' token budget."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
    "boolean_flag": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"]},
    "enum_color": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "bounded_number": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["temperature"]},
    "bounded_integer_exclusive": {"type": "object", "properties": {
        "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["score"]},
    "string_pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    "array_of_ints": {"type": "object", "properties": {
        "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                               "maximum": 99},
                    "minItems": 1, "maxItems": 4}}, "required": ["numbers"]},
    "array_of_strings": {"type": "object", "properties": {
        "tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
        "required": ["tags"]},
    "nested_address": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {
            "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": NAME, "qty": {
                "type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["items"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                   "maximum": 5},
                        "minItems": 3, "maxItems": 3},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "const_field": {"type": "object", "properties": {
        "version": {"const": 2}, "name": NAME}, "required": ["version", "name"]},
    "nullable": {"type": "object", "properties": {
        "middle_name": {"anyOf": [NAME, {"type": "null"}]}}, "required": ["middle_name"]},
    "any_of_types": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, NAME]}},
        "required": ["id"]},
    "optional_fields": {"type": "object", "properties": {
        "title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1,
                                                   "maximum": 999}},
        "required": ["title"]},
    "deeply_nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "enum_integers": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}},
                      "required": ["level"]},
    "email_like": {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["email"]},
    "date_pattern": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"]},
    "mixed_record": {"type": "object", "properties": {
        "name": NAME, "active": {"type": "boolean"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]},
                  "minItems": 1, "maxItems": 2}},
        "required": ["name", "active", "ratio", "roles"]},
    "enum_array": {"type": "object", "properties": {
        "letters": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                    "maxItems": 3}}, "required": ["letters"]},
}
