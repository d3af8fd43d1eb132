"""The HTTP layer over a scripted stand-in client: shapes, SSE framing, errors, auth, aborts."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from http_fakes import BUSY, CRASH, DEAD_REASON, DIE_MIDWAY, REJECT, UNRUNNABLE, FakeClient
from http_serving import running_server, static_app

from frontend.openai_server.app import create_app
from protocol import SamplingParams

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture(scope="module")
def base_url(fake):
    with running_server(lambda: static_app(create_app(fake, "fake-model"))) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    # A fresh connection per request: a test that drops its connection mid-response (a
    # client disconnect) must not leave a half-closed keep-alive socket for the next one.
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=base_url, timeout=10, limits=limits) as client:
        yield client


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.dead = False
    fake.lost = None
    fake.token_delay_s = 0.0
    fake.fail_seed = None
    yield


def sse_events(lines) -> list[str]:
    """The data payloads of an SSE body, checking the `data: ...` + blank line framing."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"event not followed by a blank line: {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), line
        events.append(line[len("data: "):])
        expect_blank = True
    assert events and events[-1] == "[DONE]"
    return events[:-1]


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_completion_response_and_params(http, fake):
    resp = http.post("/v1/completions", json={
        "model": "fake-model", "prompt": "hello", "max_tokens": 3, "temperature": 0,
        "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 7, "stop": ["x"],
        "stop_token_ids": [9], "ignore_eos": True, "logprobs": 0, "user": "ann"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["text"] == "t0 t1 t2 " and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["token_id:100", "token_id:101", "token_id:102"]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.5, -2.5]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    call = fake.calls[-1]
    assert call.kwargs == {"prompt": "hello"} and not call.stream
    assert call.params == SamplingParams(temperature=0.0, top_p=0.9, top_k=5, min_p=0.05, seed=7,
                                         max_tokens=3, ignore_eos=True, stop=["x"],
                                         stop_token_ids=[9], logprobs=True)
    assert call.client_key == "ann"  # `user` names the caller for fair sharing


def test_each_caller_gets_a_client_key(http, fake):
    """Header first, then `user`, then the caller's address; a long name becomes a digest."""
    chat = {"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user",
                                                                   "content": "u"}]}
    keys = []
    for headers, user in (({"X-Client-Id": "team-a"}, "bob"), ({}, "bob"), ({}, None),
                          ({}, "x" * 500), ({}, "x" * 500), ({}, "y" * 500)):
        body = chat if user is None else {**chat, "user": user}
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        keys.append(fake.calls[-1].client_key)
    assert keys[:3] == ["team-a", "bob", "peer:127.0.0.1"]
    assert keys[3] == keys[4] != keys[5] and len(keys[3]) <= 64
    resp = http.post("/v1/completions", json={"prompt": "p", "max_tokens": 1, "user": 7})
    assert_error(resp, 400, "user")


def test_top_logprobs_in_both_apis(http):
    resp = http.post("/v1/completions", json={"model": "fake-model", "prompt": "p",
                                              "max_tokens": 2, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["logprobs"]["top_logprobs"] == [
        {"token_id:100": -0.5, "token_id:1000": -10.0},
        {"token_id:101": -1.5, "token_id:1000": -10.0}]
    resp = http.post("/v1/chat/completions", json={
        "model": "fake-model", "max_tokens": 2, "logprobs": True, "top_logprobs": 3,
        "messages": [{"role": "user", "content": "u"}]})
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == [
        ["token_id:100", "token_id:1000", "token_id:1001"],
        ["token_id:101", "token_id:1000", "token_id:1001"]]
    assert content[0]["top_logprobs"][0] == {"token": "token_id:100", "logprob": -0.5,
                                             "bytes": None}
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "fake-model", "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
            "stream": True, "messages": [{"role": "user", "content": "u"}]}) as stream:
        events = [json.loads(e) for e in sse_events(stream.iter_lines())]
    tops = [c["top_logprobs"] for e in events for ch in e["choices"]
            if ch.get("logprobs") for c in ch["logprobs"]["content"]]
    assert tops == [[{"token": "token_id:100", "logprob": -0.5, "bytes": None}],
                    [{"token": "token_id:101", "logprob": -1.5, "bytes": None}]]


def test_completion_token_id_prompt(http, fake):
    resp = http.post("/v1/completions", json={"model": "fake-model", "prompt": [5, 6, 7, 8]})
    assert resp.status_code == 200, resp.text
    assert fake.calls[-1].kwargs == {"prompt_token_ids": [5, 6, 7, 8]}
    assert resp.json()["usage"]["prompt_tokens"] == 4
    assert resp.json()["choices"][0]["logprobs"] is None


