"""A launched command's output, read line by line on a thread, so a test can wait for a
line without blocking on a pipe."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time


class LauncherLines:
    def __init__(self, proc: subprocess.Popen) -> None:
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in proc.stdout],
                         daemon=True).start()

    def read_until(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first line from now that matches pattern; fails with the output seen."""
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                seen.append(self._lines.get(timeout=0.1))
            except queue.Empty:
                continue
            if match := re.search(pattern, seen[-1]):
                return match
        raise AssertionError(f"{pattern!r} not printed; output:\n{''.join(seen)}")
