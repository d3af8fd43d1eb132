"""What every actor process needs: one zmq.Context, stop signals, parent watch, and the
start-up report to the launcher.

A process stops when it gets SIGTERM or SIGINT, or when its parent dies (the kernel sends
SIGTERM through PR_SET_PDEATHSIG; polling getppid covers the race where the parent died
before the call, and parent_watch.py ends a process stuck where no loop checks). Signals only
set a flag that the loop checks between polls, so a signal that arrives during start-up is
not lost: the loop exits as soon as it starts. Reports to the launcher never wait for a
launcher that is gone: a send that cannot leave gives up once a stop is asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from protocol import parent_watch
from protocol.auth import CurveKeys, secure
from protocol.codec import encode
from protocol.control import Ready, StartupFailed, StartupProgress
from protocol.endpoints import Endpoints
from protocol.parent_watch import die_with_parent
from protocol.sockets import MessageSocket
from protocol.startup_phases import StartupPhase

log = logging.getLogger("nanopipe.actor")

POLL_MS = 100
"""How often a loop wakes up to notice a stop request when no message arrives."""
REPORT_WAIT_MS = 2000
"""How long a failed start-up waits for the launcher's control link to take its report."""


class ExplainedStartupError(RuntimeError):
    """A start-up failure whose message says all the user needs (a peer that never came, a
    cache that cannot fit): logged in one line. Any other failure keeps its traceback."""


class QuietStartupError(ExplainedStartupError):
    """An explained failure that the launcher's own line states in full (a port another
    process took during start-up): the actor logs it at debug level only, so that the user
    reads it once."""


class ProcessRuntime:
    """Owns the process-wide zmq.Context and knows when the process must stop."""

    def __init__(self, role: str, rank: int = 0) -> None:
        self.role = role
        self.rank = rank
        # The launcher's pid as the spec named it: the parent may be gone already.
        self._watch = parent_watch.current()
        self._ppid = self._watch.parent_pid if self._watch is not None else os.getppid()
        self._stop_reason: str | None = None
        # Signals and the parent-death signal belong to a process's main thread; an actor
        # run in a thread (as some tests do) is stopped by its caller instead.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            die_with_parent()
        self.ctx = zmq.Context()
        self._sockets: list[MessageSocket] = []
        self._progress: MessageSocket | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_reason = signal.Signals(signum).name

    def request_stop(self, reason: str) -> None:
        self._stop_reason = self._stop_reason or reason

    @property
    def parent_alive(self) -> bool:
        return os.getppid() == self._ppid

    @property
    def stop_reason(self) -> str | None:
        if self._stop_reason is None and self._watch is not None:
            self._stop_reason = self._watch.stop_reason  # a signal before this runtime
        if self._stop_reason is None and os.getppid() != self._ppid:
            self._stop_reason = "parent process died"
        return self._stop_reason

    def _send_to_launcher(self, sock: MessageSocket, msg: object) -> None:
        """Send a report, or give up (SystemExit) once a stop is asked for: with the
        launcher gone nothing would ever take it, and a blocking send would wait forever."""
        while not sock.socket.poll(POLL_MS, zmq.POLLOUT):
            if self.stop_reason is not None:
                raise SystemExit(f"{self.role}: stopping ({self.stop_reason})")
        sock.send(msg, zmq.NOBLOCK)

    def socket(self, kind: int, address: str, *, bind: bool, accepts: tuple[type, ...] = (),
               security: CurveKeys | None = None) -> MessageSocket:
        """A socket closed with this runtime; `security`: the run's keys (internal tcp links)."""
        sock = MessageSocket(self.ctx, kind, address, bind=bind, accepts=accepts,
                             security=security)
        self._sockets.append(sock)
        return sock

    def adopt(self, sock: MessageSocket) -> MessageSocket:
        """Track a socket made elsewhere so `close` closes it."""
        self._sockets.append(sock)
        return sock

    def report_ready(self, control_address: str, info: str = "", num_kv_blocks: int = 0,
                     security: CurveKeys | None = None, num_host_slots: int = 0,
                     host_block_bytes: int = 0,
                     phases: list[StartupPhase] | None = None) -> None:
        """Tell the launcher this process serves now (and what it learned at start-up)."""
        ready = Ready(role=self.role, rank=self.rank, num_kv_blocks=num_kv_blocks, info=info,
                      num_host_slots=num_host_slots, host_block_bytes=host_block_bytes,
                      phases=list(phases or []))
        self._send_to_launcher(self._control_link(control_address, security), ready)

    def report_progress(self, control_address: str, text: str,
                        security: CurveKeys | None = None) -> None:
        """Tell the launcher what this process is doing now (it prints it for the user)."""
        self._send_to_launcher(self._control_link(control_address, security),
                               StartupProgress(role=self.role, rank=self.rank, text=text))

    def _control_link(self, address: str, security: CurveKeys | None) -> MessageSocket:
        """The one socket progress and READY go out on: one socket keeps them in order, so
        the launcher prints every progress line before it hears the READY."""
        if self._progress is None:
            self._progress = self.socket(zmq.PUSH, address, bind=False, security=security)
        return self._progress

    def report_failure(self, control_address: str, exc: BaseException,
                       security: CurveKeys | None = None) -> None:
        """Tell the launcher why start-up failed; waits briefly so the message leaves."""
        error = str(exc) if isinstance(exc, QuietStartupError) else \
            "".join(traceback.format_exception_only(type(exc), exc)).strip()
        sock = self.ctx.socket(zmq.PUSH)
        try:
            secure(sock, security, server=False)
            sock.connect(control_address)
            # Bounded: with the launcher's socket gone a send would wait forever, and this
            # process with it.
            if sock.poll(REPORT_WAIT_MS, zmq.POLLOUT):
                sock.send(encode(StartupFailed(role=self.role, rank=self.rank, error=error)),
                          zmq.NOBLOCK)
        finally:
            sock.close(linger=REPORT_WAIT_MS)

    def remove_run_dir_if_orphaned(self, endpoints: Endpoints) -> None:
        """The launcher was killed and cannot clean up: remove the run directory for it.

        Every actor does this as it exits, last of all, so a file another actor touched
        while leaving (a socket, the rendezvous file) is removed by whoever leaves after it.
        """
        if not self.parent_alive:
            endpoints.cleanup()

    def close(self) -> None:
        for sock in reversed(self._sockets):
            sock.close()
        self._sockets.clear()
        self.ctx.term()


