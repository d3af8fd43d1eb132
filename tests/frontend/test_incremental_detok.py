"""Incremental detokenization: UTF-8 safety, spacing, special tokens, stop strings."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from frontend.actors.incremental_detok import IncrementalDetokenizer, make_decode_fn

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld, çà et là",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 end",
    "日本語のテキスト、中文字符",
    "  leading spaces\nand\ttabs  ",
    "mixed: add(a, b) → ∑ ≠ ∞ 🚀",
]


def chars(ids, skip):
    """A decode where token id = code point: makes the stop-string logic easy to read."""
    return "".join(chr(i) for i in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def feed(detok: IncrementalDetokenizer, ids, chunk: int = 1) -> list[str]:
    out = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    out.append(detok.flush())
    return out


@pytest.fixture(scope="module")
def bpe(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def sp(sp_tokenizer_dir):
    return AutoTokenizer.from_pretrained(sp_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_level_deltas_rebuild_the_text_and_never_break_a_character(bpe, text, chunk):
    prompt = bpe.encode("Say:", add_special_tokens=False)
    gen = bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(make_decode_fn(bpe), prompt[-6:])
    deltas = feed(detok, gen, chunk)
    assert "".join(deltas) == text == bpe.decode(gen)
    assert not any("\ufffd" in d for d in deltas)


def test_split_multibyte_character_is_held_until_complete(bpe):
    gen = bpe.encode("a😀", add_special_tokens=False)
    assert len(gen) >= 3  # "a" plus an emoji cut into byte tokens
    detok = IncrementalDetokenizer(make_decode_fn(bpe))
    deltas = [detok.add([t]) for t in gen]
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(gen) - 2)
    assert deltas[-1] == "😀"


def test_incomplete_character_is_released_at_the_end(bpe):
    gen = bpe.encode("ok😀", add_special_tokens=False)[:-1]  # the emoji never completes
    detok = IncrementalDetokenizer(make_decode_fn(bpe))
    deltas = feed(detok, gen)
    assert "".join(deltas[:-1]) == "ok"
    assert deltas[-1] and set(deltas[-1]) == {"\ufffd"}
    assert "".join(deltas) == bpe.decode(gen)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_spacing_follows_the_prompt(sp, text):
    prompt = sp.encode("Hello there", add_special_tokens=False)
    full = sp.encode("Hello there " + text, add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    gen = full[len(prompt):]
    detok = IncrementalDetokenizer(make_decode_fn(sp), prompt[-6:])
    deltas = feed(detok, gen)
    assert sp.decode(prompt) + "".join(deltas) == sp.decode(full)
    assert "".join(deltas).startswith(" ")  # the first word keeps its space
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_byte_fallback_emoji(sp):
    gen = sp.encode("I 🚀 go", add_special_tokens=False)
    pieces = sp.convert_ids_to_tokens(gen)
    assert sum(p.startswith("<0x") for p in pieces) == 4  # one token per byte of the emoji
    deltas = feed(IncrementalDetokenizer(make_decode_fn(sp)), gen)
    assert "".join(deltas) == "I 🚀 go" == sp.decode(gen)
    assert "🚀" in deltas


def test_special_tokens_are_skipped_or_kept(bpe):
    gen = bpe.encode("one<|im_end|>two", add_special_tokens=False)
    assert bpe.convert_tokens_to_ids("<|im_end|>") in gen
    skip = IncrementalDetokenizer(make_decode_fn(bpe), skip_special_tokens=True)
    keep = IncrementalDetokenizer(make_decode_fn(bpe), skip_special_tokens=False)
    assert "".join(feed(skip, gen)) == "onetwo"
    assert "".join(feed(keep, gen)) == "one<|im_end|>two"


def test_special_tokens_in_the_prompt_tail_do_not_leak(bpe):
    tail = bpe.encode("<|im_start|>assistant\n", add_special_tokens=False)
    gen = bpe.encode("Sure", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(make_decode_fn(bpe), tail, skip_special_tokens=skip)
        assert "".join(feed(detok, gen)) == "Sure"


def test_stop_string_inside_one_delta():
    detok = IncrementalDetokenizer(chars, stop=["STOP"])
    assert detok.add(ids_of("abc STOP def")) == "abc "
    assert detok.stop_matched == "STOP" and detok.finished
    assert detok.text == "abc "
    assert detok.add(ids_of("more")) == "" and detok.flush() == ""


def test_stop_string_across_deltas_is_held_back_and_never_emitted():
    detok = IncrementalDetokenizer(chars, stop=["capital"])
    assert detok.add(ids_of("The cap")) == "The "  # "cap" could start the stop string
    assert detok.add(ids_of("it")) == ""
    assert detok.add(ids_of("al of")) == ""
    assert detok.finished and detok.text == "The "


def test_include_stop_keeps_the_stop_string_and_nothing_after_it():
    detok = IncrementalDetokenizer(chars, stop=["capital"], include_stop=True)
    assert detok.add(ids_of("The cap")) == "The "
    assert detok.add(ids_of("ital of")) == "capital"
    assert detok.finished and detok.text == "The capital"
    assert detok.add(ids_of("more")) == "" and detok.flush() == ""


def test_held_back_prefix_is_released_when_it_cannot_match():
    detok = IncrementalDetokenizer(chars, stop=["capital"])
    assert detok.add(ids_of("The cap")) == "The "
    assert detok.add(ids_of("tain")) == "captain"
    assert detok.add(ids_of(" c")) == " "
    assert detok.flush() == "c"  # the end of the request releases the held tail
    assert not detok.finished


def test_earliest_stop_string_wins():
    detok = IncrementalDetokenizer(chars, stop=["world", "d", "o w"])
    assert detok.add(ids_of("hell")) == "hell"
    assert detok.add(ids_of("o world")) == ""
    assert detok.stop_matched == "o w" and detok.text == "hell"


def test_tail_that_may_start_a_stop_string_is_held():
    detok = IncrementalDetokenizer(chars, stop=["lo w"])
    assert detok.add(ids_of("hell")) == "hel"  # "l" may start "lo w"
    assert detok.add(ids_of("o")) == ""
    assert detok.add(ids_of("!")) == "lo!"


def test_overlapping_stop_strings_across_many_small_deltas():
    text = "a" * 5 + "aab" + "tail"
    detok = IncrementalDetokenizer(chars, stop=["aab", "zz"])
    out = feed(detok, ids_of(text))
    assert "".join(out) == "aaaaa"
    assert detok.stop_matched == "aab"


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_with_real_tokens(bpe, chunk):
    gen = bpe.encode("The capital of France is Paris. The capital", add_special_tokens=False)
    detok = IncrementalDetokenizer(make_decode_fn(bpe), stop=["Paris", "Rome"])
    deltas = feed(detok, gen, chunk)
    assert "".join(deltas) == "The capital of France is "
    assert not any("Par" in d for d in deltas)


def test_stop_string_after_multibyte_text(bpe):
    gen = bpe.encode("🚀 liftoff! then", add_special_tokens=False)
    detok = IncrementalDetokenizer(make_decode_fn(bpe), stop=["!"])
    assert "".join(feed(detok, gen)) == "🚀 liftoff"


def test_long_output_trims_its_window_and_stays_exact(bpe):
    text = "The quick brown fox jumps over the lazy dog 😀. " * 40
    gen = bpe.encode(text, add_special_tokens=False)
    deltas = feed(IncrementalDetokenizer(make_decode_fn(bpe)), gen)
    assert "".join(deltas) == text
