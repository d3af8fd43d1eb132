from __future__ import annotations

import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
from protocol.codec import kind_of
from protocol.control import ReplicaDown, StartupProgress
from protocol.engine_messages import (
    ENGINE_STATS_TOPIC,
    EngineStats,
    WatchGoodbye,
    WatchHeartbeat,
    WatchRequest,
)
from protocol.kv_handoff import (
    CudaPoolHandle,
    HandoffAccept,
    HandoffCancel,
    HandoffOffer,
    HandoffPeerDown,
    HandoffRelease,
    KVBlocksReady,
    KVCancel,
    KVExport,
    KVFrameHeader,
    KVLanded,
    KVPoolShare,
)
from protocol.outcomes import FINISH_REASON_STRINGS, ErrorKind, FinishReason, RequestError
from protocol.startup_phases import StartupPhase

STOP, LENGTH, ERROR = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR
EMPTY = RequestError(ErrorKind.INVALID_REQUEST, "prompt must not be empty", "prompt")
DEAD = RequestError(ErrorKind.ENGINE_DEAD, "engine dead: worker 0 exited")

PARAMS = p.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                          max_tokens=33, ignore_eos=True, stop=["\n\n", "END"],
                          stop_token_ids=[2, 3], logprobs=True, skip_special_tokens=False)

METRICS = p.RequestMetrics(1.7e9, 0.01, 0.05, 0.002, 0.2, 40, 32, 9, 1, LENGTH)

EXAMPLES = [
    p.GenerateRequest("r1", "hello", None, None, PARAMS, True),
    p.GenerateRequest("r2", None, [1, 2, 3], None, p.SamplingParams(), False),
    p.GenerateRequest("r3", None, None, [p.ChatMessage("user", "hi")], PARAMS, True),
    p.AbortRequest("r1"),
    p.ClientHello("client-1"),
    p.ClientWelcome("ipc:///tmp/x/results", "tiny", 2048, "ipc:///tmp/x/deltas_pub"),
    p.ResultDelta("r1", "text ✓", [5, 6], STOP, 3, 2, [-0.5, -1.0], None),
    p.ResultDelta("r1", "", [], ERROR, 0, 0, None, EMPTY),
    p.ResultDeltaBatch([
        p.ResultDelta("r1", "a", [5], None, 3, 1, None, None),
        p.ResultDelta("r2", "b", [6], LENGTH, 4, 9, [-0.1], None),
        p.ResultDelta("r3", "", [], ERROR, 4, 0, None, DEAD),
    ]),
    p.EngineDead("worker rank 1 exited with code -9"),
    p.AddRequest(4, [1, 2, 3], PARAMS, [0], "r1"),
    p.AbortRequests([4, 5], STOP),
    p.DetokRequestInfo(4, "client-1", "r1", [7, 8], 120, ["END"], True, True, False),
    p.StepPlan(
        9, [1, 2],
        [p.NewSequence(4, [1, 2, 3], 3, 0, 3, [10], PARAMS)],
        p.CachedSequences([5, 6], [1, 1], [[], [11]]),
    ),
    p.StepResult(9, [4, 5], [100, 101], None),
    p.StepResult(9, [4], [100], [-0.25]),
    p.TokenDeltas(9, [4, 5], [[100], []], [None, LENGTH], [None, None], None),
    p.TokenDeltas(p.OUT_OF_BAND_STEP, [4, 5, 6], [[], [], []], [None, ERROR, ERROR],
                  [None, DEAD, EMPTY], None),
    p.TokenDeltas(10, [4], [[7]], [LENGTH], [None], None, None, None, [4], [METRICS]),
    p.ResultDelta("r1", "done", [7], LENGTH, 3, 1, None, None, metrics=METRICS),
    WatchHeartbeat(1.0, None),
    WatchRequest(4, "r1"),
    WatchGoodbye("worker 0 exited with code -9", True),
    EngineStats(12.5, 40, 900, 300, 1200, 1, 7, 0.25, 0.5, 3, 2, 41, 100),
    EngineStats(12.5, 40, 900, 300, 1200, 1, 7, 0.25, 0.5, 3, 2, 41, 100, 12, 9, 0.4, 5,
                [5, 1, 1, 0],
                [METRICS, p.RequestMetrics(1.7e9, None, None, None, 0.5, 9, 0, 0, 0, ERROR)]),
    p.Ready("worker", 0, 1234, "cuda:0"),
    p.Ready("worker", 1, 1234, "cuda:1", 0, 0,
            [StartupPhase("weights", 1.25), StartupPhase("kv", 0.5)]),
    p.Shutdown("SIGTERM"),
    p.StartupFailed("worker", 1, "KV cache too small"),
    StartupProgress("worker", 0, "loading weights"),
    ReplicaDown(1, "scheduler of replica 1 exited with code -9"),
    HandoffOffer(7, 0, [1, 2, 3, 9], 3, 3, p.SamplingParams(temperature=0, max_tokens=4), [2],
                 1.7e9, 0.01, 0.2, 0, 0, 0, 1),
    HandoffAccept(7, 1, [5]),
    HandoffRelease(7, True, 4096, 0.002),
    HandoffCancel(7),
    KVExport(7, [3], 1, [5]),
    KVCancel([7, 8]),
    KVLanded(7, 0, 4096),
    KVFrameHeader(7, [5], "torch.float32", [2, 1, 1, 16, 2, 8], True),
    HandoffPeerDown(0, "replica 0 scheduler 0 was killed by SIGKILL", [7, 8]),
    KVPoolShare(0, "torch.bfloat16", [2, 28, 4096, 16, 8, 128], 4242, 17),
    KVPoolShare(0, "torch.bfloat16", [2, 28, 4096, 16, 8, 128], 4242, -1,
                CudaPoolHandle(0, b"\x01" * 64, 1 << 30, 512, b"/torch_4242_1", 8, b"\x02" * 64,
                               True, "GPU-6f1c2a3e-0d4b-4c55-9b1a-2f0e8d7c6b5a")),
    KVBlocksReady(7, 0, [3, 4], [5, 6]),
]


