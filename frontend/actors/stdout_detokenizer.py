"""Watch a running pipeline: print every request's text as it is generated.

    python -m frontend.actors.stdout_detokenizer --model DIR ADDRESS

ADDRESS is the pipeline's public client address (what the launcher prints as "clients
connect to:"), its `deltas_pub` address, or its run directory (a tcp pipeline needs the
latter: its keys are there). An abstract ipc address (`ipc://@name`, Linux) has no socket
file to check, so a wrong name is reported only after --attach-timeout. The printer
subscribes to the scheduler's best-effort copy of each step's TokenDeltas, so it never slows
the main path. It says "attached" (on stderr) once the scheduler has greeted its subscription
and its tokenizer is loaded: every request submitted from then on is printed whole; a request
that began earlier is decoded from where it joined. Text is written to stdout as it arrives;
a `[client request id]` tag starts a new line whenever the output switches to another
request, and each request ends with a `<finish: ...>` line.

It exits 0 when the pipeline stops, and 1 with a one-line message when it cannot attach
(nothing at ADDRESS answers within --attach-timeout), when the engine dies, or when the
pipeline falls silent (no heartbeat for --silence-timeout).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TextIO

import zmq

from frontend.actors.incremental_detok import (
    DecodeFn,
    IncrementalDetokenizer,
    context_anchor,
    make_decode_fn,
)
from frontend.client.outputs import EngineDeadError
from frontend.client.transport import check_address
from protocol import ClientHello, ClientWelcome, EngineDead, ProtocolError, TokenDeltas
from protocol.auth import CREDENTIALS_FILE, Credentials, CurveKeys, load_credentials
from protocol.engine_messages import EngineStats, WatchGoodbye, WatchHeartbeat, WatchRequest
from protocol.process_runtime import POLL_MS, ProcessRuntime
from protocol.sockets import MessageSocket

ATTACH_TIMEOUT_S = 5.0
SILENCE_TIMEOUT_S = 5.0
"""No message for this long (the scheduler sends a heartbeat every second) means it is gone."""
WATCH_MESSAGES = (TokenDeltas, WatchHeartbeat, WatchRequest, WatchGoodbye, EngineStats)
"""Everything the scheduler publishes on deltas_pub; the printer ignores EngineStats."""
PROG = "stdout_detokenizer"


class AttachError(RuntimeError):
    """Nothing at the given address is a pipeline that answers."""


class PipelineGone(RuntimeError):
    """The pipeline died or fell silent while we watched it."""


def resolve_address(address: str) -> str:
    """A zmq address as given, or a run directory's `deltas_pub` socket (for a tcp pipeline,
    the address its credentials file names)."""
    if "://" in address:
        if not address.startswith("ipc://"):  # an ipc address is checked on opening
            try:
                check_address(address)
            except (ValueError, EngineDeadError) as exc:
                raise AttachError(str(exc)) from None
        return address
    if os.path.isdir(address):
        if os.path.exists(os.path.join(address, CREDENTIALS_FILE)):
            return _credentials(address).deltas_pub
        return f"ipc://{os.path.abspath(address)}/deltas_pub"
    raise AttachError(f"{address!r} is neither a zmq address nor a run directory")


def run_keys(address: str) -> CurveKeys | None:
    """The keys of a tcp pipeline's internal links, when `address` is its run directory."""
    if os.path.isdir(address) and os.path.exists(os.path.join(address, CREDENTIALS_FILE)):
        return _credentials(address).keys
    return None


def _credentials(run_dir: str) -> Credentials:
    try:
        return load_credentials(run_dir)
    except ValueError as exc:
        raise AttachError(str(exc)) from None


def open_socket(rt: ProcessRuntime, kind: int, address: str,
                accepts: tuple[type, ...], keys: CurveKeys | None = None) -> MessageSocket:
    """Every socket of the printer is made here, with the run's keys where it has them."""
    if address.startswith("ipc://"):
        check_ipc_address(address)
    return rt.socket(kind, address, bind=False, accepts=accepts, security=keys)


def check_ipc_address(address: str) -> None:
    """Fail at once where an ipc address can be seen to be wrong: a filesystem socket whose
    file is missing (a pipeline binds before it reports ready), or an abstract one (`@name`,
    Linux) with no name. An abstract name has no file to look for: a wrong one shows only as
    silence, which `attach` reports once its timeout has passed."""
    path = address.removeprefix("ipc://")
    if path.startswith("@"):
        try:
            check_address(address)  # the name is all there is to check
        except ValueError as exc:
            raise AttachError(str(exc)) from None
        return
    if not os.path.exists(path):
        raise AttachError(f"no pipeline at {address}: the socket file does not exist")