@dataclass(frozen=True, slots=True)
class Started:
    """An actor that built itself: what it serves with, and what READY tells the launcher."""

    serve: Callable[[], None]
    info: str = ""
    num_kv_blocks: int = 0
    num_host_slots: int = 0
    host_block_bytes: int = 0
    phases: list[StartupPhase] = field(default_factory=list)
    """How long its named start-up phases took (protocol.startup_phases)."""


@contextlib.contextmanager
def actor_process(role: str, endpoints: Endpoints, rank: int = 0) -> Iterator[ProcessRuntime]:
    """The runtime of one actor process, closed on the way out whatever happened; an
    orphaned actor also removes the run directory (even if closing its sockets failed)."""
    rt = ProcessRuntime(role, rank)
    try:
        yield rt
    finally:
        try:
            rt.close()
        finally:
            rt.remove_run_dir_if_orphaned(endpoints)


def start_and_serve(rt: ProcessRuntime, endpoints: Endpoints,
                    start: Callable[[], Started]) -> None:
    """Build the actor and report READY, or report why it could not start and exit 1; then
    serve until Shutdown, SIGTERM/SIGINT or the parent's death."""
    name = rt.role if rt.role != "worker" else f"worker {rt.rank}"
    try:
        started = start()
    except Exception as exc:
        if endpoints.run_dir_missing:  # the launcher sees it too and says so in one line
            log.debug("%s: start-up failed without its run directory: %s", name, exc)
            raise SystemExit(1) from exc
        if isinstance(exc, QuietStartupError):
            log.debug("%s: start-up failed: %s", name, exc)
        elif isinstance(exc, ExplainedStartupError):
            log.error("%s: start-up failed: %s", name, exc)
        else:
            log.exception("%s: start-up failed", name)
        rt.report_failure(endpoints.control, exc, security=endpoints.keys)
        raise SystemExit(1) from exc
    rt.report_ready(endpoints.control, started.info, num_kv_blocks=started.num_kv_blocks,
                    security=endpoints.keys, num_host_slots=started.num_host_slots,
                    host_block_bytes=started.host_block_bytes, phases=started.phases)
    started.serve()
