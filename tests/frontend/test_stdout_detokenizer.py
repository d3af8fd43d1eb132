"""The attachable stdout detokenizer: output format, and the CLI on a live PUB socket."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq
from transformers import AutoTokenizer

from frontend.incremental_detok import make_decode_fn
from frontend.stdout_detokenizer import StdoutPrinter, resolve_address
from protocol import Endpoints, TokenDeltas
from protocol.sockets import MessageSocket

ROOT = Path(__file__).resolve().parents[2]


def deltas(step: int, items: dict[int, tuple[list[int], str | None]]) -> TokenDeltas:
    ids = list(items)
    return TokenDeltas(step_id=step, request_ids=ids, token_ids=[items[i][0] for i in ids],
                       finish_reasons=[items[i][1] for i in ids], errors=[None] * len(ids),
                       logprobs=None)


def test_printer_tags_each_request(tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    a, b = tok.encode("Hello 😀 there"), tok.encode("Rome")
    out = io.StringIO()
    printer = StdoutPrinter(make_decode_fn(tok), out)
    for i, t in enumerate(a[:-1]):
        printer.on_deltas(deltas(i, {7: ([t], None)}))
    printer.on_deltas(deltas(10, {7: ([a[-1]], "length"), 9: (b, None)}))
    printer.on_deltas(deltas(11, {9: ([tok.convert_tokens_to_ids("<|im_end|>")], "stop")}))
    assert out.getvalue() == ("[7] Hello 😀 there\n[7] <finish: length>\n"
                              "[9] Rome\n[9] <finish: stop>\n")


def test_resolve_address(tmp_path):
    assert resolve_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert resolve_address(str(tmp_path)) == f"ipc://{tmp_path}/deltas_pub"


def test_cli_prints_published_deltas(tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    endpoints = Endpoints.ipc(1)
    ctx = zmq.Context()
    pub = MessageSocket(ctx, zmq.PUB, endpoints.deltas_pub, bind=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend.stdout_detokenizer", "--model", tiny_qwen3_dir,
         endpoints.run_dir],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        ids = tok.encode("The capital of Italy is Rome.")
        deadline = time.monotonic() + 30
        step = 0
        # PUB drops messages until the subscriber has joined: publish until one shows up.
        while not any("<finish" in line for line in lines) and time.monotonic() < deadline:
            step += 1
            pub.send(deltas(step, {step: (ids, "length")}))
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        reader.join(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
        ctx.term()
        endpoints.cleanup()
    assert proc.returncode == 0, proc.stderr.read()
    printed = "".join(lines)
    assert "] The capital of Italy is Rome.\n" in printed
    assert "<finish: length>" in printed