def example(cls):
    return next(m for m in EXAMPLES if type(m) is cls)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    decoded = p.Decoder(type(msg)).decode(p.encode(msg))
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_every_registered_message_has_an_example():
    from protocol.codec import _registered_kinds

    assert set(_registered_kinds.values()) == {type(m) for m in EXAMPLES}


def test_kinds_are_single_bytes_and_unique():
    kinds = [kind_of(type(m)) for m in {type(m): m for m in EXAMPLES}.values()]
    assert len(kinds) == len(set(kinds))
    assert all(0 <= k <= 0x7F for k in kinds)


def test_engine_stats_start_with_their_subscription_topic():
    # A subscriber that wants only the stats subscribes to this prefix of deltas_pub.
    assert p.encode(example(EngineStats)).startswith(ENGINE_STATS_TOPIC)
    for other in (WatchHeartbeat(1.0, None), example(p.TokenDeltas)):
        assert not p.encode(other).startswith(ENGINE_STATS_TOPIC)


def test_pickle_is_refused():
    decoder = p.Decoder(p.StepPlan, p.AddRequest)
    for msg in (example(p.AddRequest), example(p.StepPlan)):
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            with pytest.raises(p.ProtocolError):
                decoder.decode(pickle.dumps(msg, protocol=proto))


def test_kind_not_accepted_on_this_socket():
    frame = p.encode(p.AbortRequests([1], FinishReason.ABORT))
    with pytest.raises(p.ProtocolError, match="not accepted"):
        p.Decoder(p.StepResult).decode(frame)


def test_truncated_frames_are_refused():
    frame = p.encode(example(p.StepPlan))
    decoder = p.Decoder(p.StepPlan)
    for cut in range(len(frame)):
        with pytest.raises(p.ProtocolError):
            decoder.decode(frame[:cut])


def test_oversized_frame_is_refused_before_parsing():
    decoder = p.Decoder(p.AddRequest, max_bytes=1024)
    big = p.encode(p.AddRequest(1, list(range(1000)), p.SamplingParams(), [0]))
    with pytest.raises(p.ProtocolError, match="exceeds"):
        decoder.decode(big)


@pytest.mark.parametrize(
    "payload, match",
    [
        ([0x21, 1, [1], [2]], "expected 13 fields"),
        ([0x21, 1, [1], [2], None, None, None, [], [], None, None, 0.0, [], [], "extra"],
         "expected 13 fields"),
        ([0x21, "1", [1], [2], None, None, None, [], [], None, None, 0.0, [], []],
         "StepResult.step_id"),
        ([0x21, True, [1], [2], None, None, None, [], [], None, None, 0.0, [], []],
         "StepResult.step_id"),
        ([0x21, 1, [1.5], [2], None, None, None, [], [], None, None, 0.0, [], []],
         "StepResult.seq_ids"),
        ([0x21, 1, [1], [2], None, [[3, "x"]], None, [], [], None, None, 0.0, [], []],
         "StepResult.top_token_ids"),
        ([0x21, 1, [1], [2], None, None, None, [1], [2], None, None, 0.0, [], []],
         "StepResult.failed_errors"),
        # ints as floats
        ([0x21, 1, [1], [2], [1], [[3, 4]], [[0, -1]], [], [], None, None, 0.0, [], []], None),
        ({"kind": 0x21}, "array"),
        ([], "array"),
        (["StepResult", 1], "array"),
    ],
)
def test_malformed_fields(payload, match):
    frame = msgpack.packb(payload)
    decoder = p.Decoder(p.StepResult)
    if match is None:
        assert decoder.decode(frame).logprobs == [1.0]
        return
    with pytest.raises(p.ProtocolError, match=match):
        decoder.decode(frame)


