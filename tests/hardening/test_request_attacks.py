"""Attacks on a running pipeline through its client: each is refused or fails alone, by name,
and the engine answers exactly as before afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
import zmq
from attack_support import ENGINE, GREEDY, MAX_REQUEST_BYTES, PROMPT
from delta_watcher import DeltaWatcher
from token_names import assert_names

from frontend import Client, RequestRejected
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import AddRequest, FinishReason, SamplingParams, SamplingParamsError
from protocol.client_messages import RequestFieldError
from protocol.sockets import MessageSocket

TINY_VOCAB = 768


def _forged(**values) -> SamplingParams:
    """Parameters the library would refuse, as a client that skips its checks sends them."""
    params = SamplingParams(max_tokens=4)
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("top_k", 2**63), ("max_tokens", 2**31), ("seed", 2**63),
    ("stop_token_ids", [2**31]), ("top_p", 1e-300), ("temperature", 1e-300),
    ("repetition_penalty", 1e-300), ("temperature", 1e39),
])
def test_forged_parameters_are_refused_by_name(client, reference, field, value):
    """They reach the tokenizer as sent, which refuses them; nothing reaches a worker."""
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(RequestRejected, match=field):
        client.generate("hi", params=_forged(**{field: value}))
    assert client.generate(PROMPT, params=GREEDY).token_ids == reference


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 2**64), ("seed", 2**64), ("stop_token_ids", [2**64]), ("top_k", 10**30),
    ("temperature", 10**400),
])
def test_values_past_64_bits_name_their_field(field, value):
    """Not a bare "Integer value out of range" from msgpack."""
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("ids, match", [
    ([2**64], r"prompt_token_ids\[0\]"), ([5, 2**31], r"prompt_token_ids\[1\]"),
    ([1.7, 2.2], r"prompt_token_ids\[0\] must be an integer"),
    ([3, True], r"prompt_token_ids\[1\] must be an integer"),
])
def test_prompt_token_ids_that_are_no_token_ids_are_refused(client, reference, ids, match):
    with pytest.raises(RequestFieldError, match=match):
        client.generate(prompt_token_ids=ids, params=GREEDY)
    assert client.generate(PROMPT, params=GREEDY).token_ids == reference


def test_numpy_token_ids_are_still_accepted(client, reference):
    np = pytest.importorskip("numpy")
    ids = client.generate(PROMPT, params=GREEDY)
    assert ids.token_ids == reference
    out = client.generate(prompt_token_ids=np.array([5, 6, 7], np.int64), params=GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens


def _inject(pipeline: Pipeline, request: AddRequest) -> None:
    """Send an AddRequest straight to the scheduler, as if a tokenizer had let it through."""
    ctx = zmq.Context()
    sock = MessageSocket(ctx, zmq.PUSH, pipeline.endpoints.scheduler_in, bind=False)
    try:
        sock.send(request)
    finally:
        sock.socket.close(linger=2000)
        ctx.term()


def _attack_alongside_a_healthy_request(pipeline: Pipeline, client: Client,
                                        reference: list[int]) -> None:
    # The ids an AddRequest can carry are int32s (one past int32 cannot be put in one, and a
    # frame that has one is refused by the scheduler's decoder: test_internal_links).
    bad = {10**9: [1, TINY_VOCAB + 5, 2], 10**9 + 1: [1, 2**31 - 1], 10**9 + 2: [-7, 3]}
    watcher = DeltaWatcher(pipeline.endpoints.deltas_pub)
    try:
        stream = client.stream(PROMPT, params=GREEDY)
        tokens = list(next(stream).token_ids)  # the healthy request is running now
        for rid, ids in bad.items():
            _inject(pipeline, AddRequest(rid, ids, SamplingParams(max_tokens=30), [0]))
        for delta in stream:
            tokens += delta.token_ids
        assert tokens == reference
        for rid in bad:
            reason, error = watcher.wait_for(rid)
            assert reason is FinishReason.ERROR
            assert "outside the vocabulary" in error.message, error
    finally:
        watcher.close()
    for _ in range(3):  # the engine goes on serving, and its answers have not changed
        assert client.generate(PROMPT, params=GREEDY).token_ids == reference


def test_a_sequence_no_worker_can_run_fails_alone(pipeline, client, reference):
    """Token ids past the vocabulary (up to the largest int32) or negative passed every check
    before the worker's (here by skipping the tokenizer), packed as int32 like every prompt:
    the worker refuses that sequence only, the scheduler fails its request with the reason
    and frees its blocks, and the rest goes on."""
    _attack_alongside_a_healthy_request(pipeline, client, reference)


def test_with_two_ranks_both_refuse_the_same_sequence(tiny_qwen3_dir, reference):
    """Every rank checks the same plan against the same mirror, so they stay in step."""
    cfg = EngineConfig(model=tiny_qwen3_dir, tensor_parallel_size=2, **ENGINE)
    with Pipeline(cfg) as pipeline, Client(pipeline.address, timeout=60) as client:
        _attack_alongside_a_healthy_request(pipeline, client, reference)


# ------------------------------------------------------------------ the same through HTTP

def _post(base_url: str, body: bytes | dict, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base_url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"})


def _http_still_serves(base_url: str, reference: list[int], model_dir: str) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": GREEDY.max_tokens,
            "ignore_eos": True, "logprobs": 0}
    resp = _post(base_url, body)
    assert resp.status_code == 200, resp.text
    assert_names(resp.json()["choices"][0]["logprobs"]["tokens"], model_dir, reference)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1e30}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1000000000000000000000000000000}',
     "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"max_completion_tokens": 18446744073709551616}', "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": [18446744073709551616]}', "prompt[0]"),
    ("/v1/completions", b'{"prompt": [[5, 2147483648]]}', "prompt[0][1]"),
    ("/v1/completions", b'{"prompt": [1.7, 2.2]}', "prompt[0]"),
    ("/v1/completions", b'{"prompt": "a", "top_k": 2147483648}', "top_k"),
    ("/v1/completions", b'{"prompt": "a", "top_p": 1e-300}', "top_p"),
    ("/v1/completions", b'{"prompt": "a", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", b'{"prompt": "a", "stop_token_ids": [18446744073709551616]}',
     "stop_token_ids"),
])
def test_http_attacks_are_400s_naming_the_field(base_url, reference, path, body, param,
                                                 tiny_qwen3_dir):
    resp = _post(base_url, body, path)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    _http_still_serves(base_url, reference, tiny_qwen3_dir)


def test_an_oversized_body_is_refused_before_it_is_read(base_url, reference, tiny_qwen3_dir):
    big = b'{"prompt": "' + b"word " * (MAX_REQUEST_BYTES // 5 + 10) + b'"}'
    resp = _post(base_url, big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the server counts while the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 10_000 + 2):
            yield b"x" * 10_000
        yield b'"}'

    resp = httpx.post(base_url + "/v1/completions", content=chunked(), timeout=60,
                      headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers
    assert resp.status_code == 413
    # A body under the cap is parsed as usual (here: too long a prompt, a 400).
    resp = _post(base_url, {"prompt": "word " * (MAX_REQUEST_BYTES // 6), "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    _http_still_serves(base_url, reference, tiny_qwen3_dir)
