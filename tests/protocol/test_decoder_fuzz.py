"""Fuzz every socket's decoder: any input is an allowed message or a ProtocolError.

Each decoder is built with the message types its socket accepts (as the actors configure
them). Inputs are random bytes, msgpack values of the wrong shape, and valid frames mutated
at the byte level and at the structure level. The three strategies share the example count
NANOPIPE_FUZZ_EXAMPLES (default 2,400: about 15 s of CPU, under a minute on a loaded 2-core
machine);

    NANOPIPE_FUZZ_EXAMPLES=102000 python3 -m pytest -q -m slow --timeout=0 \
        tests/protocol/test_decoder_fuzz.py

runs the full 100,000+.
"""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import EXAMPLES

import protocol as p
from protocol.codec import _registered_kinds

SOCKET_DECODERS = {
    "tokenizer (clients)": (p.ClientHello, p.GenerateRequest, p.AbortRequest),
    "results (clients)": (p.ClientHello,),
    "client inbound": (p.ClientWelcome, p.ResultDelta, p.ResultDeltaBatch, p.EngineDead),
    "tokenizer_ctl": (p.EngineDead, p.Shutdown),
    "scheduler_in": (p.AddRequest, p.AbortRequests, p.EngineDead, p.Shutdown),
    "step_results": (p.StepResult,),
    "worker steps": (p.StepPlan, p.Shutdown),
    "detok_in": (p.DetokRequestInfo, p.TokenDeltas, p.EngineDead, p.Shutdown),
    "deltas_pub (attached)": (p.TokenDeltas,),
    "control": (p.Ready, p.StartupFailed),
}
DECODERS = {name: p.Decoder(*types) for name, types in SOCKET_DECODERS.items()}
KINDS = sorted(_registered_kinds)
VALID_FRAMES = [p.encode(m) for m in EXAMPLES]

TOTAL = int(os.environ.get("NANOPIPE_FUZZ_EXAMPLES", "2400"))
PER_STRATEGY = max(1, TOTAL // 3)
FUZZ = settings(max_examples=PER_STRATEGY, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

sockets = st.sampled_from(sorted(DECODERS))
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.binary(max_size=20) | st.sampled_from(KINDS))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=10)
# Message fields nest at most three lists deep; a flatter strategy is also four times faster.
shallow = (scalars | st.lists(scalars, max_size=4)
           | st.lists(st.lists(scalars, max_size=3), max_size=3))
wrong_shapes = values | st.builds(lambda kind, fields: [kind, *fields],
                                  st.sampled_from(KINDS) | st.integers(-1, 200),
                                  st.lists(shallow, max_size=9))


def check(socket: str, frame: bytes) -> None:
    """The property: an allowed message (that survives a round trip) or ProtocolError."""
    try:
        msg = DECODERS[socket].decode(frame)
    except p.ProtocolError:
        return
    assert isinstance(msg, SOCKET_DECODERS[socket]), (socket, msg)
    assert DECODERS[socket].decode(p.encode(msg)) == msg


def _mutate_value(value, path: list[int], replacement):
    """Replace the element at `path` inside nested lists (or the value itself)."""
    if not path or type(value) is not list or not value:
        return replacement
    i = path[0] % len(value)
    copy = list(value)
    copy[i] = _mutate_value(value[i], path[1:], replacement)
    return copy


@pytest.mark.slow
@FUZZ
@given(socket=sockets, frame=st.binary(max_size=256))
def test_random_bytes(socket, frame):
    check(socket, frame)


@pytest.mark.slow
@FUZZ
@given(socket=sockets, payload=wrong_shapes)
def test_msgpack_of_the_wrong_shape(socket, payload):
    check(socket, msgpack.packb(payload, use_bin_type=True))


@pytest.mark.slow
@FUZZ
@given(socket=sockets, base=st.sampled_from(VALID_FRAMES), data=st.data())
def test_mutated_valid_frames(socket, base, data):
    if data.draw(st.booleans(), label="structural"):
        wire = msgpack.unpackb(base, raw=False)
        path = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=4), label="path")
        op = data.draw(st.sampled_from(["replace", "drop", "kind"]), label="op")
        if op == "replace":
            wire = _mutate_value(wire, path, data.draw(values, label="value"))
        elif op == "drop":
            wire = wire[: path[0] % len(wire)] + wire[path[0] % len(wire) + 1:]
        else:
            wire = [data.draw(st.sampled_from(KINDS), label="kind"), *wire[1:]]
        frame = msgpack.packb(wire, use_bin_type=True)
    else:
        frame = bytearray(base)
        for _ in range(data.draw(st.integers(1, 4), label="edits")):
            at = data.draw(st.integers(0, max(0, len(frame) - 1)), label="at")
            edit = data.draw(st.sampled_from(["flip", "cut", "insert"]), label="edit")
            if edit == "flip" and frame:
                frame[at] = data.draw(st.integers(0, 255), label="byte")
            elif edit == "cut":
                del frame[at:]
            else:
                frame[at:at] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        frame = bytes(frame)
    check(socket, frame)


def test_every_socket_decoder_accepts_its_own_examples():
    """The fuzz targets are the decoders the actors use: each takes its own kinds."""
    for name, types in SOCKET_DECODERS.items():
        for msg in EXAMPLES:
            if isinstance(msg, types):
                assert DECODERS[name].decode(p.encode(msg)) == msg
