"""Watch a running pipeline: print every request's text as it is generated.

    python -m frontend.stdout_detokenizer --model DIR ADDRESS

ADDRESS is the pipeline's `deltas_pub` address (or its run directory, for ipc pipelines).
It subscribes to the scheduler's best-effort copy of each step's TokenDeltas, so it never
slows the main path; a request that began before it attached is decoded from where it
joined. Text is written as it arrives; a `[request id]` tag starts a new line whenever the
output switches to another request, and each request ends with a `<finish: ...>` line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import zmq

from frontend.incremental_detok import (
    DecodeFn,
    IncrementalDetokenizer,
    context_anchor,
    make_decode_fn,
)
from protocol import ProtocolError, TokenDeltas
from protocol.process_runtime import POLL_MS, ProcessRuntime


def resolve_address(address: str) -> str:
    if "://" in address:
        return address
    if os.path.isdir(address):
        return f"ipc://{os.path.abspath(address)}/deltas_pub"
    raise SystemExit(f"{address!r} is neither a zmq address nor a run directory")


class StdoutPrinter:
    def __init__(self, decode: DecodeFn, out: TextIO, skip_special_tokens: bool = True,
                 context: Sequence[int] = ()) -> None:
        self.decode = decode
        self.context = list(context)
        """Decoded ahead of every request's tokens (it never sees the prompt): context_anchor."""
        self.out = out
        self.skip = skip_special_tokens
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.current: int | None = None  # whose text the last line holds
        self.line_open = False

    def on_deltas(self, msg: TokenDeltas) -> None:
        for i, request_id in enumerate(msg.request_ids):
            detok = self.detoks.get(request_id)
            if detok is None:
                detok = self.detoks[request_id] = IncrementalDetokenizer(
                    self.decode, self.context, skip_special_tokens=self.skip)
            finish, error = msg.finish_reasons[i], msg.errors[i]
            text = detok.add(msg.token_ids[i])
            if finish is not None or error is not None:
                text += detok.flush()
            if text:
                self._write(request_id, text)
            if finish is not None or error is not None:
                del self.detoks[request_id]
                self._end_line()
                note = f"error: {error}" if error is not None else f"finish: {finish}"
                self.out.write(f"[{request_id}] <{note}>\n")
                self.current = None
        self.out.flush()

    def _write(self, request_id: int, text: str) -> None:
        if request_id != self.current:
            self._end_line()
            self.out.write(f"[{request_id}] ")
            self.current = request_id
        self.out.write(text)
        self.line_open = not text.endswith("\n")

    def _end_line(self) -> None:
        if self.line_open:
            self.out.write("\n")
            self.line_open = False


def run_attached(model: str, address: str, skip_special_tokens: bool = True,
                 out: TextIO | None = None) -> None:
    """Print the pipeline's output until SIGTERM/SIGINT or the parent's death."""
    from frontend.tokenizer_proc import load_tokenizer

    out = out or sys.stdout
    rt = ProcessRuntime("stdout_detokenizer")
    try:
        tokenizer = load_tokenizer(model)
        printer = StdoutPrinter(make_decode_fn(tokenizer), out, skip_special_tokens,
                                context=context_anchor(tokenizer))
        sub = rt.socket(zmq.SUB, address, bind=False, accepts=(TokenDeltas,))
        while rt.stop_reason is None:
            if not sub.poll(POLL_MS):
                continue
            try:
                printer.on_deltas(sub.recv())
            except ProtocolError as exc:
                print(f"skipped a bad frame: {exc}", file=sys.stderr)
    finally:
        rt.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print a running pipeline's output.")
    parser.add_argument("address", help="deltas_pub address, or the pipeline's run directory")
    parser.add_argument("--model", required=True, help="model directory (for its tokenizer)")
    parser.add_argument("--keep-special-tokens", action="store_true")
    args = parser.parse_args(argv)
    run_attached(args.model, resolve_address(args.address), not args.keep_special_tokens)


if __name__ == "__main__":
    main()
