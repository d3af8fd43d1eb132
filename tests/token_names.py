"""How OpenAI names a generated token, worked out from the model's own tokenizer: the test's
reference for the logprobs' `token` fields."""

from __future__ import annotations

import functools

REPLACEMENT = "\ufffd"


@functools.cache
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def expected_names(model_dir: str, token_ids: list[int]) -> list[str | None]:
    """Each token decoded alone; None where that is no whole character (named "bytes:...")."""
    tok = _tokenizer(model_dir)
    names = [tok.decode([t], skip_special_tokens=False) for t in token_ids]
    return [None if REPLACEMENT in n else n for n in names]


def assert_names(got: list[str], model_dir: str, token_ids: list[int]) -> None:
    expected = expected_names(model_dir, token_ids)
    assert len(got) == len(expected), (got, token_ids)
    for name, want, tid in zip(got, expected, token_ids, strict=True):
        if want is None:
            assert name.startswith("bytes:\\x") or name == REPLACEMENT, (name, tid)
        else:
            assert name == want, (name, want, tid)


def bytes_of(name: str) -> bytes:
    """The bytes a token name stands for ("bytes:\\xe2\\x80" or plain text)."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode()
