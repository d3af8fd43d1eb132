"""The HTTP server over a real pipeline on a tiny CPU model, through the official openai client."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from delta_watcher import DeltaWatcher
from http_serving import running_server
from token_names import assert_names, bytes_of

from frontend import AsyncClient, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.openai_server.app import create_app
from protocol import FinishReason, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=16,
              max_num_batched_tokens=512)
PROMPTS = ["The quick brown fox", "Once upon a time there was a little model that", "a"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
GREEDY_BODY = {"temperature": 0, "max_tokens": 20, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(model=tiny_qwen3_dir, **ENGINE)) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def direct(pipeline):
    with Client(pipeline.address, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def base_url(pipeline):
    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(pipeline.address) as client:
            yield create_app(client, client.welcome.model)

    with running_server(make_app) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(direct) -> str:
    return direct.model


def test_models_lists_the_pipeline_model(oai, model):
    assert [m.id for m in oai.models.list().data] == [model]


def test_greedy_completion_equals_client_library(oai, direct, model, tiny_qwen3_dir):
    for prompt in PROMPTS:
        expected = direct.generate(prompt, params=SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, logprobs=True))
        got = oai.completions.create(model=model, prompt=prompt, logprobs=0, **GREEDY_BODY)
        choice = got.choices[0]
        assert choice.text == expected.text
        assert_names(choice.logprobs.tokens, tiny_qwen3_dir, expected.token_ids)
        assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert choice.finish_reason == "length"
        assert got.usage.prompt_tokens == expected.prompt_tokens
        assert got.usage.completion_tokens == 20


def test_concurrent_requests_are_batched_and_stay_greedy(oai, direct, model):
    expected = [direct.generate(p, params=GREEDY).text for p in PROMPTS * 2]

    def one(i: int) -> str:
        prompt = (PROMPTS * 2)[i]
        if i % 2:
            chunks = oai.completions.create(model=model, prompt=prompt, stream=True, **GREEDY_BODY)
            return "".join(c.choices[0].text for c in chunks)
        return oai.completions.create(model=model, prompt=prompt, **GREEDY_BODY).choices[0].text

    with cf.ThreadPoolExecutor(len(expected)) as pool:
        assert list(pool.map(one, range(len(expected)))) == expected


def test_streamed_completion_equals_client_library(oai, direct, model):
    expected = direct.generate(PROMPTS[1], params=GREEDY)
    chunks = list(oai.completions.create(model=model, prompt=PROMPTS[1], stream=True,
                                         stream_options={"include_usage": True}, **GREEDY_BODY))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == expected.prompt_tokens


def test_n_choices_sampled_and_greedy(oai, direct, model):
    """n choices are n engine requests: greedy ones agree, seeded ones reproduce and differ."""
    expected = direct.generate(PROMPTS[1], params=GREEDY)
    got = oai.completions.create(model=model, prompt=PROMPTS[1], n=3, **GREEDY_BODY)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [expected.text] * 3
    assert got.usage.prompt_tokens == expected.prompt_tokens
    assert got.usage.completion_tokens == 3 * 20
    sampled = dict(model=model, prompt=PROMPTS[1], n=4, temperature=1.0, seed=5, max_tokens=20,
                   extra_body={"ignore_eos": True})
    first = [c.text for c in oai.completions.create(**sampled).choices]
    assert [c.text for c in oai.completions.create(**sampled).choices] == first
    assert len(set(first)) > 1
    one = direct.generate(PROMPTS[1], params=SamplingParams(
        temperature=1.0, seed=6, max_tokens=20, ignore_eos=True))
    assert first[1] == one.text  # choice i is seeded with seed + i


def test_a_batch_of_prompts_as_the_openai_client_sends_it(oai, direct, model):
    """`prompt=[...]` (as LangChain's OpenAI LLM batches): choice i answers prompt i."""
    expected = [direct.generate(p, params=GREEDY) for p in PROMPTS]
    got = oai.completions.create(model=model, prompt=PROMPTS, **GREEDY_BODY)
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in got.choices] == [e.text for e in expected]
    assert got.usage.prompt_tokens == sum(e.prompt_tokens for e in expected)


def test_n_choices_streamed(oai, direct, model):
    expected = direct.generate(messages=MESSAGES, params=GREEDY)
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, n=2, stream=True,
                                              stream_options={"include_usage": True},
                                              **GREEDY_BODY))
    texts, roles, finishes = ["", ""], [None, None], [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] = roles[choice.index] or choice.delta.role
            finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert texts == [expected.text] * 2
    assert roles == ["assistant"] * 2 and finishes == ["length"] * 2
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == expected.prompt_tokens


def test_chat_top_logprobs(oai, model):
    got = oai.chat.completions.create(model=model, messages=MESSAGES, logprobs=True,
                                      top_logprobs=2, **GREEDY_BODY)
    content = got.choices[0].logprobs.content
    assert len(content) == 20
    for entry in content:  # greedy: the sampled token is the best alternative
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[1].logprob <= entry.top_logprobs[0].logprob


