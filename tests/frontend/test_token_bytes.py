"""Logprobs name tokens by their text and bytes: a token's bytes come from its vocabulary
spelling, so a character split over tokens is split in their bytes, not lost."""

from __future__ import annotations

from transformers import AutoTokenizer

from frontend.actors.token_bytes import TokenBytes
from frontend.client.outputs import token_text
from frontend.openai_server.responses import CompletionFormat

TEXT = "héllo 😀 world, naïve café"


def test_the_tokens_bytes_joined_are_the_texts_bytes(tiny_qwen3_dir):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    spell = TokenBytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = spell.many(ids)
    assert b"".join(pieces) == TEXT.encode()
    names = [token_text(p) for p in pieces]
    assert any(n.startswith("bytes:\\x") for n in names)  # the emoji is split over tokens
    assert [n for n in names if not n.startswith("bytes:")] == [
        p.decode() for p in pieces if _whole(p)]
    assert spell(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_text_offsets_count_characters_across_chunks():
    class Out:
        def __init__(self, pieces):
            self.token_bytes, self.token_ids = pieces, list(range(len(pieces)))
            self.logprobs, self.top_logprobs, self.top_token_bytes = [0.0] * len(pieces), \
                None, None
            self.text, self.finish_reason = "", None

    fmt = CompletionFormat("m")
    emoji = "😀".encode()
    first = fmt._choice(0, Out([b"a", b" \xc3\xa9", emoji[:2]]))["logprobs"]
    second = fmt._choice(0, Out([emoji[2:], b"!"]))["logprobs"]
    assert first["tokens"] == ["a", " é", "bytes:\\xf0\\x9f"]
    assert first["text_offset"] == [0, 1, 3] and second["text_offset"] == [3, 4]
    assert fmt._choice(1, Out([b"x"]))["logprobs"]["text_offset"] == [0]  # its own count


def _whole(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True
