"""OpenAI's batched completions: `prompt` as a list of prompts answers each of them, `n`
choices apiece, choice i answering prompt i // n; usage counts each prompt once."""

from __future__ import annotations

import json

import httpx
import pytest
from http_fakes import FakeClient
from http_serving import running_server, static_app

from frontend.openai_server.app import create_app

PROMPTS = [[1, 2], [3, 4, 5]]


@pytest.fixture(scope="module")
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture(scope="module")
def http(fake):
    with running_server(lambda: static_app(create_app(fake, "fake-model"))) as url:
        with httpx.Client(base_url=url, timeout=10) as client:
            yield client


def test_each_prompt_gets_its_n_choices(http, fake):
    before = len(fake.calls)
    resp = http.post("/v1/completions", json={"prompt": PROMPTS, "n": 2, "max_tokens": 3,
                                              "seed": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "t0 t1 t2 " for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": 4 * 3,
                             "total_tokens": 17}
    calls = fake.calls[before:]
    assert [c.kwargs["prompt_token_ids"] for c in calls] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert [c.params.seed for c in calls] == [5, 6, 5, 6]  # each prompt's choices as n alone


def test_a_batch_streams_every_choice_and_counts_usage_once_per_prompt(http):
    body = {"prompt": ["first", "second", "third"], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "t0 t1 ", 1: "t0 t1 ", 2: "t0 t1 "}
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 * 7  # the fake counts 7 per text prompt
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * 2


def test_a_bad_prompt_in_a_batch_refuses_the_request_naming_it(http, fake):
    before = len(fake.calls)
    resp = http.post("/v1/completions", json={"prompt": [[1], [2**31]], "max_tokens": 2})
    assert resp.status_code == 400 and "prompt[1][0]" in resp.json()["error"]["message"]
    assert len(fake.calls) == before