def test_nested_struct_is_type_checked():
    good = msgpack.unpackb(p.encode(example(p.AddRequest)))
    good[3][0] = -1.0  # temperature
    with pytest.raises(p.ProtocolError, match="temperature"):
        p.Decoder(p.AddRequest).decode(msgpack.packb(good))
    good[3] = [1, 2]
    with pytest.raises(p.ProtocolError, match="SamplingParams"):
        p.Decoder(p.AddRequest).decode(msgpack.packb(good))


def test_finish_reasons_and_errors_travel_as_enums():
    frame = p.encode(p.ResultDeltaBatch([p.ResultDelta("r", "", [], ERROR, 0, 0, None, DEAD)]))
    raw = msgpack.unpackb(frame)
    assert raw[1][0][3] == 3 and raw[1][0][7] == [2, DEAD.message, None]  # integers, no text
    (delta,) = p.Decoder(p.ResultDeltaBatch).decode(frame).deltas
    assert delta.finish_reason is FinishReason.ERROR and delta.error.kind is ErrorKind.ENGINE_DEAD
    deltas = p.Decoder(p.TokenDeltas).decode(p.encode(example(p.TokenDeltas)))
    assert [type(r) for r in deltas.finish_reasons] == [type(None), FinishReason]
    running = p.TokenDeltas(3, [1, 2], [[5], [6]], [None, None], [None, None], None)
    assert p.Decoder(p.TokenDeltas).decode(p.encode(running)) == running


def test_the_one_table_names_every_finish_reason_as_openai_does():
    assert {str(r) for r in FinishReason} == {"stop", "length", "abort", "error"}
    assert set(FINISH_REASON_STRINGS) == set(FinishReason)
    assert f"{FinishReason.LENGTH}" == "length"


@pytest.mark.parametrize("payload, match", [
    ([0x11, [1], 4], "not a FinishReason"),
    ([0x11, [1], "stop"], "not a FinishReason"),
    ([0x11, [1], True], "not a FinishReason"),
    ([0x22, 1, [1], [[]], [9], [None], None, None, None, [], [], [], []], "not a FinishReason"),
    ([0x22, 1, [1], [[]], [3], [[7, "x", None]], None, None, None, [], [], [], []],
     "not a ErrorKind"),
    ([0x22, 1, [1], [[]], [3], ["engine dead: x"], None, None, None, [], [], [], []],
     "RequestError"),
    # a column that is mostly None is still checked item by item once one is not
    ([0x22, 1, [1, 2], [[], []], [None, 9], [None, None], None, None, None, [], [], [], []],
     "not a FinishReason"),
    ([0x22, 1, [1, 2], [[], []], [None, None], [None, "x"], None, None, None, [], [], [], []],
     "RequestError"),
])
def test_unknown_enum_values_are_refused(payload, match):
    decoder = p.Decoder(p.AbortRequests, p.TokenDeltas)
    with pytest.raises(p.ProtocolError, match=match):
        decoder.decode(msgpack.packb(payload))


def test_a_refused_nested_field_is_named_from_the_message_down():
    raw = msgpack.unpackb(p.encode(p.GenerateRequest("r1", "hi", None, None, PARAMS, False)))
    raw[5][1] = 0.0  # top_p
    with pytest.raises(p.ProtocolError) as info:
        p.Decoder(p.GenerateRequest).decode(msgpack.packb(raw))
    assert info.value.field == "params.top_p"


def test_extension_types_are_refused():
    frame = msgpack.packb([0x11, msgpack.ExtType(1, b"x"), 2])
    with pytest.raises(p.ProtocolError, match="extension"):
        p.Decoder(p.AbortRequests).decode(frame)


def test_unregistered_object_cannot_be_encoded():
    with pytest.raises(TypeError):
        p.encode(PARAMS)  # a nested struct, not a message


ALL_TYPES = tuple({type(m) for m in EXAMPLES})


@given(st.binary(max_size=512))
@settings(max_examples=400, deadline=None)
def test_arbitrary_bytes_decode_or_raise_protocol_error(frame):
    try:
        msg = p.Decoder(*ALL_TYPES).decode(frame)
    except p.ProtocolError:
        return
    assert type(msg) in ALL_TYPES


@given(st.sampled_from(EXAMPLES), st.data())
@settings(max_examples=300, deadline=None)
def test_corrupted_frames_decode_or_raise_protocol_error(msg, data):
    frame = bytearray(p.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    try:
        decoded = p.Decoder(*ALL_TYPES).decode(bytes(frame))
    except p.ProtocolError:
        return
    assert type(decoded) in ALL_TYPES
