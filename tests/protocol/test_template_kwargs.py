"""chat_template_kwargs: plain variables pass to the chat template; the template call's own
parameters, special tokens and non-scalar values are refused by name, wherever a request is
made (the client library) or decoded (the wire struct)."""

from __future__ import annotations

import pytest

from frontend.client.frames import make_request
from protocol import GenerateRequest, SamplingParams
from protocol.client_messages import ChatMessage, RequestFieldError
from protocol.template_kwargs import TemplateKwargsError, checked, from_text, to_text

HI = [ChatMessage("user", "hi")]


def test_plain_variables_pass_and_travel_as_json():
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "n": 2, "x": None}
    assert checked(kwargs) == kwargs
    assert from_text(to_text(kwargs)) == kwargs
    assert to_text(None) == "" and from_text("") == {}


@pytest.mark.parametrize("bad, says", [
    ({"chat_template": "{{ 7 * 7 }}"}, "chat_template_kwargs.chat_template is not"),
    ({"tokenize": True}, "chat_template_kwargs.tokenize is not"),
    ({"messages": []}, "chat_template_kwargs.messages is not"),
    ({"eos_token": "x"}, "chat_template_kwargs.eos_token is not"),
    ({"a b": 1}, "is not a variable name"),
    ({"x": [1]}, "chat_template_kwargs.x must be a string"),
    ({"x": "y" * 2000}, "over 1024 characters"),
    ({f"v{i}": 1 for i in range(17)}, "at most 16"),
    ([1], "must be an object"),
])
def test_what_cannot_pass_is_named(bad, says):
    with pytest.raises(TemplateKwargsError, match=says):
        checked(bad)


def test_the_wire_and_the_client_refuse_them_by_field():
    with pytest.raises(RequestFieldError, match="needs messages") as info:
        GenerateRequest("r", "a prompt", None, None, SamplingParams(), False,
                        chat_template_kwargs='{"enable_thinking":false}')
    assert info.value.field == "chat_template_kwargs"
    with pytest.raises(RequestFieldError, match="is not JSON"):
        GenerateRequest("r", None, None, HI, SamplingParams(), False, chat_template_kwargs="{")
    with pytest.raises(RequestFieldError, match="tokenize is not") as info:
        make_request("r", None, None, [{"role": "user", "content": "hi"}], None, False,
                     chat_template_kwargs={"tokenize": True})
    assert info.value.field == "chat_template_kwargs"
    assert make_request("r", None, None, [{"role": "user", "content": "hi"}], None, False,
                        chat_template_kwargs={"enable_thinking": False})
