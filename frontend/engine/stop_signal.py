"""How the launcher hears SIGTERM and Ctrl-C."""

from __future__ import annotations


class StopSignal:
    """SIGTERM or Ctrl-C in the launcher: a KeyboardInterrupt where the main thread is, and
    remembered. A library may swallow that exception (torch's C start-up does, when the signal lands
    while it imports numpy): start-up and the serving loop check the flag, so the stop is
    never lost."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt
