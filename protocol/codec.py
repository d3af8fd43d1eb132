"""msgpack encoding of every message that crosses a process boundary.

A message is a dataclass registered with `@message(kind)`; it travels as the msgpack
array `[kind, field0, field1, ...]`. Nested dataclasses registered with `@struct` travel
as plain arrays of their fields, `IntEnum` fields as their integers, `array` fields (token
ids, block tables) as one bin of packed int32 (protocol.packed_ints). Encoding is
protocol.wire_encoding; this module decodes. A `Decoder` is built for one socket with the
message types that socket may carry; it checks the kind, the field count and every field's
type (an enum's value too) against the dataclass annotations and refuses anything else.
Nothing is ever unpickled: msgpack cannot express arbitrary objects, and extension types are
refused.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from protocol import packed_ints
from protocol.wire_encoding import encode
from protocol.wire_registry import (
    SCHEMA_ATTR,
    SHARED_ATTR,
    _registered_kinds,
    kind_of,
    message,
    struct,
)

__all__ = ["MAX_FRAME_BYTES", "Decoder", "ProtocolError", "encode", "kind_of", "message",
           "peek_head", "struct", "_registered_kinds"]

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Frames above this size are refused before they are parsed."""

T = TypeVar("T")


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of a kind this socket accepts."""

    field: str | None = None
    """The request field at fault, when a field's own check refused the value."""




class _Frame:
    """The shared structs decoded so far in one frame, in wire order: what a later reference
    (an index) in the same frame stands for."""

    __slots__ = ("shared",)

    def __init__(self) -> None:
        self.shared: list[Any] = []


Checker = Callable[[Any, str, _Frame], Any]


# ---------------------------------------------------------------- decoding


def _check_int(value: Any, where: str, memo: _Frame) -> int:
    if type(value) is not int:
        raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _check_float(value: Any, where: str, memo: _Frame) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")


def _simple(expected: type) -> Checker:
    def check(value: Any, where: str, memo: _Frame) -> Any:
        if type(value) is not expected:
            raise ProtocolError(
                f"{where}: expected {expected.__name__}, got {type(value).__name__}"
            )
        return value

    return check


def _int_list(value: Any, where: str, memo: _Frame) -> list[int]:
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
    for item in value:
        if type(item) is not int:
            raise ProtocolError(f"{where}: expected a list of integers")
    return value


def _int_lists(value: Any, where: str, memo: _Frame) -> list[list[int]]:
    # Inline rather than a call per row: a decode plan's new block ids are one (mostly empty)
    # row per sequence.
    if type(value) is not list:
        raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
    for row in value:
        if type(row) is not list:
            raise ProtocolError(f"{where}: expected a list, got {type(row).__name__}")
        for item in row:
            if type(item) is not int:
                raise ProtocolError(f"{where}: expected a list of integers")
    return value


def _packed_ints(value: Any, where: str, memo: _Frame) -> array:
    if type(value) is not bytes:
        raise ProtocolError(
            f"{where}: expected int32 values packed as bytes, got {type(value).__name__}")
    try:
        return packed_ints.unpack(value)
    except ValueError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _enum_checker(enum_type: type[enum.IntEnum]) -> Checker:
    members = {int(m): m for m in enum_type}

    def check(value: Any, where: str, memo: _Frame) -> enum.IntEnum:
        member = members.get(value) if type(value) is int else None
        if member is None:
            raise ProtocolError(f"{where}: {value!r} is not a {enum_type.__name__}")
        return member

    return check


def _shared_checker(cls: type) -> Checker:
    def check(value: Any, where: str, memo: _Frame) -> Any:
        if type(value) is not int:  # in full, where the frame first carries it
            built = _build(cls, value, where, memo)
            memo.shared.append(built)
            return built
        if 0 <= value < len(memo.shared) and type(memo.shared[value]) is cls:
            return memo.shared[value]
        raise ProtocolError(f"{where}: {value} refers to no earlier {cls.__name__} of this frame")

    return check


