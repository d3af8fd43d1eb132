"""msgpack encoding of every message that crosses a process boundary.

A message is a dataclass registered with `@message(kind)`; it travels as the msgpack
array `[kind, field0, field1, ...]`. Nested dataclasses registered with `@struct` travel
as plain arrays of their fields, `IntEnum` fields as their integers. A `Decoder` is built
for one socket with the message types that socket may carry; it checks the kind, the field
count and every field's type (an enum's value too) against the dataclass annotations and
refuses anything else. Nothing is ever unpickled:
msgpack cannot express arbitrary objects, and extension types are refused.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Frames above this size are refused before they are parsed."""

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of a kind this socket accepts."""

    field: str | None = None
    """The request field at fault, when a field's own check refused the value."""


_KIND_ATTR = "__wire_kind__"
_SCHEMA_ATTR = "__wire_schema__"
_registered_kinds: dict[int, type] = {}

Checker = Callable[[Any, str], Any]


def struct(cls: type[T]) -> type[T]:
    """Mark a dataclass as nestable inside messages (encoded as an array of its fields)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    setattr(cls, _SCHEMA_ATTR, None)  # built lazily: annotations may name later classes
    return cls


def message(kind: int) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as a top-level message with a one-byte kind."""
    if not 0 <= kind <= 0x7F:
        raise ValueError("a message kind is one positive fixint byte (0..127)")

    def register(cls: type[T]) -> type[T]:
        if kind in _registered_kinds:
            raise ValueError(f"message kind {kind:#x} is used twice")
        struct(cls)
        setattr(cls, _KIND_ATTR, kind)
        _registered_kinds[kind] = cls
        return cls

    return register


def kind_of(cls: type) -> int:
    return getattr(cls, _KIND_ATTR)


# ---------------------------------------------------------------- encoding


def _to_wire(value: Any) -> Any:
    if hasattr(type(value), _SCHEMA_ATTR):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list | tuple):
        # A list of structs, possibly with None among them (a column of optional errors):
        # the first item that is not None tells. IntEnum values need nothing: msgpack packs
        # them as the integers they are.
        for item in value:
            if item is not None:
                if hasattr(type(item), _SCHEMA_ATTR):
                    return [_to_wire(v) for v in value]
                break
    return value


def encode(msg: Any) -> bytes:
    """Encode a registered message as one msgpack frame."""
    cls = type(msg)
    kind = getattr(cls, _KIND_ATTR, None)
    if kind is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    fields = [_to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
    return msgpack.packb([kind, *fields], use_bin_type=True)


# ---------------------------------------------------------------- decoding


def _check_int(value: Any, where: str) -> int:
    if type(value) is not int:
        raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _check_float(value: Any, where: str) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")


def _simple(expected: type) -> Checker:
    def check(value: Any, where: str) -> Any:
        if type(value) is not expected:
            raise ProtocolError(
                f"{where}: expected {expected.__name__}, got {type(value).__name__}"
            )
        return value

    return check


def _int_list(value: Any, where: str) -> list[int]:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
    for item in value:
        if type(item) is not int:
            raise ProtocolError(f"{where}: expected a list of integers")
    return value


def _enum_checker(enum_type: type[enum.IntEnum]) -> Checker:
    members = {int(m): m for m in enum_type}

    def check(value: Any, where: str) -> enum.IntEnum:
        member = members.get(value) if type(value) is int else None
        if member is None:
            raise ProtocolError(f"{where}: {value!r} is not a {enum_type.__name__}")
        return member

    return check


def _checker_for(annotation: Any) -> Checker:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"only `X | None` unions are supported, not {annotation}")
        check_inner = _checker_for(inner[0])
        return lambda v, where: None if v is None else check_inner(v, where)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if item_type is int:
            return _int_list
        check_item = _checker_for(item_type)

        def check_list(value: Any, where: str) -> list:
            if type(value) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            return [check_item(item, where) for item in value]

        return check_list
    if isinstance(annotation, type) and issubclass(annotation, enum.IntEnum):
        return _enum_checker(annotation)
    if annotation is int:
        return _check_int
    if annotation is float:
        return _check_float
    if annotation in (str, bytes, bool):
        return _simple(annotation)
    if isinstance(annotation, type) and hasattr(annotation, _SCHEMA_ATTR):
        return lambda v, where: _build(annotation, v, where)
    raise TypeError(f"no wire encoding for field type {annotation!r}")


