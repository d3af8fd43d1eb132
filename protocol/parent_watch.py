"""An actor process dies with its launcher, whatever it is doing when the launcher dies.

Two ways in, because neither is enough alone. The kernel sends SIGTERM when the parent dies
(PR_SET_PDEATHSIG, Linux), and the actor's loop stops on it and cleans up; but a process
blocked in a long call that never returns to Python (a torch.distributed rendezvous waiting
for a rank that will never come, a send to a launcher that is gone) never gets to its loop.
So a daemon thread also polls the parent's pid: once the parent is gone it asks the process to
stop, and if the process is still there `EXIT_GRACE_S` later it removes the run directory
and ends the process itself.

The last actor to leave removes the run directory (every orphan removes it on its way out,
and none can make a new file in it once it is gone), so a killed launcher leaves neither a
process nor a socket file behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass

_PR_SET_PDEATHSIG = 1
POLL_S = 0.2
"""How often the watch thread looks at the parent's pid."""
EXIT_GRACE_S = 3.0
"""How long an orphan may take to stop by itself before the watch thread ends it."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class ParentWatch:
    """The launcher this process belongs to, and the run directory to remove if it dies."""

    parent_pid: int
    run_dir: str | None = None
    stop_reason: str | None = None
    """Set by a stop signal or the parent's death before the actor's runtime exists."""

    @property
    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def remove_run_dir(self) -> None:
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_reason = self.stop_reason or signal.Signals(signum).name

    def _watch(self) -> None:
        while self.parent_alive:
            time.sleep(POLL_S)
        self.stop_reason = self.stop_reason or "parent process died"
        time.sleep(EXIT_GRACE_S)
        # Still here: stuck where no stop request is read. Leave nothing behind.
        self.remove_run_dir()
        os._exit(1)


_current: ParentWatch | None = None


def watch_parent(parent_pid: int, run_dir: str | None) -> ParentWatch:
    """Stop this process (its main thread's loop, or at last the watch thread) when
    `parent_pid` dies; exits at once, removing `run_dir`, if it is already dead.

    Stop signals only set `stop_reason` from here on, so one that arrives while the actor is
    still building itself is not lost (the actor's runtime takes it over)."""
    global _current
    watch = ParentWatch(parent_pid, run_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, watch._on_signal)
    die_with_parent()
    if not watch.parent_alive:  # died before the kernel was asked: no signal will come
        watch.remove_run_dir()
        raise SystemExit(0)
    threading.Thread(target=watch._watch, name="nanopipe-parent-watch", daemon=True).start()
    _current = watch
    return watch


def current() -> ParentWatch | None:
    """This process's watch, if its launcher started it (`watch_parent`)."""
    return _current
