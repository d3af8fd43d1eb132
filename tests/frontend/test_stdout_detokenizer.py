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

from frontend.incremental_detok import context_anchor, make_decode_fn
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


def test_printer_keeps_the_first_words_space_with_sentencepiece(sp_tokenizer_dir):
    """The printer never sees the prompt; the first generated word still keeps its space."""
    tok = AutoTokenizer.from_pretrained(sp_tokenizer_dir)
    prompt = tok.encode("Hello there", add_special_tokens=False)
    full = tok.encode("Hello there import the model", add_special_tokens=False)
    gen = full[len(prompt):]
    assert tok.convert_ids_to_tokens(gen[:1])[0].startswith("▁")
    out = io.StringIO()
    printer = StdoutPrinter(make_decode_fn(tok), out, context=context_anchor(tok))
    for i, t in enumerate(gen):
        printer.on_deltas(deltas(i, {3: ([t], "length" if i == len(gen) - 1 else None)}))
    assert out.getvalue() == "[3]  import the model\n[3] <finish: length>\n"
