"""`python -m frontend.top ADDRESS` / `nanopipe-top ADDRESS`: attach to a running pipeline and
show its throughput, queue, KV use, prefix-cache hits, step time and requests, redrawn in
place every --interval seconds.

ADDRESS takes the forms the stdout detokenizer takes (the public client address, the
deltas_pub address, or the run directory, which a tcp pipeline needs for its keys). `q` or
Ctrl-C detaches and leaves the engine untouched. It exits 0 when detached or when the pipeline
stops, and 1 with a one-line message when nothing answers at ADDRESS (within
--attach-timeout), when the engine dies, or when the pipeline falls silent.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import zmq
from rich.console import Console
from rich.live import Live

from frontend.actors.stdout_detokenizer import (
    ATTACH_TIMEOUT_S,
    SILENCE_TIMEOUT_S,
    AttachError,
    attach,
    resolve_address,
    run_keys,
)
from frontend.top.keyboard import Keyboard
from frontend.top.render import render
from frontend.top.state import TopState
from protocol import ProtocolError, TokenDeltas
from protocol.auth import CurveKeys
from protocol.engine_messages import EngineStats, WatchGoodbye, WatchHeartbeat, WatchRequest
from protocol.process_runtime import ProcessRuntime
from protocol.sockets import MessageSocket

PROG = "nanopipe-top"
INTERVAL_S = 1.0
ONCE_SPAN_S = 1.0
"""--once shows rates over at least this much time (EngineStats come every 0.5 s)..."""
ONCE_WAIT_S = 3.0
"""...waiting at most this long for them."""
QUIT_KEYS = ("q", "Q")


@dataclass(frozen=True, slots=True)
class Outcome:
    """Why watching ended: `message` for stderr, `code` the exit status."""

    message: str | None
    code: int


class Watcher:
    """Reads deltas_pub into a TopState; knows when the stream ended and why."""

    def __init__(self, sub: MessageSocket, state: TopState, silence_s: float) -> None:
        self.sub = sub
        self.state = state
        self.silence_s = silence_s
        self.last_heard = time.monotonic()
        self.ended: Outcome | None = None

    def drain(self) -> None:
        """Take every message waiting (never blocks)."""
        while self.ended is None and self.sub.poll(0):
            self.last_heard = now = time.monotonic()
            try:
                msg = self.sub.recv()
            except ProtocolError:
                continue
            if isinstance(msg, TokenDeltas):
                self.state.on_deltas(msg, now)
            elif isinstance(msg, WatchRequest):
                self.state.on_request(msg, now)
            elif isinstance(msg, EngineStats):
                self.state.on_stats(msg)
            elif isinstance(msg, WatchHeartbeat):
                if msg.dead_reason is not None:
                    self._end(f"engine dead: {msg.dead_reason}", 1)
            elif isinstance(msg, WatchGoodbye):
                self._end(f"engine dead: {msg.reason}" if msg.engine_dead else msg.reason,
                          1 if msg.engine_dead else 0)
        if self.ended is None and time.monotonic() - self.last_heard > self.silence_s:
            self._end(f"no word from the pipeline for {self.silence_s:g} s: it is gone", 1)

    def _end(self, message: str, code: int) -> None:
        self.state.status = message
        self.ended = Outcome(message, code)


def run_top(address: str, keys: CurveKeys | None = None, *, interval_s: float = INTERVAL_S,
            once: bool = False, attach_timeout_s: float = ATTACH_TIMEOUT_S,
            silence_timeout_s: float = SILENCE_TIMEOUT_S, console: Console | None = None
            ) -> Outcome:
    """Attach, show the dashboard until detached or the stream ends, and say why it ended."""
    console = console or Console()
    rt = ProcessRuntime(PROG)
    try:
        try:
            sub, hello = attach(rt, address, attach_timeout_s, keys)
        except AttachError as exc:
            return Outcome(str(exc), 1)
        if hello.dead_reason is not None:
            return Outcome(f"engine dead: {hello.dead_reason}", 1)
        watcher = Watcher(sub, TopState(address), silence_timeout_s)
        if once:
            return _once(rt, watcher, console)
        return _live(rt, watcher, console, interval_s)
    finally:
        rt.close()


def _once(rt: ProcessRuntime, watcher: Watcher, console: Console) -> Outcome:
    deadline = time.monotonic() + ONCE_WAIT_S
    while rt.stop_reason is None and watcher.ended is None \
            and watcher.state.stats_span_s < ONCE_SPAN_S and time.monotonic() < deadline:
        watcher.sub.poll(50)
        watcher.drain()
    console.print(render(watcher.state.view(time.monotonic())))
    return watcher.ended or Outcome(None, 0)


def _live(rt: ProcessRuntime, watcher: Watcher, console: Console,
          interval_s: float) -> Outcome:
    frame = lambda: render(watcher.state.view(time.monotonic()))  # noqa: E731
    with Keyboard() as keyboard, Live(frame(), console=console, screen=console.is_terminal,
                                      auto_refresh=False, redirect_stdout=False,
                                      redirect_stderr=False) as live:
        poller = zmq.Poller()
        poller.register(watcher.sub.socket, zmq.POLLIN)
        if keyboard.fileno is not None:
            poller.register(keyboard.fileno, zmq.POLLIN)
        next_frame = time.monotonic() + interval_s
        while rt.stop_reason is None and watcher.ended is None:
            timeout_ms = max(0.0, min(next_frame - time.monotonic(), 0.1)) * 1000
            ready = dict(poller.poll(timeout_ms))
            if keyboard.fileno is not None and keyboard.fileno in ready:
                fileno = keyboard.fileno
                typed = keyboard.read()
                if any(k in typed for k in QUIT_KEYS):
                    return Outcome(None, 0)
                if keyboard.fileno is None:
                    poller.unregister(fileno)
            watcher.drain()
            if time.monotonic() >= next_frame:
                live.update(frame(), refresh=True)
                next_frame = time.monotonic() + interval_s
    if watcher.ended is None:  # Ctrl-C or SIGTERM
        return Outcome(None, 0)
    console.print(frame())  # the last state, on the main screen, where it stays
    return watcher.ended


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description="A live view of a running "
                                     "nanopipe pipeline (q or Ctrl-C detaches).")
    parser.add_argument("address", help="the pipeline's client address, its deltas_pub "
                                        "address, or its run directory")
    parser.add_argument("--interval", type=float, default=INTERVAL_S,
                        help="seconds between redraws (default %(default)s)")
    parser.add_argument("--once", action="store_true",
                        help="print one frame and exit (for scripts)")
    parser.add_argument("--attach-timeout", type=float, default=ATTACH_TIMEOUT_S,
                        help="seconds to wait for the pipeline to answer (default %(default)s)")
    parser.add_argument("--silence-timeout", type=float, default=SILENCE_TIMEOUT_S,
                        help="seconds without a heartbeat after which the pipeline counts as "
                             "gone (default %(default)s)")
    args = parser.parse_args(argv)
    for flag, value in (("--interval", args.interval), ("--attach-timeout",
                        args.attach_timeout), ("--silence-timeout", args.silence_timeout)):
        if not value > 0:
            parser.error(f"{flag} must be a positive number of seconds, got {value:g}")
    try:
        address, keys = resolve_address(args.address), run_keys(args.address)
    except AttachError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    outcome = run_top(address, keys, interval_s=args.interval, once=args.once,
                      attach_timeout_s=args.attach_timeout,
                      silence_timeout_s=args.silence_timeout)
    if outcome.message is not None:
        print(f"{PROG}: {outcome.message}", file=sys.stderr, flush=True)
    sys.exit(outcome.code)


if __name__ == "__main__":
    main()
