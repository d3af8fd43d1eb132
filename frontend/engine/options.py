"""Config fields that describe themselves: help, command-line flags, choices and bounds.

A config dataclass declares each field once with `option(...)`; the command line
(frontend/engine/cli.py) is generated from these declarations and `check_options` validates
an instance against them, so a field's default, help, flag and limits live in one place.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    help: str
    flags: tuple[str, ...] = ()
    """Command-line spellings, the main one first; () means --field-name."""
    choices: tuple[Any, ...] | None = None
    auto: str | None = None
    """The word that stands for None on the command line (e.g. "auto")."""
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    """A strict lower bound (the value must be greater)."""
    group: str = "engine"
    metavar: str | None = None

    def number_type(self, typ: type) -> Callable[[str], Any]:
        """The command line's parser of a number field: the number, or the auto word."""
        def parse(text: str) -> Any:
            return text if self.auto is not None and text == self.auto else typ(text)

        parse.__name__ = typ.__name__  # argparse names it in "invalid int value"
        return parse


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its description (see Option)."""
    return field(default=default, metadata={"option": Option(help=help, **kw)})


class ConfigError(ValueError):
    """A config field with a value it cannot take; `field` names it, `problem` says why."""

    def __init__(self, owner: str, field_name: str, problem: str) -> None:
        super().__init__(f"{owner}.{field_name} {problem}")
        self.field = field_name
        self.problem = problem


def described_fields(cls: type) -> list[tuple[Field, Option, type]]:
    """(field, its Option, its type without None) for each described field of `cls`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is not None:
            out.append((f, opt, base_type(hints[f.name])))
    return out


def base_type(hint: Any) -> type:
    """int for `int | None`; the type itself otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def resolve_auto_words(config: Any) -> None:
    """Turn a field given as its auto word ("auto", "off") into None, the value it stands for,
    so `LLM(device="auto")` means what `--device auto` does."""
    for f, opt, _ in described_fields(type(config)):
        value = getattr(config, f.name)
        if opt.auto is not None and isinstance(value, str) and value == opt.auto:
            object.__setattr__(config, f.name, None)


def check_options(config: Any) -> None:
    """Raise ConfigError for the first field outside its type, choices or bounds."""
    owner = type(config).__name__
    for f, opt, typ in described_fields(type(config)):
        value = getattr(config, f.name)
        if value is None:
            if f.default is None:
                continue
            raise ConfigError(owner, f.name, "must not be None")
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        auto = () if opt.auto is None else (opt.auto,)
        if opt.choices is not None and value not in opt.choices:
            allowed = ", ".join(map(repr, auto + tuple(opt.choices)))
            raise ConfigError(owner, f.name, f"must be one of {allowed}, got {value!r}")
        if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
            wanted = " or ".join([typ.__name__, *map(repr, auto)])
            raise ConfigError(owner, f.name, f"must be {wanted}, got {value!r}")
        low, high = opt.minimum, opt.maximum
        if low is not None and high is not None and not low <= value <= high:
            raise ConfigError(owner, f.name, f"must be in {low}..{high}, got {value!r}")
        if low is not None and value < low:
            raise ConfigError(owner, f.name, f"must be >= {low}, got {value!r}")
        if high is not None and value > high:
            raise ConfigError(owner, f.name, f"must be <= {high}, got {value!r}")
        if opt.above is not None and not value > opt.above:
            raise ConfigError(owner, f.name, f"must be > {opt.above}, got {value!r}")


def flags_of(opt: Option, name: str) -> tuple[str, ...]:
    """The command-line flags of field `name` (its own, or --the-field-name)."""
    return opt.flags or ("--" + name.replace("_", "-"),)


def to_argv(config: Any) -> list[str]:
    """The flags that rebuild `config` (an EngineConfig or HttpConfig): the inverse of
    parsing, naming only the fields that differ from their defaults."""
    argv: list[str] = []
    for f, opt, typ in described_fields(type(config)):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        flag = flags_of(opt, f.name)[0]
        if typ is bool:
            argv.append(flag)
        else:
            argv += [flag, opt.auto if value is None else str(value)]
    return argv
