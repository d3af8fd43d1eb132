"""How an actor process is started: as its own program, its start-up spec read from stdin.

The launcher runs `python -m <package>.<actor>` and writes one msgpack message to the
child's stdin: who it is (role, rank), the launcher's pid (to notice the launcher's death)
and its configuration dataclasses as plain maps. Nothing is pickled, and the user's main
module is never imported in a child, so a script without a main guard, `python -`,
`python -c` and notebooks can all start a pipeline.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")

MAX_SPEC_BYTES = 1 << 20
"""A start-up spec is a few kilobytes; anything larger on stdin is not one of ours."""


@dataclass(frozen=True)
class ActorStart:
    """What one actor process learns from its launcher before anything else."""

    role: str
    rank: int
    launcher_pid: int
    config: dict[str, Any]
    """The actor's own config and endpoints, each a dataclass flattened by `to_plain`."""


def to_plain(value: Any) -> Any:
    """A dataclass (nested ones too) as maps, lists and scalars msgpack can carry."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(cls: type[T], data: Any) -> T:
    """Rebuild a dataclass from `to_plain`'s output, following its field annotations."""
    hints = typing.get_type_hints(cls)
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data and f.init:
            kwargs[f.name] = _convert(hints.get(f.name, Any), data[f.name])
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        for option in typing.get_args(hint):
            if option is not type(None):
                return _convert(option, value)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_plain(hint, value)
    if origin is tuple and isinstance(value, list):
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_convert(item, v) for v in value)
    if origin is list and isinstance(value, list):
        args = typing.get_args(hint)
        return [_convert(args[0] if args else Any, v) for v in value]
    return value


def encode_start(start: ActorStart) -> bytes:
    return msgpack.packb(to_plain(start), use_bin_type=True)


def decode_start(frame: bytes) -> ActorStart:
    if len(frame) > MAX_SPEC_BYTES:
        raise ValueError("start-up spec too large")
    data = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    return from_plain(ActorStart, data)


def read_start() -> ActorStart:
    """Read this process's start-up spec from stdin (the launcher closes it after writing).

    The process also starts to watch its launcher (parent_watch.py), and gives up at once,
    removing the run directory, if the launcher is already gone (a launcher killed while
    this process was still importing)."""
    from protocol.parent_watch import watch_parent

    frame = sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
    if not frame:
        raise SystemExit("this program is one process of a nanopipe pipeline; "
                         "start a pipeline with `nanopipe serve` or frontend.LLM")
    start = decode_start(frame)
    endpoints = start.config.get("endpoints")
    run_dir = endpoints.get("run_dir") if isinstance(endpoints, dict) else None
    watch_parent(start.launcher_pid, run_dir if isinstance(run_dir, str) else None)
    return start