def test_chat_response(http, fake):
    resp = http.post("/v1/chat/completions", json={
        "model": "fake-model", "max_completion_tokens": 2, "logprobs": True,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "t0 t1 "}
    assert choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["token_id:100", "token_id:101"]
    assert [m.role for m in fake.calls[-1].kwargs["messages"]] == ["system", "user"]
    assert fake.calls[-1].params.max_tokens == 2


def test_chat_without_max_tokens_asks_for_the_rest_of_the_context(http, fake):
    for stream in (False, True):
        before = len(fake.calls)
        resp = http.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "u"}],
            "stream": stream})
        assert resp.status_code == 200, resp.text
        (call,) = fake.calls[before:]
        assert call.params.max_tokens is None  # the tokenizer turns it into what fits


def test_explicit_max_tokens_beyond_the_context_is_400(http):
    for path, body in (("/v1/completions", {"prompt": "p"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "u"}]})):
        resp = http.post(path, json={"model": "fake-model", "max_tokens": 1000, **body})
        assert "max_model_len" in assert_error(resp, 400)["message"]


def test_completion_stream_framing_and_usage(http):
    with http.stream("POST", "/v1/completions", json={
            "model": "fake-model", "prompt": "p", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(e) for e in sse_events(resp.iter_lines())]
    *chunks, usage = events
    assert [c["choices"][0]["text"] for c in chunks] == ["t0 ", "t1 ", "t2 "]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in events}) == 1
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_chat_stream_framing(http):
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "u"}],
            "max_tokens": 2, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [json.loads(e) for e in sse_events(resp.iter_lines())]
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "t0 "},
                      {"content": "t1 "}, {}]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]


def test_a_failing_choice_aborts_the_others(http, fake):
    """n requests: when one fails, the response is the error and no sibling keeps running."""
    before = len(fake.calls)
    resp = http.post("/v1/completions", json={"model": "fake-model", "prompt": "p",
                                              "max_tokens": 2, "n": 3, "seed": 1})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 3
    assert [c.params.seed for c in fake.calls[before:]] == [1, 2, 3]
    fake.token_delay_s, fake.fail_seed = 0.02, 2  # choice 1 dies after two tokens
    for stream in (False, True):
        before = len(fake.calls)
        resp = http.post("/v1/completions", json={"model": "fake-model", "prompt": "p",
                                                  "max_tokens": 50, "n": 3, "seed": 1,
                                                  "stream": stream})
        if stream:  # the failure arrives as an error event after the first deltas
            assert resp.status_code == 200
            assert "engine_dead" in resp.text and resp.text.endswith("data: [DONE]\n\n")
        else:
            assert_error(resp, 503)
        calls = fake.calls[before:]
        assert len(calls) == 3 and all(c.aborted for c in calls), calls


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "p", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "p", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "p", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "p", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "p", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "p", "stop": [""]}, "stop"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
])
def test_invalid_requests_are_400_naming_the_field(http, fake, path, body, param):
    before = len(fake.calls)
    for stream in (False, True):
        resp = http.post(path, json={"model": "fake-model", "stream": stream, **body})
        err = assert_error(resp, 400, param)
        assert err["type"] == "invalid_request_error"
    assert len(fake.calls) == before  # refused before reaching the engine


def test_malformed_json_is_400(http):
    resp = http.post("/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize("content, headers", [
    (b'{"prompt": "p"}', {"content-type": "application/x-www-form-urlencoded"}),  # curl -d
    (b'{"prompt": "p"}', {"content-type": "text/plain"}),
    (b'["p"]', {"content-type": "application/json"}),
    (b"null", {"content-type": "application/json"}),
    (b"", {}),
])
def test_a_body_that_is_not_a_json_object_is_400_saying_so(http, content, headers):
    err = assert_error(http.post("/v1/completions", content=content, headers=headers), 400)
    assert err["message"] == ("the request body must be a JSON object, sent with "
                              "'Content-Type: application/json'")


def test_engine_rejection_is_400(http):
    for stream in (False, True):
        resp = http.post("/v1/completions",
                         json={"model": "fake-model", "prompt": REJECT, "stream": stream})
        assert "refused" in assert_error(resp, 400)["message"]


def test_a_busy_engine_is_429_and_a_request_it_cannot_run_is_500(http):
    for stream in (False, True):
        resp = http.post("/v1/completions",
                         json={"model": "fake-model", "prompt": BUSY, "stream": stream})
        err = assert_error(resp, 429)
        assert err["type"] == "rate_limit_error" and "retry" in err["message"]
        resp = http.post("/v1/completions",
                         json={"model": "fake-model", "prompt": UNRUNNABLE, "stream": stream})
        assert assert_error(resp, 500)["type"] == "server_error"


