"""Watch a running pipeline: print every request's text as it is generated.

    python -m frontend.stdout_detokenizer ADDRESS --model DIR

ADDRESS is the pipeline's `deltas_pub` address (or its run directory, for ipc pipelines).
It subscribes to the scheduler's best-effort copy of each step's TokenDeltas, so it never
slows the main path; a request that began before it attached is decoded from where it
joined. Text is printed line by line, each line tagged with its request id.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import zmq

from frontend.incremental_detok import IncrementalDetokenizer, make_decode_fn
from frontend.proc_util import POLL_MS, ProcessRuntime
from protocol import ProtocolError, TokenDeltas

FLUSH_CHARS = 80
"""Print a request's pending text once it is this long even without a newline."""


def resolve_address(address: str) -> str:
    if "://" in address:
        return address
    if os.path.isdir(address):
        return f"ipc://{os.path.abspath(address)}/deltas_pub"
    raise SystemExit(f"{address!r} is neither a zmq address nor a run directory")


class StdoutPrinter:
    def __init__(self, decode, out: TextIO, skip_special_tokens: bool = True) -> None:
        self.decode = decode
        self.out = out
        self.skip = skip_special_tokens
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.pending: dict[int, str] = {}

    def on_deltas(self, msg: TokenDeltas) -> None:
        for i, request_id in enumerate(msg.request_ids):
            detok = self.detoks.get(request_id)
            if detok is None:
                detok = self.detoks[request_id] = IncrementalDetokenizer(
                    self.decode, skip_special_tokens=self.skip)
            text = self.pending.get(request_id, "") + detok.add(msg.token_ids[i])
            finish, error = msg.finish_reasons[i], msg.errors[i]
            if finish is not None or error is not None:
                text += detok.flush()
            *lines, rest = text.split("\n")
            for line in lines:
                self._print(request_id, line)
            if rest and (finish is not None or error is not None or len(rest) >= FLUSH_CHARS):
                self._print(request_id, rest)
                rest = ""
            self.pending[request_id] = rest
            if finish is not None or error is not None:
                note = f"error: {error}" if error is not None else f"finish: {finish}"
                self._print(request_id, f"<{note}>")
                del self.detoks[request_id]
                del self.pending[request_id]
        self.out.flush()

    def _print(self, request_id: int, line: str) -> None:
        self.out.write(f"[{request_id}] {line}\n")


def run(address: str, model: str, skip_special_tokens: bool = True,
        out: TextIO = sys.stdout) -> None:
    from frontend.tokenizer_proc import load_tokenizer

    rt = ProcessRuntime("stdout_detokenizer")
    try:
        printer = StdoutPrinter(make_decode_fn(load_tokenizer(model)), out, skip_special_tokens)
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
    run(resolve_address(args.address), args.model, not args.keep_special_tokens)


if __name__ == "__main__":
    main()