def _checker_for(annotation: Any) -> Checker:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"only `X | None` unions are supported, not {annotation}")
        check_inner = _checker_for(inner[0])
        return lambda v, where, memo: None if v is None else check_inner(v, where, memo)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if item_type is int:
            return _int_list
        if item_type == list[int]:
            return _int_lists
        check_item = _checker_for(item_type)
        optional = type(None) in typing.get_args(item_type)

        def check_list(value: Any, where: str, memo: _Frame) -> list:
            if type(value) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            # A column of optional items is mostly all None (a step's finish reasons and
            # errors): counted in C, it is returned as it came.
            if optional and value.count(None) == len(value):
                return value
            return [check_item(item, where, memo) for item in value]

        return check_list
    if annotation is array:
        return _packed_ints
    if isinstance(annotation, type) and issubclass(annotation, enum.IntEnum):
        return _enum_checker(annotation)
    if annotation is int:
        return _check_int
    if annotation is float:
        return _check_float
    if annotation in (str, bytes, bool):
        return _simple(annotation)
    if isinstance(annotation, type) and hasattr(annotation, SCHEMA_ATTR):
        if getattr(annotation, SHARED_ATTR):
            return _shared_checker(annotation)
        return lambda v, where, memo: _build(annotation, v, where, memo)
    raise TypeError(f"no wire encoding for field type {annotation!r}")


def _usual_wire_type(annotation: Any) -> tuple[type, bool]:
    """The msgpack type a field of this annotation usually arrives as, and whether a value of
    that type still needs its checker (to convert it, or to look inside it)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # None takes the full path
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _usual_wire_type(inner)
    if isinstance(annotation, type) and getattr(annotation, SHARED_ATTR, False):
        return int, True  # mostly a reference to its first occurrence
    if origin is list or (isinstance(annotation, type) and hasattr(annotation, SCHEMA_ATTR)):
        return list, True
    if annotation is array:
        return bytes, True
    if isinstance(annotation, type) and issubclass(annotation, enum.IntEnum):
        return int, True
    return annotation, False  # int, float, str, bytes, bool: the type is the whole check


@dataclass(frozen=True, slots=True)
class _Schema:
    """How one class is checked, built once per class from its annotations."""

    fields: list[tuple[str, Checker]]
    """(qualified field name, checker) per field."""
    usual_types: list[type]
    """Each field's usual msgpack type: a frame whose values all have them skips the checkers
    that the type alone settles (a float field sent as an int, a None, take the full path)."""
    conversions: list[tuple[int, str, Checker]]
    """(position, qualified name, checker) of the fields that still need theirs then."""


def _schema(cls: type) -> _Schema:
    schema = getattr(cls, SCHEMA_ATTR)
    if schema is None:
        hints = typing.get_type_hints(cls)
        fields = [(f"{cls.__name__}.{f.name}", _checker_for(hints[f.name]))
                  for f in dataclasses.fields(cls)]
        usual = [_usual_wire_type(hints[f.name]) for f in dataclasses.fields(cls)]
        schema = _Schema(fields, [t for t, _ in usual],
                         [(i, fields[i][0], fields[i][1])
                          for i, (_, convert) in enumerate(usual) if convert])
        setattr(cls, SCHEMA_ATTR, schema)
    return schema


def _build(cls: type[T], values: Any, where: str, memo: _Frame) -> T:
    if type(values) is not list:
        raise ProtocolError(f"{where}: expected an array for {cls.__name__}")
    schema = _schema(cls)
    try:
        if list(map(type, values)) == schema.usual_types:
            args = list(values)
            for i, where, check in schema.conversions:
                args[i] = check(args[i], where, memo)
        else:
            if len(values) != len(schema.fields):
                raise ProtocolError(
                    f"{cls.__name__}: expected {len(schema.fields)} fields, got {len(values)}")
            args = [check(v, where, memo) for (where, check), v in zip(schema.fields, values)]
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
    for f, (where, check), v in zip(dataclasses.fields(cls), _schema(cls).fields, values):
        try:
            check(v, where, _Frame())
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
        return _build(cls, values[1:], cls.__name__, _Frame())


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
