"""Command-line mistakes as one line, and the exit statuses of `nanopipe serve`.

argparse answers a mistyped flag with the whole usage block and no hint; an operator who
typed `--tp2` wants to read which flag it meant, in one line.

Exit statuses (the same for `nanopipe serve` and `scripts/launch.sh`):

    0  stopped by Ctrl-C or SIGTERM after serving
    1  start-up failed (model, device, port in use, a process that did not start), or the
       engine died while serving
    2  the command line is wrong (unknown flag, bad value, flags that contradict)
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

EXIT_STOPPED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

SUGGEST_CUTOFF = 0.6
"""difflib's similarity ratio a known flag needs to be offered as "did you mean"."""


def closest(word: str, known: Sequence[str]) -> str | None:
    """The known word most like `word`, if any is alike enough."""
    found = difflib.get_close_matches(word, known, n=1, cutoff=SUGGEST_CUTOFF)
    return found[0] if found else None


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit 2), naming the flag that
    was probably meant when one was mistyped."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None,
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unknown(extras))
        return parsed

    def _flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def _unknown(self, extras: list[str]) -> str:
        """What is wrong with the first argument the parser did not take."""
        first = extras[0]
        if not first.startswith("-"):
            return f"unexpected argument {first!r}"
        name = first.split("=", 1)[0]
        hint = closest(name, self._flags())
        if hint:
            return f"unknown flag {name} (did you mean {hint}?)"
        return f"unknown flag {name} (`{self.prog} --help` lists the flags)"

