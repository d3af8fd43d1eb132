"""Starting the engine's processes from a thread that lives as long as the program.

Each child asks Linux for a signal when its parent dies (protocol.parent_watch
.die_with_parent), and Linux sends it when the *thread* that forked the child exits, not the
process. An `LLM` built in a worker thread (a thread pool, a web app's start-up hook) would
lose its engine as soon as that thread ended. Children forked off the main thread are
started directly; from any other thread, by one daemon thread kept for the purpose.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from concurrent.futures import Future
from typing import Any

_requests: queue.SimpleQueue[tuple[list[str], dict[str, Any], Future]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs), forked by a thread that outlives the caller's."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(cmd, **kwargs)
    done: Future[subprocess.Popen] = Future()
    _requests.put((cmd, kwargs, done))
    _ensure_thread()
    return done.result()


def _ensure_thread() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="nanopipe-spawner", daemon=True)
            _thread.start()


def _serve() -> None:
    while True:
        cmd, kwargs, done = _requests.get()
        try:
            done.set_result(subprocess.Popen(cmd, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)
