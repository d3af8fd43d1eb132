"""Which dataclasses are wire types: `@message(kind)` registers a top-level message under
a one-byte kind, `@struct` a dataclass nested inside messages. The encoder and the decoder
read the marks set here and keep their per-class tables on the class."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

KIND_ATTR = "__wire_kind__"
SCHEMA_ATTR = "__wire_schema__"
ENCODERS_ATTR = "__wire_encoders__"
SHARED_ATTR = "__wire_shared__"
_registered_kinds: dict[int, type] = {}


def struct(cls: type[T] | None = None, *, shared: bool = False) -> Any:
    """Mark a dataclass as nestable inside messages (encoded as an array of its fields).

    shared=True, for a frozen struct that many entries of one message carry alike (each new
    sequence's SamplingParams): within one frame an equal value travels and is checked once,
    later occurrences refer to it (protocol.wire_encoding), and all decode to one object."""

    def mark(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        if shared and not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} is shared between entries: it must be frozen")
        # Each marked class gets its own tables (plain class attributes: read on every struct
        # of every frame), built lazily: annotations may name later classes.
        setattr(cls, SCHEMA_ATTR, None)
        setattr(cls, ENCODERS_ATTR, None)
        setattr(cls, SHARED_ATTR, shared)
        return cls

    return mark if cls is None else mark(cls)


def message(kind: int) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as a top-level message with a one-byte kind."""
    if not 0 <= kind <= 0x7F:
        raise ValueError("a message kind is one positive fixint byte (0..127)")

    def register(cls: type[T]) -> type[T]:
        if kind in _registered_kinds:
            raise ValueError(f"message kind {kind:#x} is used twice")
        struct(cls)
        setattr(cls, KIND_ATTR, kind)
        _registered_kinds[kind] = cls
        return cls

    return register


def kind_of(cls: type) -> int:
    return getattr(cls, KIND_ATTR)

