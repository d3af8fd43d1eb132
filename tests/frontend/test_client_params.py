"""Both clients take a request's parameters as SamplingParams or as a dict of its fields, as
LLM.generate does; anything else fails at the call with a TypeError or a SamplingParamsError
that names what is wrong, and the client serves the next request."""

from __future__ import annotations

import asyncio

import pytest

from frontend import AsyncClient, Client
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


def test_the_async_client_takes_a_dict_too(pipe):
    async def main() -> tuple[str, str]:
        async with AsyncClient(pipe.address) as client:
            out = await client.generate(PROMPT, params=AS_DICT)
            streamed = "".join([d.text async for d in client.stream(PROMPT, params=AS_DICT)])
            return out.text, streamed

    text, streamed = asyncio.run(asyncio.wait_for(main(), 60))
    assert text == streamed and pipe.scheduler.added[-1].params == SamplingParams(**AS_DICT)


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
