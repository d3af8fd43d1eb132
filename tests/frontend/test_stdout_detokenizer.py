"""The attachable stdout detokenizer's output format (the CLI against live pipelines is in
tests/pipeline/test_stdout_detokenizer_cli.py)."""

from __future__ import annotations

import io

import pytest
from transformers import AutoTokenizer

from frontend.actors.incremental_detok import context_anchor, make_decode_fn
from frontend.actors.stdout_detokenizer import AttachError, StdoutPrinter, resolve_address
from protocol import FinishReason, TokenDeltas
from protocol.engine_messages import WatchRequest


def deltas(step: int, items: dict[int, tuple[list[int], FinishReason | None]]) -> TokenDeltas:
    ids = list(items)
    return TokenDeltas(step_id=step, request_ids=ids, token_ids=[items[i][0] for i in ids],
                       finish_reasons=[items[i][1] for i in ids], errors=[None] * len(ids),
                       logprobs=None)


def test_printer_tags_each_request_with_its_client_id(tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    a, b = tok.encode("Hello 😀 there"), tok.encode("Rome")
    out = io.StringIO()
    printer = StdoutPrinter(make_decode_fn(tok), out)
    printer.on_request(WatchRequest(7, "chat-a"))
    for i, t in enumerate(a[:-1]):
        printer.on_deltas(deltas(i, {7: ([t], None)}))
    printer.on_deltas(deltas(10, {7: ([a[-1]], FinishReason.LENGTH), 9: (b, None)}))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    printer.on_deltas(deltas(11, {9: ([im_end], FinishReason.STOP)}))
    # Request 9 was never announced (it began before the printer attached).
    assert out.getvalue() == ("[chat-a] Hello 😀 there\n[chat-a] <finish: length>\n"
                              "[#9] Rome\n[#9] <finish: stop>\n")
    assert printer.names == {} and printer.detoks == {}


def test_printer_cuts_the_text_where_the_client_gets_it_cut(tiny_qwen3_dir):
    """Tokens past a stop string reach the watchers (the engine learns of the match a step
    later); the printer cuts them as the client's detokenizer does."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    out = io.StringIO()
    printer = StdoutPrinter(make_decode_fn(tok), out)
    printer.on_request(WatchRequest(3, "cut", ["answer"]))
    printer.on_request(WatchRequest(4, "kept", ["answer"], include_stop=True))
    ids = tok.encode(" Paris. The answer is")
    printer.on_deltas(deltas(0, {3: (ids, FinishReason.STOP)}))
    printer.on_deltas(deltas(1, {4: (ids, FinishReason.STOP)}))
    assert out.getvalue() == ("[cut]  Paris. The \n[cut] <finish: stop>\n"
                              "[kept]  Paris. The answer\n[kept] <finish: stop>\n")
    assert printer.stops == {}


def test_resolve_address(tmp_path):
    assert resolve_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert resolve_address(str(tmp_path)) == f"ipc://{tmp_path}/deltas_pub"
    with pytest.raises(AttachError, match="neither a zmq address nor a run directory"):
        resolve_address(str(tmp_path / "missing"))


def test_printer_keeps_the_first_words_space_with_sentencepiece(sp_tokenizer_dir):
    """The printer never sees the prompt; the first generated word still keeps its space."""
    tok = AutoTokenizer.from_pretrained(sp_tokenizer_dir)
    prompt = tok.encode("Hello there", add_special_tokens=False)
    full = tok.encode("Hello there import the model", add_special_tokens=False)
    gen = full[len(prompt):]
    assert tok.convert_ids_to_tokens(gen[:1])[0].startswith("▁")
    out = io.StringIO()
    printer = StdoutPrinter(make_decode_fn(tok), out, context=context_anchor(tok))
    printer.on_request(WatchRequest(3, "r3"))
    for i, t in enumerate(gen):
        printer.on_deltas(deltas(i, {3: ([t], FinishReason.LENGTH if i == len(gen) - 1 else None)}))
    assert out.getvalue() == "[r3]  import the model\n[r3] <finish: length>\n"
