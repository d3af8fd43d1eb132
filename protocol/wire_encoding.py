"""Encoding a registered message as one msgpack frame, driven by its field annotations:
structs become arrays of their fields, `array` fields (int32 columns) packed bytes, and
everything else (ints, floats, strings, IntEnums and lists of them) goes to msgpack as it is.

A shared struct (`@struct(shared=True)`) travels in full where a frame first carries its
value; every later occurrence of an equal value in that frame travels as the index of that
first one among the frame's full shared structs (0, 1, ...), counted in wire order. A prefill
plan's new sequences mostly carry equal SamplingParams, so each goes once per plan.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol import packed_ints
from protocol.wire_registry import ENCODERS_ATTR, KIND_ATTR, SCHEMA_ATTR, SHARED_ATTR


class _Frame:
    """The shared structs met so far in the frame being encoded."""

    __slots__ = ("ref_by_id", "ref_by_wire", "packer")

    def __init__(self) -> None:
        # The message holds every value alive while it is encoded, so ids are not reused.
        self.ref_by_id: dict[int, int] = {}
        self.ref_by_wire: dict[bytes, int] = {}  # equal values that are distinct objects
        self.packer = msgpack.Packer(use_bin_type=True)


Encoder = Callable[[Any, _Frame], Any]


def _encoder_for(annotation: Any) -> Encoder | None:
    """How a field of this type becomes msgpack-ready; None when it already is (ints, floats,
    strings, IntEnums, lists of those)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        encode_inner = _encoder_for(inner)
        if encode_inner is None:
            return None
        return lambda v, memo: None if v is None else encode_inner(v, memo)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        encode_item = _encoder_for(item_type)
        if encode_item is None:
            return None
        if type(None) in typing.get_args(item_type):  # all None: as it is, counted in C
            return lambda v, memo: v if v.count(None) == len(v) else [
                encode_item(item, memo) for item in v]
        return lambda v, memo: [encode_item(item, memo) for item in v]
    if annotation is array:
        return lambda v, memo: packed_ints.pack(v)
    if isinstance(annotation, type) and hasattr(annotation, SCHEMA_ATTR):
        if getattr(annotation, SHARED_ATTR):
            return _shared_to_wire
        return lambda v, memo: _fields_to_wire(v, memo)
    return None


def _holds_shared(annotation: Any) -> bool:
    if isinstance(annotation, type) and getattr(annotation, SHARED_ATTR, False):
        return True
    return any(_holds_shared(a) for a in typing.get_args(annotation))


@dataclass(frozen=True, slots=True)
class _StructEncoding:
    """How one class goes on the wire: read every field at once, then convert the few
    fields that need it (by position)."""

    read_fields: Callable[[Any], tuple]
    conversions: tuple[tuple[int, Encoder], ...]


def _encoding(cls: type) -> _StructEncoding:
    """Built once per class from its annotations."""
    encoding = getattr(cls, ENCODERS_ATTR)
    if encoding is None:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if getattr(cls, SHARED_ATTR) and any(_holds_shared(hints[n]) for n in names):
            raise TypeError(f"{cls.__name__} is shared: it cannot hold a shared struct")
        encoders = [_encoder_for(hints[name]) for name in names]
        read = operator.attrgetter(*names) if len(names) > 1 else (
            lambda v: tuple(getattr(v, name) for name in names))
        encoding = _StructEncoding(read, tuple((i, enc) for i, enc in enumerate(encoders)
                                               if enc is not None))
        setattr(cls, ENCODERS_ATTR, encoding)
    return encoding


def _fields_to_wire(value: Any, memo: _Frame) -> list:
    encoding = _encoding(type(value))
    out = list(encoding.read_fields(value))
    for i, encode_field in encoding.conversions:
        out[i] = encode_field(out[i], memo)
    return out


def _shared_to_wire(value: Any, memo: _Frame) -> list | int:
    ref = memo.ref_by_id.get(id(value))
    if ref is not None:
        return ref
    wire = _fields_to_wire(value, memo)  # no side effect: a shared struct holds none
    key = memo.packer.pack(wire)
    ref = memo.ref_by_wire.get(key)
    if ref is None:
        memo.ref_by_id[id(value)] = memo.ref_by_wire[key] = len(memo.ref_by_wire)
        return wire
    memo.ref_by_id[id(value)] = ref
    return ref


def encode(msg: Any) -> bytes:
    """Encode a registered message as one msgpack frame."""
    cls = type(msg)
    kind = getattr(cls, KIND_ATTR, None)
    if kind is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    return msgpack.packb([kind, *_fields_to_wire(msg, _Frame())], use_bin_type=True)
