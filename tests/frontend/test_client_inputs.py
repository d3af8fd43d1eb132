"""What the clients take as users write it, as LLM.generate and LLM.chat do: parameters as
SamplingParams or a dict of its fields, messages as {"role", "content"} dicts whose content may
be OpenAI-style text parts. Anything else fails at the call with an error that names what is
wrong, nothing reaches the engine, and the client serves the next request."""

from __future__ import annotations

import asyncio

import pytest

from frontend import AsyncClient, Client
from frontend.client.outputs import RequestRejected
from protocol import SamplingParams, SamplingParamsError

PROMPT = "The capital of France is Paris."
AS_DICT = {"max_tokens": 3, "temperature": 0, "stop": ["never"]}


def test_a_dict_of_fields_is_the_same_request_as_its_sampling_params(pipe):
    with Client(pipe.address) as client:
        by_dict = client.generate(PROMPT, params=AS_DICT)
        sent_by_dict = pipe.scheduler.added[-1].params
        by_params = client.generate(PROMPT, params=SamplingParams(**AS_DICT))
        sent_by_params = pipe.scheduler.added[-1].params
        streamed = "".join(d.text for d in client.stream(PROMPT, params=AS_DICT))
    assert sent_by_dict == sent_by_params == SamplingParams(**AS_DICT)
    assert by_dict.text == by_params.text == streamed
    assert len(by_dict.token_ids) == 3


def test_params_may_follow_the_prompt_positionally(pipe):
    """`client.generate(prompt, params)`, as `llm.generate(prompts, params)` is written."""
    with Client(pipe.address) as client:
        out = client.generate(PROMPT, AS_DICT)
        assert pipe.scheduler.added[-1].params == SamplingParams(**AS_DICT)
        assert "".join(d.text for d in client.stream(PROMPT, AS_DICT)) == out.text

    async def main() -> str:
        async with AsyncClient(pipe.address) as client:
            return (await client.generate(PROMPT, AS_DICT)).text

    assert asyncio.run(asyncio.wait_for(main(), 60)) == out.text


def test_token_ids_given_as_the_prompt_are_pointed_to_prompt_token_ids(pipe):
    with Client(pipe.address) as client:
        with pytest.raises(TypeError, match=r"prompt must be a string, got list \(token ids go "
                                            r"in prompt_token_ids=\)"):
            client.generate([1, 2, 3], AS_DICT)
        assert client.generate(prompt_token_ids=[1, 2, 3], params=AS_DICT).token_ids


def test_n_above_one_is_refused_naming_it(pipe):
    """An engine request is one completion; the client is told to send one per choice."""
    with Client(pipe.address) as client:
        with pytest.raises(RequestRejected, match="params.n is 2: an engine request is one"):
            client.generate(PROMPT, {"n": 2, "max_tokens": 2})
        assert len(client.generate(PROMPT, AS_DICT).token_ids) == 3


def test_the_async_client_takes_a_dict_too(pipe):
    async def main() -> tuple[str, str]:
        async with AsyncClient(pipe.address) as client:
            out = await client.generate(PROMPT, params=AS_DICT)
            streamed = "".join([d.text async for d in client.stream(PROMPT, params=AS_DICT)])
            return out.text, streamed

    text, streamed = asyncio.run(asyncio.wait_for(main(), 60))
    assert text == streamed and pipe.scheduler.added[-1].params == SamplingParams(**AS_DICT)


def test_stop_none_means_no_stop_strings(pipe):
    """vLLM's `stop=None` (and OpenAI's `"stop": null`) through both clients."""
    none = {"max_tokens": 3, "temperature": 0, "stop": None, "stop_token_ids": None}
    with Client(pipe.address) as client:
        assert len(client.generate(PROMPT, params=none).token_ids) == 3
        assert pipe.scheduler.added[-1].params.stop == []
        assert len(client.generate(PROMPT, SamplingParams(**none)).token_ids) == 3

    async def main() -> int:
        async with AsyncClient(pipe.address) as client:
            return len((await client.generate(PROMPT, params=none)).token_ids)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 3
    sent = pipe.scheduler.added[-1].params
    assert (sent.stop, sent.stop_token_ids) == ([], [])


@pytest.mark.parametrize("params, error, match", [
    ({"max_token": 3}, TypeError, r"params: .*'max_token'"),
    ("greedy", TypeError, "params must be a SamplingParams .* got str"),
    ([("max_tokens", 3)], TypeError, "params must be a SamplingParams .* got list"),
    ({"max_tokens": -3}, SamplingParamsError, "max_tokens must be in"),
])
def test_bad_params_fail_at_the_call_and_the_client_goes_on(pipe, params, error, match):
    with Client(pipe.address) as client:
        sent = len(pipe.scheduler.added)
        with pytest.raises(error, match=match):
            client.generate(PROMPT, params=params)
        with pytest.raises(error, match=match):
            client.stream(PROMPT, params=params)
        assert len(pipe.scheduler.added) == sent  # nothing reached the engine
        assert client.generate(PROMPT, params={"max_tokens": 2}).finish_reason == "length"


def test_text_parts_are_the_same_request_as_their_joined_text(pipe):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    with Client(pipe.address) as client:
        client.generate(messages=[{"role": "user", "content": parts}], params=AS_DICT)
        by_parts = pipe.scheduler.added[-1].prompt_token_ids
        client.generate(messages=[{"role": "user", "content": "Hello\nthere"}], params=AS_DICT)
        by_text = pipe.scheduler.added[-1].prompt_token_ids
    assert list(by_parts) == list(by_text)


@pytest.mark.parametrize("messages, match", [
    ("hello", r"messages must be a list of \{"),
    ({"role": "user", "content": "hi"}, r"messages must be a list of .* got dict"),
    (["hi"], r"messages\[0\] must be a \{.* got str"),
    ([{"role": "user"}], r"messages\[0\]\.content must be a string"),
    ([{"content": "hi"}], r"messages\[0\]\.role must be a string, got None"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]"),
])
def test_misshapen_messages_fail_at_the_call_and_the_client_goes_on(pipe, messages, match):
    with Client(pipe.address) as client:
        sent = len(pipe.scheduler.added)
        with pytest.raises(TypeError, match=match):
            client.generate(messages=messages)
        assert len(pipe.scheduler.added) == sent
        assert client.generate(PROMPT, params={"max_tokens": 2}).finish_reason == "length"


def test_each_connection_is_a_client_of_its_own_and_may_name_clients_within(pipe):
    """The key the scheduler shares the engine by: the connection's number, with the name a
    request gives (a server relaying many users names each); a bad name fails at the call."""
    keys = []
    with Client(pipe.address) as one, Client(pipe.address) as two:
        for client, name in ((one, None), (one, None), (two, None), (two, "alice")):
            client.generate(PROMPT, params={"max_tokens": 1}, client_key=name)
            keys.append(pipe.scheduler.added[-1].client_key)
        with pytest.raises(ValueError, match="client_key has 65 characters"):
            one.generate(PROMPT, client_key="k" * 65)
        with pytest.raises(TypeError, match="client_key must be a string"):
            one.generate(PROMPT, client_key=7)
        assert one.generate(PROMPT, params={"max_tokens": 1}).finish_reason == "length"
    assert keys[0] == keys[1] != keys[2] and keys[3] == f"{keys[2]}/alice"