class StdoutPrinter:
    def __init__(self, decode: DecodeFn, out: TextIO, skip_special_tokens: bool = True,
                 context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.context = list(context)
        """Decoded ahead of every request's tokens (it never sees the prompt): context_anchor."""
        self.out = out
        self.skip = skip_special_tokens
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.names: dict[int, str] = {}
        """The client's id of each announced request; others show as #<engine id>."""
        self.stops: dict[int, tuple[list[str], bool]] = {}
        """Each announced request's stop strings, so its text is cut where the client's is."""
        self.current: int | None = None  # whose text the last line holds
        self.line_open = False

    def on_request(self, msg: WatchRequest) -> None:
        if msg.client_request_id:
            self.names[msg.request_id] = msg.client_request_id
        if msg.stop:
            self.stops[msg.request_id] = (msg.stop, msg.include_stop)

    def on_deltas(self, msg: TokenDeltas) -> None:
        for i, request_id in enumerate(msg.request_ids):
            detok = self.detoks.get(request_id)
            if detok is None:
                stop, include_stop = self.stops.get(request_id, ((), False))
                detok = self.detoks[request_id] = IncrementalDetokenizer(
                    self.decode, self.context, skip_special_tokens=self.skip, stop=stop,
                    include_stop=include_stop)
            finish, error = msg.finish_reasons[i], msg.errors[i]
            text = detok.add(msg.token_ids[i])
            if finish is not None or error is not None:
                text += detok.flush()
            if text:
                self._write(request_id, text)
            if finish is not None or error is not None:
                del self.detoks[request_id]
                self._end_line()
                note = f"error: {error.message}" if error is not None else f"finish: {finish}"
                self.out.write(f"[{self._tag(request_id)}] <{note}>\n")
                self.names.pop(request_id, None)
                self.stops.pop(request_id, None)
                self.current = None
        self.out.flush()

    def _tag(self, request_id: int) -> str:
        return self.names.get(request_id) or f"#{request_id}"

    def _write(self, request_id: int, text: str) -> None:
        if request_id != self.current:
            self._end_line()
            self.out.write(f"[{self._tag(request_id)}] ")
            self.current = request_id
        self.out.write(text)
        self.line_open = not text.endswith("\n")

    def _end_line(self) -> None:
        if self.line_open:
            self.out.write("\n")
            self.line_open = False


def attach(rt: ProcessRuntime, address: str, timeout_s: float = ATTACH_TIMEOUT_S,
           keys: CurveKeys | None = None) -> tuple[MessageSocket, WatchHeartbeat]:
    """Subscribe and wait for the scheduler's greeting; from then on nothing is missed.

    `address` may be the deltas_pub address or the public client address: both are tried at
    once, and the tokenizer's welcome names the deltas address when it is the latter.
    """
    sub = open_socket(rt, zmq.SUB, address, WATCH_MESSAGES, keys)
    dealer = open_socket(rt, zmq.DEALER, address, (ClientWelcome, EngineDead))
    try:
        # Queued at once where `address` is a client address. Where it is the deltas
        # address, its PUB socket refuses a DEALER: once that handshake has failed, a
        # blocking send would wait forever for a peer, so the hello is skipped instead.
        dealer.send(ClientHello(client_id=f"{PROG}-{uuid.uuid4().hex}"), zmq.NOBLOCK)
    except zmq.Again:
        pass
    poller = zmq.Poller()
    poller.register(sub.socket, zmq.POLLIN)
    poller.register(dealer.socket, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    try:
        while rt.stop_reason is None and time.monotonic() < deadline:
            ready = dict(poller.poll(POLL_MS))
            if sub.socket in ready:
                try:
                    msg = sub.recv()
                except ProtocolError:
                    continue
                if isinstance(msg, WatchHeartbeat):
                    return sub, msg
            if dealer.socket in ready:
                try:
                    msg = dealer.recv()
                except ProtocolError:
                    continue
                if isinstance(msg, EngineDead):
                    raise AttachError(f"the pipeline at {address} is dead: {msg.reason}")
                if not msg.deltas_address:
                    raise AttachError(f"the pipeline at {address} offers no deltas address: "
                                      "give its deltas_pub address instead")
                if msg.deltas_address.startswith("tcp://") and keys is None:
                    raise AttachError(f"the pipeline at {address} is a tcp pipeline, whose "
                                      "deltas are encrypted: give its run directory (the "
                                      "launcher prints it after 'attach a detokenizer:')")
                poller.unregister(sub.socket)
                sub.close()
                sub = open_socket(rt, zmq.SUB, msg.deltas_address, WATCH_MESSAGES, keys)
                poller.register(sub.socket, zmq.POLLIN)
        if rt.stop_reason is not None:
            raise AttachError(f"stopped ({rt.stop_reason}) before attaching")
        raise AttachError(f"no pipeline answered at {address} within {timeout_s:g} s")
    finally:
        dealer.close()


def watch(rt: ProcessRuntime, sub: MessageSocket, printer: StdoutPrinter,
          silence_s: float = SILENCE_TIMEOUT_S) -> str | None:
    """Print until the pipeline says goodbye (its reason is returned) or we are stopped
    (None). Raises PipelineGone when the engine dies or falls silent."""
    last_heard = time.monotonic()
    while rt.stop_reason is None:
        if not sub.poll(POLL_MS):
            if time.monotonic() - last_heard > silence_s:
                raise PipelineGone(f"no word from the pipeline for {silence_s:g} s: it is gone")
            continue
        last_heard = time.monotonic()
        try:
            msg = sub.recv()
        except ProtocolError as exc:
            print(f"{PROG}: skipped a bad frame: {exc}", file=sys.stderr)
            continue
        if isinstance(msg, TokenDeltas):
            printer.on_deltas(msg)
        elif isinstance(msg, WatchRequest):
            printer.on_request(msg)
        elif isinstance(msg, WatchHeartbeat):
            if msg.dead_reason is not None:
                raise PipelineGone(f"engine dead: {msg.dead_reason}")
        elif isinstance(msg, EngineStats):
            continue  # the engine's counters: not this printer's business
        elif msg.engine_dead:
            raise PipelineGone(f"engine dead: {msg.reason}")
        else:
            return msg.reason
    return None


def run_attached(model: str, address: str, skip_special_tokens: bool = True,
                 out: TextIO | None = None, control_address: str | None = None, *,
                 attach_timeout_s: float = ATTACH_TIMEOUT_S,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S,
                 keys: CurveKeys | None = None) -> None:
    """Print the pipeline's output until it stops, SIGTERM/SIGINT or the parent's death.

    With `control_address` (started by the launcher) it reports READY there once attached and
    able to print (every request submitted after that is printed whole), or StartupFailed
    with the reason. Exits with status 1 and a one-line message when attaching fails or the
    engine dies or falls silent.
    """
    from frontend.actors.model_tokenizer import load_tokenizer

    out = out or sys.stdout
    rt = ProcessRuntime(PROG)
    try:
        try:
            # Attach first, so that a wrong address fails before the slow tokenizer load; from
            # the greeting on, the SUB socket queues everything while the tokenizer loads.
            sub, hello = attach(rt, address, attach_timeout_s, keys)
            if hello.dead_reason is not None:
                raise AttachError(f"engine dead: {hello.dead_reason}")
            try:
                tokenizer = load_tokenizer(model)
            except Exception as exc:
                raise AttachError(f"could not load the tokenizer of {model}: {exc}") from exc
        except Exception as exc:
            if control_address is not None:
                rt.report_failure(control_address, exc, security=keys)
            raise SystemExit(f"{PROG}: {exc}") from None
        printer = StdoutPrinter(make_decode_fn(tokenizer), out, skip_special_tokens,
                                context=context_anchor(tokenizer))
        if control_address is not None:
            rt.report_ready(control_address, f"attached to {address}", security=keys)
        print(f"{PROG}: attached to {address}", file=sys.stderr, flush=True)
        try:
            reason = watch(rt, sub, printer, silence_timeout_s)
        except PipelineGone as exc:
            raise SystemExit(f"{PROG}: {exc}") from None
        if reason is not None:
            print(f"{PROG}: {reason}", file=sys.stderr, flush=True)
    finally:
        rt.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m frontend.actors.{PROG}",
                                     description="Print a running pipeline's output.")
    parser.add_argument("address", help="the pipeline's client address, its deltas_pub "
                                        "address, or its run directory")
    parser.add_argument("--model", required=True, help="model directory (for its tokenizer)")
    parser.add_argument("--keep-special-tokens", action="store_true")
    parser.add_argument("--attach-timeout", type=float, default=ATTACH_TIMEOUT_S,
                        help="seconds to wait for the pipeline to answer (default %(default)s)")
    parser.add_argument("--silence-timeout", type=float, default=SILENCE_TIMEOUT_S,
                        help="seconds without a heartbeat after which the pipeline counts as "
                             "gone (default %(default)s)")
    # The launcher's start-up socket, when the launcher runs the printer for --stdout.
    parser.add_argument("--control", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        address, keys = resolve_address(args.address), run_keys(args.address)
    except AttachError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    run_attached(args.model, address, not args.keep_special_tokens,
                 control_address=args.control, attach_timeout_s=args.attach_timeout,
                 silence_timeout_s=args.silence_timeout, keys=keys)


if __name__ == "__main__":
    main()