def _schema(cls: type) -> list[tuple[str, Checker]]:
    """(qualified field name, checker) per field, built once per class."""
    schema = cls.__dict__.get(_SCHEMA_ATTR)
    if schema is None:
        hints = typing.get_type_hints(cls)
        schema = [
            (f"{cls.__name__}.{f.name}", _checker_for(hints[f.name]))
            for f in dataclasses.fields(cls)
        ]
        setattr(cls, _SCHEMA_ATTR, schema)
    return schema


def _build(cls: type[T], values: Any, where: str) -> T:
    if type(values) is not list:
        raise ProtocolError(f"{where}: expected an array for {cls.__name__}")
    schema = _schema(cls)
    if len(values) != len(schema):
        raise ProtocolError(
            f"{cls.__name__}: expected {len(schema)} fields, got {len(values)}"
        )
    try:
        args = [check(v, where) for (where, check), v in zip(schema, values)]
    except ProtocolError as exc:
        _qualify_field(exc, cls, values)
        raise
    try:
        return cls(*args)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        error = ProtocolError(f"{cls.__name__}: {exc}")
        error.field = getattr(exc, "field", None)
        raise error from exc


def _qualify_field(exc: ProtocolError, cls: type, values: list) -> None:
    """A nested struct refused one of its fields: name it from `cls` down ("params.top_p")."""
    if exc.field is None:
        return
    for f, (where, check), v in zip(dataclasses.fields(cls), _schema(cls), values):
        try:
            check(v, where)
        except ProtocolError:
            exc.field = f"{f.name}.{exc.field}"
            return


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("msgpack extension types are not accepted")


class Decoder:
    """Decodes the frames of one socket, accepting only the given message types."""

    def __init__(self, *message_types: type, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._by_kind = {kind_of(t): t for t in message_types}
        self.max_bytes = max_bytes
        for t in message_types:
            _schema(t)  # fail at construction, not on the first frame

    def decode(self, frame: bytes | memoryview) -> Any:
        if len(frame) > self.max_bytes:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {self.max_bytes}")
        try:
            values = msgpack.unpackb(
                frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_refuse_ext
            )
        except ProtocolError:
            raise
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise ProtocolError(f"not a msgpack frame: {exc}") from exc
        if type(values) is not list or not values or type(values[0]) is not int:
            raise ProtocolError("a message is an array that starts with its kind")
        cls = self._by_kind.get(values[0])
        if cls is None:
            raise ProtocolError(f"message kind {values[0]:#x} is not accepted on this socket")
        return _build(cls, values[1:], cls.__name__)


HEAD_BYTES = 4096
"""How much of a frame `peek_head` reads: enough for a kind and a short request id."""


def peek_head(frame: bytes | memoryview, count: int) -> list | None:
    """The first `count` values of a message array, read from the frame's first bytes only.

    Cheap at any frame size, so a frame too large (or too malformed) to decode can still be
    classified by its kind and answered by its request id. None when the head is not a
    message array with `count` plain values in its first HEAD_BYTES bytes.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                                max_buffer_size=HEAD_BYTES)
    unpacker.feed(bytes(frame[:HEAD_BYTES]))
    try:
        if unpacker.read_array_header() < count:
            return None
        return [unpacker.unpack() for _ in range(count)]
    except Exception:  # out of data, not an array, an extension type: no usable head
        return None