def test_logprobs_name_tokens_by_text_with_bytes_and_offsets(oai, direct, model,
                                                            tiny_qwen3_dir):
    """As OpenAI does: each token's text (its bytes too), where it starts in the text, the
    same whether streamed or not; never an id."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=True)
    expected = direct.generate(PROMPTS[1], params=params)
    full = oai.completions.create(model=model, prompt=PROMPTS[1], logprobs=1,
                                  **GREEDY_BODY).choices[0].logprobs
    assert_names(full.tokens, tiny_qwen3_dir, expected.token_ids)
    assert [b for b in expected.token_bytes] == [bytes_of(t) for t in full.tokens]
    assert [list(alts) for alts in full.top_logprobs] == [[t] for t in full.tokens]
    offsets = full.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == 20
    for i, token in enumerate(full.tokens[:-1]):  # while every token is whole characters
        if token.startswith("bytes:"):
            break
        assert offsets[i + 1] - offsets[i] == len(token)
    tokens, streamed = [], []
    for chunk in oai.completions.create(model=model, prompt=PROMPTS[1], logprobs=0,
                                        stream=True, **GREEDY_BODY):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            streamed += chunk.choices[0].logprobs.text_offset
    assert tokens == full.tokens and streamed == offsets

    chat_ids = direct.generate(messages=MESSAGES, params=params).token_ids
    content = oai.chat.completions.create(model=model, messages=MESSAGES, logprobs=True,
                                          **GREEDY_BODY).choices[0].logprobs.content
    assert_names([e.token for e in content], tiny_qwen3_dir, chat_ids)
    assert all(e.bytes == list(bytes_of(e.token)) for e in content)


def test_token_id_prompt(oai, direct, model):
    ids = direct.generate(PROMPTS[0], params=GREEDY).token_ids[:8]
    expected = direct.generate(prompt_token_ids=ids, params=GREEDY)
    got = oai.completions.create(model=model, prompt=ids, **GREEDY_BODY)
    assert got.choices[0].text == expected.text
    assert got.usage.prompt_tokens == len(ids)


def test_chat_equals_client_library(oai, direct, model):
    expected = direct.generate(messages=MESSAGES, params=GREEDY)
    got = oai.chat.completions.create(model=model, messages=MESSAGES, **GREEDY_BODY)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == expected.prompt_tokens
    streamed = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                **GREEDY_BODY))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_chat_template_kwargs_reach_the_template(oai, direct, model, tiny_qwen3_dir):
    """The tiny model's template writes Qwen3's empty reasoning block when enable_thinking is
    false; the variable reaches it from the HTTP body and from the client library."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)

    def prompt_tokens(**kwargs) -> int:
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                       **kwargs)
        return len(tok.encode(text, add_special_tokens=False))

    off = prompt_tokens(enable_thinking=False)
    assert off > prompt_tokens()
    got = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    assert got.usage.prompt_tokens == off
    out = direct.generate(messages=MESSAGES, params=SamplingParams(max_tokens=1),
                          chat_template_kwargs={"enable_thinking": False})
    assert out.prompt_tokens == off
    for bad in ({"chat_template": "{{ 7 * 7 }}"}, {"bos_token": "x"}, {"x": [1]}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                        extra_body={"chat_template_kwargs": bad})
        assert info.value.body["param"] == "chat_template_kwargs"


def test_chat_without_max_tokens_runs_to_the_context_limit(oai, direct, model):
    got = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == ENGINE["max_model_len"]


def test_stop_string(oai, direct, model):
    full = direct.generate(PROMPTS[0], params=GREEDY).text
    stop = full[len(full) // 2:][:3]
    got = oai.completions.create(model=model, prompt=PROMPTS[0], stop=stop, **GREEDY_BODY)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == full[:full.index(stop)]


def test_engine_rejections_are_400(oai, model):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt=[1, 10**9], max_tokens=2)
    assert "prompt[1] = 1000000000 is outside the vocabulary" in info.value.message
    assert info.value.param == "prompt"  # named as the body names it, not prompt_token_ids
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt="hi", max_tokens=10_000, stream=True)
    assert "max_tokens" in info.value.message and info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt="hi", n=17)
    assert info.value.body["param"] == "n"


def test_health(base_url):
    assert httpx.get(base_url + "/health").status_code == 200


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(base_url, pipeline, model):
    watcher = DeltaWatcher(pipeline.endpoints.deltas_pub)
    try:
        body = {"model": model, "prompt": "tell me a long story", "max_tokens": 110,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            events = (line for line in resp.iter_lines() if line)
            for _ in range(3):
                assert next(events).startswith("data: ")
        deadline = time.monotonic() + 10
        while not watcher.finished_with(FinishReason.ABORT) and time.monotonic() < deadline:
            time.sleep(0.02)
        aborted = watcher.finished_with(FinishReason.ABORT)
        assert len(aborted) == 1, watcher.finished
        assert watcher.tokens[aborted[0]] < 110
    finally:
        watcher.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_with_api_key(pipeline, direct, model):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend.openai_server.server", "--address", pipeline.address,
         "--port", str(port), "--api-key", "k3y", "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        resp = httpx.post(url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == direct.generate(PROMPTS[0], params=GREEDY).text
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          headers={"Authorization": "Bearer k3y"}, timeout=30) as stream:
            events = [line for line in stream.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
