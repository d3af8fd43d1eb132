"""Request bodies -> SamplingParams and client arguments, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from frontend.openai_server.errors import ApiError, validation_error
from frontend.openai_server.schema import ChatCompletionRequest, CompletionRequest
from protocol import ChatMessage, SamplingParams


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **body})


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **body})


def refused(fn, param: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn()
    assert info.value.status == 400
    assert info.value.param == param, info.value.message
    return info.value


def test_completion_defaults_match_openai():
    assert completion().sampling_params() == SamplingParams(max_tokens=16)


def test_completion_fields_map_onto_sampling_params():
    params = completion(max_tokens=7, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=11,
                        stop="\n", stop_token_ids=[2, 3], ignore_eos=True,
                        logprobs=0).sampling_params()
    assert params == SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, seed=11,
                                    max_tokens=7, ignore_eos=True, stop=["\n"],
                                    stop_token_ids=[2, 3], logprobs=True)
    assert completion(stop=["a", "b"], logprobs=True).sampling_params().stop == ["a", "b"]
    assert completion(top_k=0).sampling_params().top_k == -1
    assert completion(logprobs=None).sampling_params().logprobs is False
    assert completion(logprobs=False).sampling_params().logprobs is False


def test_completion_prompt_forms():
    assert completion(prompt="abc").prompt_kwargs() == [{"prompt": "abc"}]
    assert completion(prompt="").prompt_kwargs() == [{"prompt": ""}]  # the engine refuses it
    assert completion(prompt=[1, 2, 3]).prompt_kwargs() == [{"prompt_token_ids": [1, 2, 3]}]
    assert completion(prompt=["abc"]).prompt_kwargs() == [{"prompt": "abc"}]
    assert completion(prompt=[[4, 5]]).prompt_kwargs() == [{"prompt_token_ids": [4, 5]}]
    assert completion(prompt=["a", "b"]).prompt_kwargs() == [{"prompt": "a"}, {"prompt": "b"}]
    assert completion(prompt=[[4], [5, 6]]).prompt_kwargs() == [
        {"prompt_token_ids": [4]}, {"prompt_token_ids": [5, 6]}]
    refused(lambda: completion(prompt=[]).prompt_kwargs(), "prompt")
    assert "prompt[1] must not be empty" in refused(
        lambda: completion(prompt=[[4], []]).prompt_kwargs(), "prompt").message
    assert "more than 1024 choices" in refused(
        lambda: completion(prompt=["a"] * 65, n=16).prompt_kwargs(), "prompt").message


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"best_of": 3}, "best_of"), ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_refusals_name_the_field(body, param):
    refused(lambda: completion(**body).sampling_params(), param)


def test_penalties_reach_the_sampling_params():
    params = completion(presence_penalty=0.5, frequency_penalty=-0.25,
                        repetition_penalty=1.1).sampling_params()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5, -0.25, 1.1)
    assert chat(frequency_penalty=1.0).sampling_params().frequency_penalty == 1.0


def test_top_logprobs_map_onto_sampling_params():
    params = completion(logprobs=3).sampling_params()
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    params = chat(logprobs=True, top_logprobs=4).sampling_params()
    assert (params.logprobs, params.top_logprobs) == (True, 4)
    refused(lambda: chat(logprobs=True, top_logprobs=21).sampling_params(), "top_logprobs")


def test_choices_get_their_own_seeds():
    body = completion(n=3, seed=2**63 - 2, temperature=1.0)
    seeds = [p.seed for p in body.choice_params(body.sampling_params())]
    assert seeds == [2**63 - 2, 2**63 - 1, 0]
    unseeded = completion(n=2)
    assert unseeded.choice_params(unseeded.sampling_params()) == [SamplingParams()] * 2


def test_n_one_is_accepted():
    assert completion(n=1).sampling_params() == SamplingParams()


def test_chat_maps_messages_and_max_completion_tokens():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]})
    assert req.wire_messages() == [ChatMessage("system", "be brief"), ChatMessage("user", "ab"),
                                   ChatMessage("assistant", "")]
    assert req.sampling_params().max_tokens is None  # until the context is full
    assert chat(max_tokens=5).sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=6).sampling_params().max_tokens == 6
    assert chat(logprobs=True).sampling_params().logprobs is True


@pytest.mark.parametrize("body,param", [
    ({"n": -1}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
])
def test_chat_refusals_name_the_field(body, param):
    assert param in refused(lambda: chat(**body).sampling_params(), param).message


def test_engine_messages_name_fields_as_the_body_does():
    from frontend.openai_server.errors import api_error
    from protocol.client_messages import RequestFieldError

    err = api_error(RequestFieldError("params.stop_token_ids", "params.stop_token_ids[0] = 9 "
                                      "is outside the vocabulary [0, 5)"))
    assert (err.message, err.param) == ("stop_token_ids[0] = 9 is outside the vocabulary "
                                        "[0, 5)", "stop_token_ids")
    err = api_error(RequestFieldError("prompt_token_ids", "prompt_token_ids has 9 tokens"))
    assert (err.message, err.param) == ("prompt has 9 tokens", "prompt")


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = validation_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    assert err.status == 400 and err.param == param, err.message
    assert err.message.startswith(param)


def test_include_stop_str_in_output_reaches_the_sampling_params():
    assert completion(stop="x", include_stop_str_in_output=True).sampling_params() == \
        SamplingParams(max_tokens=16, stop=["x"], include_stop_str_in_output=True)


def test_null_booleans_mean_their_defaults():
    """OpenAI's booleans are "boolean or null"; the openai client sends None as null."""
    body = dict(stream=None, ignore_eos=None, skip_special_tokens=None, echo=None)
    req = completion(**body)
    assert (req.stream, req.ignore_eos, req.skip_special_tokens, req.echo) == (
        False, False, True, False)
    assert req.sampling_params() == SamplingParams(max_tokens=16)
    req = chat(logprobs=None, stream=None)
    assert req.sampling_params() == chat().sampling_params()
    assert chat(stream=True, stream_options={"include_usage": None}).include_usage is False
    with pytest.raises(ValidationError):
        chat(stream="yes")