def test_unexpected_failure_is_a_structured_500(http):
    for stream in (False, True):
        resp = http.post("/v1/completions",
                         json={"model": "fake-model", "prompt": CRASH, "stream": stream})
        assert "boom" in assert_error(resp, 500)["message"]


def test_unknown_model_and_route(http):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "p"}),
                       404, "model")
    assert err["code"] == "model_not_found"
    assert_error(http.get("/v1/nothing"), 404)


def test_models_and_health(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == 512
    health = http.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ready", "reason": None})
    assert http.head("/health").status_code == 200  # load balancers' health checks use HEAD


def test_a_model_is_retrieved_by_its_id(http):
    """openai's `client.models.retrieve(name)` is GET /v1/models/{name}."""
    assert http.get("/v1/models/fake-model").json() == http.get("/v1/models").json()["data"][0]
    err = assert_error(http.get("/v1/models/gpt-9"), 404, "model")
    assert err["code"] == "model_not_found"


def test_health_is_starting_until_the_client_is_welcomed():
    fake = FakeClient(started=False)
    app = create_app(fake, "m", max_model_len=512)
    with running_server(lambda: static_app(app)) as url:
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json() == {"status": "starting", "reason": "connecting to the engine"}
        fake.started = True
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ready"


def test_dead_engine_is_503(http, fake):
    fake.dead = True
    health = http.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "dead", "reason": DEAD_REASON}
    for stream in (False, True):
        resp = http.post("/v1/completions",
                         json={"model": "fake-model", "prompt": "p", "stream": stream})
        err = assert_error(resp, 503)
        assert err["type"] == "engine_dead"
        assert err["message"] == f"engine dead: {DEAD_REASON}"  # said once


def test_stop_null_is_no_stop_strings(http, fake):
    for path, body in (("/v1/completions", {"prompt": "p"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = http.post(path, json={**body, "max_tokens": 2, "stop": None})
        assert resp.status_code == 200, resp.text
        assert fake.calls[-1].params.stop == []


def test_a_lost_connection_is_503_until_reconnected(http, fake):
    """A stalled engine dropped the connection: the server says so and is ready again once its
    client has reconnected (no restart)."""
    fake.lost = "lost the connection to the pipeline at ipc://x (no answer)"
    health = http.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "reconnecting",
                                                         "reason": fake.lost})
    for stream in (False, True):
        err = assert_error(http.post("/v1/completions", json={"prompt": "p", "stream": stream}),
                           503)
        assert err["code"] == "engine_unreachable" and fake.lost in err["message"]
    fake.lost = None
    assert http.get("/health").json() == {"status": "ready", "reason": None}
    assert http.post("/v1/completions", json={"prompt": "p"}).status_code == 200


def test_engine_death_mid_stream_is_an_error_event(http):
    with http.stream("POST", "/v1/completions", json={
            "model": "fake-model", "prompt": DIE_MIDWAY, "max_tokens": 5,
            "stream": True}) as resp:
        assert resp.status_code == 200
        events = [json.loads(e) for e in sse_events(resp.iter_lines())]
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["t0 ", "t1 "]
    assert events[-1]["error"]["type"] == "engine_dead"


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_aborts_the_request(http, fake, n):
    fake.token_delay_s = 0.01
    before = len(fake.calls)
    with http.stream("POST", "/v1/completions", json={
            "model": "fake-model", "prompt": "long", "max_tokens": 500, "n": n,
            "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        calls = fake.calls[before:]
    assert len(calls) == n
    deadline = time.monotonic() + 5
    while not all(c.aborted for c in calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(c.aborted and not c.finished for c in calls)


def test_disconnect_while_not_streaming_aborts_the_request(base_url, fake):
    fake.token_delay_s = 0.01
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", timeout=0.3,
                   json={"model": "fake-model", "prompt": "long", "max_tokens": 500})
    call = fake.calls[-1]
    deadline = time.monotonic() + 5
    while not call.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call.aborted and not call.finished


def test_api_key():
    fake = FakeClient()
    with running_server(lambda: static_app(create_app(fake, "m", api_key=KEY))) as url:
        with httpx.Client(base_url=url, timeout=10) as http:
            body = {"model": "m", "prompt": "p", "max_tokens": 1}
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
                resp = http.post("/v1/completions", json=body, headers=headers)
                assert assert_error(resp, 401)["code"] == "invalid_api_key"
                assert_error(http.get("/v1/models", headers=headers), 401)
            assert not fake.calls
            ok = {"Authorization": f"Bearer {KEY}"}
            assert http.post("/v1/completions", json=body, headers=ok).status_code == 200
            assert http.get("/v1/models", headers=ok).status_code == 200
            assert http.get("/health").status_code == 200
