"""Each kind of bad request gets its own message naming the field."""

from __future__ import annotations

import msgpack
import pytest
from transformers import AutoTokenizer

from frontend.actors.model_tokenizer import eos_token_ids, model_vocab_size
from frontend.actors.request_validation import InvalidRequest, RequestValidator, salvage_request_id
from protocol import ChatMessage, Decoder, GenerateRequest, ProtocolError, SamplingParams, encode
from protocol.client_messages import RequestFieldError


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def validator(tokenizer, tiny_qwen3_dir):
    return RequestValidator(tokenizer, model_vocab_size(tiny_qwen3_dir, tokenizer))


def request(prompt=None, ids=None, messages=None, request_id="r1", **params):
    return GenerateRequest(client_request_id=request_id, prompt=prompt, prompt_token_ids=ids,
                           messages=messages, params=SamplingParams(**params), stream=False)


def rejection(validator, req) -> str:
    """The message; it starts with (or names) the field the error's `field` holds."""
    with pytest.raises(InvalidRequest) as info:
        validator.prompt_token_ids(req)
    field = info.value.field
    assert field is not None and field.split(".")[-1] in str(info.value)
    return str(info.value)


def test_vocab_and_eos_come_from_the_model(tokenizer, tiny_qwen3_dir):
    assert model_vocab_size(tiny_qwen3_dir, tokenizer) == 688
    assert eos_token_ids(tiny_qwen3_dir, tokenizer) == [tokenizer.convert_tokens_to_ids(
        "<|im_end|>")]


def test_prompt_is_tokenized(validator, tokenizer):
    assert validator.prompt_token_ids(request("The capital")) == tokenizer.encode("The capital")


def test_prompt_token_ids_pass_through(validator):
    assert validator.prompt_token_ids(request(ids=[5, 6, 7])) == [5, 6, 7]


def test_chat_messages_use_the_template(validator, tokenizer):
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = validator.prompt_token_ids(request(messages=msgs))
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("kwargs, got", [
    (dict(), "none"),
    (dict(prompt="a", ids=[1]), "prompt, prompt_token_ids"),
    (dict(prompt="a", messages=[ChatMessage("user", "x")]), "prompt, messages"),
])
def test_exactly_one_input(validator, kwargs, got):
    message = rejection(validator, request(**kwargs))
    assert "exactly one of prompt, prompt_token_ids and messages" in message
    assert f"(got {got})" in message


def test_empty_inputs(validator):
    assert rejection(validator, request("")) == "prompt must not be empty"
    assert rejection(validator, request(ids=[])) == "prompt_token_ids must not be empty"
    assert rejection(validator, request(messages=[])) == "messages must not be empty"


@pytest.mark.parametrize("bad, index", [([1, 688], 1), ([-1], 0), ([3, 4, 2**31 - 1], 2)])
def test_token_ids_outside_the_vocabulary(validator, bad, index):
    message = rejection(validator, request(ids=bad))
    assert message == (f"prompt_token_ids[{index}] = {bad[index]} is outside the "
                       f"vocabulary [0, 688)")


@pytest.mark.parametrize("bad, match", [
    ([3, 4, 10**12], r"prompt_token_ids\[2\] = 1000000000000 is not a token id"),
    ([2**64], r"prompt_token_ids\[0\] = 18446744073709551616 is not a token id"),
    ([1.7, 2.2], r"prompt_token_ids\[0\] must be an integer token id, got 1.7"),
    ([1, False], r"prompt_token_ids\[1\] must be an integer token id, got False"),
])
def test_ids_no_worker_column_holds_are_refused_where_the_request_is_made(bad, match):
    """Before any frame exists: a float is not truncated, 2**64 is not msgpack's bare error."""
    with pytest.raises(RequestFieldError, match=match):
        request(ids=bad)
    fields = msgpack.unpackb(encode(request(ids=[1])))
    fields[3] = [2**63]  # the same sent raw: the tokenizer's decoder refuses it by name
    with pytest.raises(ProtocolError, match=r"prompt_token_ids\[0\]"):
        Decoder(GenerateRequest).decode(msgpack.packb(fields))


def test_stop_token_ids_outside_the_vocabulary(validator):
    message = rejection(validator, request("hi", stop_token_ids=[2, 5000]))
    assert message.startswith("params.stop_token_ids[1] = 5000")


def test_bad_chat_role(validator):
    message = rejection(validator, request(messages=[ChatMessage("user", "a"),
                                                     ChatMessage("robot", "b")]))
    assert message.startswith("messages[1].role must be one of")
    assert "'robot'" in message


def test_model_without_chat_template(tokenizer, tiny_qwen3_dir):
    plain = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    plain.chat_template = None
    v = RequestValidator(plain, 688)
    assert "no chat template" in rejection(v, request(messages=[ChatMessage("user", "x")]))


@pytest.mark.parametrize("request_id, expected", [("", "must not be empty"),
                                                  ("x" * 300, "at most 256")])
def test_client_request_id(validator, request_id, expected):
    message = rejection(validator, request("hi", request_id=request_id))
    assert message.startswith("client_request_id") and expected in message


def test_salvage_request_id_of_an_undecodable_request():
    good = msgpack.unpackb(encode(request("hi", request_id="abc")))
    good[5][0] = -3.0  # temperature: refused by SamplingParams when decoded
    assert salvage_request_id(msgpack.packb(good)) == "abc"
    assert salvage_request_id(b"\xc1garbage") is None
    assert salvage_request_id(msgpack.packb([0x02, "abc"])) is None  # not a GenerateRequest
    assert salvage_request_id(msgpack.packb([0x01, 7])) is None
