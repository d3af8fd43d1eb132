"""Single key presses from the terminal, without waiting for Enter or echoing them.

Ctrl-C still raises SIGINT (cbreak mode keeps signals), which the caller's runtime turns into
a stop; the terminal's settings are restored on exit whatever happens.
"""

from __future__ import annotations

import os
import sys
import termios
import tty


class Keyboard:
    """`fileno` is None when stdin is not a terminal: then there are no keys to read."""

    def __init__(self) -> None:
        self.fileno: int | None = None
        self._tty: int | None = None
        self._saved: list | None = None

    def __enter__(self) -> Keyboard:
        if sys.stdin is not None and sys.stdin.isatty():
            self.fileno = self._tty = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._tty)
            tty.setcbreak(self._tty)
        return self

    def read(self) -> str:
        """What was typed ("" at end of input: then stop reading)."""
        if self.fileno is None:
            return ""
        data = os.read(self.fileno, 64)
        if not data:
            self.fileno = None
        return data.decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None and self._tty is not None:
            termios.tcsetattr(self._tty, termios.TCSADRAIN, self._saved)
