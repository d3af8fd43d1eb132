"""Attacks on a running pipeline through its client: each is refused or fails alone, by name,
and the engine answers exactly as before afterwards."""

from __future__ import annotations

import pytest
import zmq
from conftest import ENGINE, GREEDY, PROMPT, DeltaWatcher

from frontend import Client, RequestRejected
from frontend.config import EngineConfig
from frontend.launcher import Pipeline
from protocol import AddRequest, SamplingParams, SamplingParamsError
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
    bad = {10**9: [1, TINY_VOCAB + 5, 2], 10**9 + 1: [1, 2**40]}
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
            assert reason == "error"
            assert "outside the vocabulary" in error, error
    finally:
        watcher.close()
    for _ in range(3):  # the engine goes on serving, and its answers have not changed
        assert client.generate(PROMPT, params=GREEDY).token_ids == reference


def test_a_sequence_no_worker_can_run_fails_alone(pipeline, client, reference):
    """Token ids past the vocabulary and past int32 passed every check before the worker's
    (here by skipping the tokenizer): the worker refuses that sequence only, the scheduler
    fails its request with the reason and frees its blocks, and the rest goes on."""
    _attack_alongside_a_healthy_request(pipeline, client, reference)


def test_with_two_ranks_both_refuse_the_same_sequence(tiny_qwen3_dir, reference):
    """Every rank checks the same plan against the same mirror, so they stay in step."""
    cfg = EngineConfig(model=tiny_qwen3_dir, tensor_parallel_size=2, **ENGINE)
    with Pipeline(cfg) as pipeline, Client(pipeline.address, timeout=60) as client:
        _attack_alongside_a_healthy_request(pipeline, client, reference)
